"""experiments.cost_model, the map's time per run, against the emulator's clock of real (threaded) peers: the same
steps of each algorithm under the same network cell, hosts and straggler included."""

from __future__ import annotations

import pytest
import torch
from emulated import emulated_steps

import topologies
from dpsgd.comm import run_local
from dpsgd.optim import DPSGD, AllReduce, DiLoCo, LocalSGD, NoLoCo
from experiments.cost_model import Algorithm, Network, clock_after

NUMEL = 10_000
NBYTES = 4 * NUMEL
COMPUTE = 0.01


def _emulated(comm, make, network: dict, steps: int) -> float:
    return emulated_steps(comm, make, NUMEL, network, steps, lr=0.01)[0]


CASES = [
    (Algorithm("allreduce", (), "allreduce"), lambda b, c: AllReduce(b, comm=c)),
    (Algorithm("local_sgd", (), "periodic", period=3), lambda b, c: LocalSGD(b, comm=c, period=3)),
    (Algorithm("diloco", (), "periodic", period=4), lambda b, c: DiLoCo(b, comm=c, period=4)),
    (
        Algorithm("dpsgd ring", (), "gossip", topology="ring"),
        lambda b, c: DPSGD(b, comm=c, topology=topologies.make("ring", c.size)),
    ),
    (
        Algorithm("dpsgd one-peer", (), "gossip", topology="one_peer_exponential"),
        lambda b, c: DPSGD(b, comm=c, topology=topologies.make("one_peer_exponential", c.size)),
    ),
    (Algorithm("noloco H=3", (), "pairwise", period=3), lambda b, c: NoLoCo(b, comm=c, period=3)),
]
CELLS = [
    Network(1e-3, 1e7),  # a per-peer link
    Network(1e-3, 1e7, peers_per_host=2, slowdown=3.0),  # 2 per host, peer 1 three times slower
    Network(5e-3, 1e8, peers_per_host=4, slowdown=2.0),
    Network(1e-3, 1e7, peers_per_host=2, allreduce="halving_doubling"),  # MPICH's all-reduce
]


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: f"ppr{c.peers_per_host}_slow{c.slowdown}_{c.allreduce}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0].label)
def test_clock_after_equals_the_emulators_clock(case, cell):
    algorithm, make = case
    n, steps = 8, 9
    emulated = run_local(n, _emulated, make, cell.config(COMPUTE, n), steps)
    predicted = clock_after(algorithm, steps, n, NBYTES, COMPUTE, cell)
    assert max(emulated) == pytest.approx(predicted, rel=1e-9)


def test_a_straggler_paces_the_synchronous_algorithms_not_adpsgd():
    """Free links: the latest clock of a ring and of all-reduce is the straggler's own; AD-PSGD's global step
    runs at the peers' summed rates."""
    ring = Algorithm("dpsgd ring", (), "gossip", topology="ring")
    cell = Network(0.0, None, slowdown=4.0)
    assert clock_after(ring, 40, 64, NBYTES, COMPUTE, cell) == pytest.approx(40 * 4 * COMPUTE)
    allreduce = Algorithm("allreduce", (), "allreduce")
    assert clock_after(allreduce, 40, 64, NBYTES, COMPUTE, cell) == pytest.approx(40 * 4 * COMPUTE)
    adpsgd = Algorithm("adpsgd", (), "async")
    assert clock_after(adpsgd, 40, 64, NBYTES, COMPUTE, cell) == pytest.approx(40 * 64 / (63 + 1 / 4) * COMPUTE)


ONE_PEER = next(c for c in CASES if c[0].label == "dpsgd one-peer")  # 8 peers, a schedule of period 3


@pytest.mark.parametrize("steps", [4, 7, 8])
@pytest.mark.parametrize("cell", CELLS[1:3], ids=lambda c: f"ppr{c.peers_per_host}_slow{c.slowdown}")
def test_gossip_clock_equals_the_emulators_part_way_through_a_period(cell, steps):
    """The time-varying graph's schedule at step counts that are not whole periods (3 on 8 peers): the steps of a
    period differ in cost where hosts hold 2 or 4 peers (i + 1 stays on the host, i + 2 and i + 4 leave it)."""
    algorithm, make = ONE_PEER
    n = 8
    assert topologies.make(algorithm.topology, n).period == 3 and steps % 3
    emulated = run_local(n, _emulated, make, cell.config(COMPUTE, n), steps)
    assert max(emulated) == pytest.approx(clock_after(algorithm, steps, n, NBYTES, COMPUTE, cell), rel=1e-9)


