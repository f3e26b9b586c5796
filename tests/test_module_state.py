"""`module=` and `buffers=` on every optimizer, as DDP keeps a model's state: ranks seeded differently start
from rank 0's whole state (buffers, frozen parameters), and after each step the buffers are rank 0's
("broadcast"), averaged with the model's own exchange ("average", checked against numpy), or each peer's
own ("local"), with the bytes of the exchange counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from peers import user_loop_peer as loop

import topologies
from dpsgd.comm import init, run_local
from dpsgd.optim import ALGORITHMS, DPSGD, AllReduce, LocalSGD
from dpsgd.optim.base import BUFFER_MODES

N = 4


bn_model = loop.whole_model


def state(model: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_every_optimizer_brings_the_whole_module_state_from_rank_0():
    results = run_local(N, loop.module_state, timeout_s=60)
    rank0 = {k: v.double().reshape(-1).tolist() for k, v in bn_model(0).state_dict().items()}
    for name in ALGORITHMS:
        for r, result in enumerate(results):
            assert result[name] == rank0, f"{name}: rank {r}'s state is not rank 0's"


def one_step(comm, make, buffers: str):
    """One training step on this peer's own batch; the buffers after its forward pass and after the step."""
    torch.manual_seed(0)
    model = bn_model(0)
    opt = make(model, comm, buffers)
    generator = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(8, 5, generator=generator) * (1 + comm.rank)
    before_bytes = comm.stats.bytes_sent
    model(x).pow(2).mean().backward()
    forward = state(model)
    opt.step()
    return {"forward": forward, "after": state(model), "bytes": comm.stats.bytes_sent - before_bytes}


ALLREDUCE = lambda model, comm, buffers: AllReduce(  # noqa: E731
    torch.optim.SGD(model[0].parameters(), lr=0.1), comm=comm, module=model, buffers=buffers
)
GOSSIP = lambda model, comm, buffers: DPSGD(  # noqa: E731
    torch.optim.SGD(model[0].parameters(), lr=0.1),
    topology=topologies.make("ring", comm.size),
    comm=comm,
    module=model,
    buffers=buffers,
)
FLOATING = ("1.running_mean", "1.running_var", "1.weight", "1.bias")  # BatchNorm's buffers (and its params)


@pytest.mark.parametrize("make", [ALLREDUCE, GOSSIP], ids=["allreduce", "dpsgd"])
def test_the_three_buffer_modes_do_what_they_say(make):
    results = {mode: run_local(N, lambda comm, m=mode: one_step(comm, make, m), timeout_s=60) for mode in BUFFER_MODES}
    keys = ("1.running_mean", "1.running_var", "1.num_batches_tracked")
    forward = [r["forward"] for r in results["local"]]
    assert not torch.equal(forward[0]["1.running_mean"], forward[1]["1.running_mean"])  # the peers' stats differ
    for r in range(N):
        for key in keys:
            assert torch.equal(results["local"][r]["after"][key], forward[r][key]), f"local: rank {r}'s {key}"
            assert torch.equal(results["broadcast"][r]["after"][key], forward[0][key]), f"broadcast: rank {r}'s {key}"
    # average: the exact mean (all-reduce) or the ring's W (gossip) over the peers' running statistics
    w = np.eye(N) if make is ALLREDUCE else topologies.make("ring", N).mixing_matrix(0)
    for key in keys[:2]:
        stats = np.stack([f[key].double().numpy() for f in forward])
        expected = np.full((N, N), 1 / N) @ stats if make is ALLREDUCE else w @ stats
        for r in range(N):
            got = results["average"][r]["after"][key].double().numpy()
            np.testing.assert_allclose(got, expected[r], rtol=1e-6, err_msg=f"average: rank {r}'s {key}")
        assert torch.equal(results["average"][0]["after"][keys[2]], forward[0][keys[2]])  # a counter stays local
    local, broadcast, average = (results[m][1]["bytes"] for m in ("local", "broadcast", "average"))
    assert broadcast > local and average > local  # the exchanges are counted


def test_local_sgd_averages_buffers_only_when_it_averages_the_models():
    make = lambda model, comm, buffers: LocalSGD(  # noqa: E731
        torch.optim.SGD(model[0].parameters(), lr=0.1), comm=comm, module=model, buffers=buffers, period=2
    )

    def peer(comm):
        model = bn_model(0)
        opt = make(model, comm, "average")
        seen = []
        for t in range(2):
            x = torch.randn(8, 5, generator=torch.Generator().manual_seed(10 * comm.rank + t)) * (1 + comm.rank)
            model(x).pow(2).mean().backward()
            opt.step()
            seen.append(model[1].running_mean.clone())
        return seen

    results = run_local(N, peer, timeout_s=60)
    assert not torch.equal(results[0][0], results[1][0])  # step 1: no averaging
    assert all(torch.equal(r[1], results[0][1]) for r in results)  # step 2: averaged with the models


def test_buffer_options_are_refused_in_one_line():
    model = bn_model(0)
    base = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with pytest.raises(ValueError, match="buffers must be one of broadcast, average, local"):
        AllReduce(base, comm=init("local"), module=model, buffers="mean")
    with pytest.raises(TypeError, match="module= takes the model"):
        AllReduce(base, comm=init("local"), module=base)


class WithStatistic(torch.nn.Module):
    """A linear layer and a floating buffer the test sets before each step (a running statistic)."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 2)
        self.register_buffer("statistic", torch.zeros(5, dtype=torch.float64))


def test_average_buffers_mix_with_the_steps_own_matrix_on_a_time_varying_topology():
    """buffers="average" on D-PSGD over one_peer_exponential (W(k) changes every step): after step k (k = 0, 1,
    ...) the buffers are W(k) times the peers' buffers, the matrix the parameters mixed with at that step (cta,
    lr 0: x <- W(k) x), checked against numpy with the topology's mixing_matrix(k)."""
    n, steps = 8, 5
    topology = topologies.make("one_peer_exponential", n)
    starts = np.random.default_rng(2).normal(size=(n, 8))  # each peer's own parameters (broadcast_initial=False)
    values = np.random.default_rng(3).normal(size=(steps, n, 5))  # each peer's statistic before each step

    def peer(comm):
        model = WithStatistic().double()
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(torch.tensor(starts[comm.rank]), model.parameters())
        opt = DPSGD(
            torch.optim.SGD(model.parameters(), lr=0.0),
            topology=topologies.make("one_peer_exponential", comm.size),
            comm=comm,
            module=model,
            buffers="average",
            broadcast_initial=False,
        )
        out = []
        for k in range(steps):
            model.statistic.copy_(torch.tensor(values[k, comm.rank]))
            model.layer(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
            opt.step()
            params = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
            out.append((params.numpy().copy(), model.statistic.numpy().copy()))
        return out

    results = run_local(n, peer, timeout_s=60)
    x = starts.copy()
    for k in range(steps):
        w = topology.mixing_matrix(k)
        x = w @ x
        for r in range(n):
            params, statistic = results[r][k]
            np.testing.assert_allclose(params, x[r], rtol=1e-12, atol=1e-12, err_msg=f"step {k}, rank {r}: parameters")
            np.testing.assert_allclose(
                statistic, (w @ values[k])[r], rtol=1e-12, atol=1e-12, err_msg=f"step {k}, rank {r}: buffer"
            )
    assert not np.allclose(topology.mixing_matrix(0), topology.mixing_matrix(1))  # the matrix changes every step