def _adpsgd(comm, network: dict, steps: int) -> float:
    """`steps` AD-PSGD steps of this peer on the quadratic under `network` (model mode): its emulated clock at
    the end (its last averaging included)."""
    from dpsgd.comm.netem import NetworkEmulator
    from dpsgd.optim import ADPSGD

    net = NetworkEmulator.from_config(network, comm.rank, comm.size)
    comm.attach_network(net)
    w = torch.nn.Parameter(torch.randn(NUMEL, generator=torch.Generator().manual_seed(comm.rank)))
    opt = ADPSGD(torch.optim.SGD([w], lr=0.01), comm=comm, topology=topologies.make("ring", comm.size))
    opt.set_budget(steps=steps)
    comm.barrier()
    net.clock.reset()
    while not opt.should_stop():
        net.start_compute()
        opt.zero_grad()
        w.pow(2).sum().backward()
        net.finish_compute()
        opt.step()
    opt.finish()
    return net.clock.elapsed()


def _emulated_global_step(n: int, cell: Network, first: int = 5, last: int = 9) -> float:
    """The emulator's seconds per AD-PSGD global step (n updates): each peer's own seconds per step, the slope of
    its clock between `first` and `last` steps (the first gradient and the last averaging are the same in both), and
    the peers' rates summed: n / sum_i (1 / seconds per step of peer i)."""
    before, after = (run_local(n, _adpsgd, cell.config(COMPUTE, n), s) for s in (first, last))
    per_step = [(b - a) / (last - first) for a, b in zip(before, after)]
    return n / sum(1 / s for s in per_step)


ADPSGD = Algorithm("adpsgd", (), "async")
# 40 kB messages: 1 ms + 0.4 ms (2 m = 2.8 ms, under the 10 ms compute); 5 ms + 4 ms (2 m = 18 ms, between the 10 ms
# compute and the 30 ms of peer 1, the straggler, passive on a ring of 2)
ADPSGD_CELLS = [(4, Network(1e-3, 1e8)), (2, Network(5e-3, 1e7, slowdown=3.0))]


@pytest.mark.parametrize("n, cell", ADPSGD_CELLS, ids=["compute_bound", "averaging_bound_active_peer"])
def test_adpsgd_clock_equals_the_emulators_rates_on_links_that_cost(n, cell):
    """Non-free links, at 7 and 11 steps: the global step's time, n / sum_i 1 / max(c_i, 2 m), equals the peers'
    rates in the emulator (an active peer waits for its averaging of 2 (alpha + M / beta) behind its next gradient)."""
    per_step = _emulated_global_step(n, cell)
    for steps in (7, 11):
        assert clock_after(ADPSGD, steps, n, NBYTES, COMPUTE, cell) == pytest.approx(steps * per_step, rel=1e-9)
    if cell.slowdown == 1.0:
        assert cell.link.message_time(NBYTES) > 0
    else:  # the averaging, not the compute, paces the active peer: the link's cost is in the figure
        assert COMPUTE < 2 * cell.link.message_time(NBYTES) < cell.slowdown * COMPUTE


@pytest.mark.xfail(
    strict=True,
    reason="the cost model charges every peer max(c_i, 2 m) a step, but the emulator charges the averaging to the "
    "active peers only (a passive peer serves from its communication thread: its clock is c_i a step): with 4 equal "
    "peers on a ring and 2 m = 18 ms > c = 10 ms, the model gives 18 ms a global step, the emulator's rates 12.86 ms. "
    "Left so on purpose: the map prices the steps to target measured without links, and where a passive peer steps "
    "ahead of its averagings AD-PSGD's steps to target grow; pricing them at c_i would make AD-PSGD win slow links "
    "on steps it does not take. The map's AD-PSGD needs its steps measured under each cell's links (issue 35/39)",
)
def test_adpsgd_clock_equals_the_emulators_rates_when_the_averaging_paces_every_peer():
    n, cell = 4, Network(5e-3, 1e7)
    assert 2 * cell.link.message_time(NBYTES) > COMPUTE
    per_step = _emulated_global_step(n, cell)
    assert clock_after(ADPSGD, 9, n, NBYTES, COMPUTE, cell) == pytest.approx(9 * per_step, rel=1e-9)
