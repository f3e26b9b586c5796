"""Torch's optimizer contract for every algorithm, in the manner of torch's own optimizer tests: `param_groups`
stay the stepping optimizer's after `load_state_dict` and `add_param_group`; every LR scheduler acts before and
after a restore through torch.save / torch.load(weights_only=True), and the restored run equals the
uninterrupted one bit for bit; a GradScaler's skip on one peer is every peer's. In process on the local
backend, and once under mpiexec with the whole user loop (tests/peers/user_loop_peer.py)."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import torch
from peers import user_loop_peer as loop

from dpsgd.backends import spawn
from dpsgd.comm import run_local
from dpsgd.optim import ALGORITHMS

N = 4
SCRIPT = str(Path(__file__).parent / "peers" / "user_loop_peer.py")
EXACT = ("allreduce",)  # the peers hold one model after every step


def test_param_groups_stay_the_stepping_optimizers_after_load_and_add():
    def peer(comm):
        for name in ALGORITHMS:
            model = loop.model_for(comm.rank)
            head = model[2]
            opt = loop.make(comm, name, model, head=False)
            state = io.BytesIO()
            torch.save(opt.state_dict(), state)
            state.seek(0)
            opt.load_state_dict(torch.load(state, weights_only=True))
            assert opt.param_groups is opt.base.param_groups and opt.defaults is opt.base.defaults, name
            opt.param_groups[0]["lr"] = 0.25
            assert opt.base.param_groups[0]["lr"] == 0.25, name
            try:
                opt.add_param_group({"params": list(head.parameters()), "lr": 0.01})
            except ValueError as exc:  # the algorithms whose layout is fixed at construction say so
                assert "cannot take a new parameter group" in str(exc) and len(opt.base.param_groups) == 1, name
            else:
                assert opt.param_groups is opt.base.param_groups and len(opt.param_groups) == 2, name
                # the new group is rank 0's on every peer, as the first one was at construction
                assert torch.equal(head.weight, loop.model_for(0)[2].weight), name
            if opt.asynchronous:
                opt.set_budget(steps=0, samples=0)
                opt.finish()
        return True

    assert run_local(N, peer, timeout_s=60) == [True] * N


@pytest.mark.parametrize("name", loop.SYNCHRONOUS)
def test_every_scheduler_acts_before_and_after_a_restore_and_the_run_resumes_bit_for_bit(name):
    """Every scheduler on D-PSGD; on the others the two that change most (OneCycleLR moves the momentum too,
    ReduceLROnPlateau keeps its own state) - every scheduler reads and writes the same `param_groups`."""
    schedules = list(loop.SCHEDULERS) if name == "dpsgd" else ["onecycle", "plateau"]

    def peer(comm):
        out = {}
        for schedule in schedules:
            out[schedule] = (loop.train(comm, name, schedule), loop.train(comm, name, schedule, loop.RESTORE_AT))
        return out

    for r, result in enumerate(run_local(N, peer, timeout_s=120)):
        for schedule, (whole, restored) in result.items():
            reference = [[tuple(g) for g in step] for step in loop.reference_schedule(name, schedule, whole["losses"])]
            assert whole["used"] == reference, f"rank {r}, {schedule}: the base did not step with the schedule's lr"
            assert restored["used"] == whole["used"], f"rank {r}, {schedule}: the restore changed the schedule"
            assert restored["params"] == whole["params"], f"rank {r}, {schedule}: the restored run differs"


def test_a_scheduler_and_clipping_change_what_the_algorithm_steps():
    """Not vacuous: a different schedule gives different parameters (the lr reaches the rule)."""

    def peer(comm):
        return loop.train(comm, "dpsgd", "step")["params"], loop.train(comm, "dpsgd", "cosine")["params"]

    step, cosine = run_local(N, peer, timeout_s=60)[0]
    assert step != cosine


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_a_grad_scaler_skip_on_one_peer_is_every_peers(name):
    def peer(comm):
        return loop.scaled(comm, name, inf=True), (None if opt_async else loop.scaled(comm, name, inf=False))

    opt_async = ALGORITHMS[name].asynchronous
    results = run_local(N, peer, timeout_s=60)
    for r, (got, skipped) in enumerate(results):
        assert all(math.isfinite(v) for v in got), f"rank {r}: an inf or nan reached the parameters"
        if skipped is not None:
            assert got == skipped, f"rank {r}: the step with an inf on rank 1 was not skipped by every peer alike"
    if name in EXACT:
        assert all(got == results[0][0] for got, _ in results), "the peers of an exact average disagree"


@pytest.mark.parametrize("way", ["app", "user"])
def test_an_fp16_step_agrees_on_a_skip_once(way):
    """One GradScaler agreement per step (one one-element all-reduce), whether the training loop agrees first and
    plants an inf where another peer overflowed (dpsgd's app: agree_overflow, scaler.unscale_, clipping,
    scaler.step, scaler.update) or a user's plain loop leaves it to scaler.step; the skipped step's answer does
    not outlive it (the next step, with no overflow, agrees anew and steps)."""

    def peer(comm):
        agreements = []
        start = comm._start_allreduce_sum  # the transport's all-reduce: count the one-element ones

        def counted(buf):
            if buf.numel() == 1:
                agreements.append(buf)
            return start(buf)

        comm._start_allreduce_sum = counted
        model = loop.model_for(comm.rank)
        opt = loop.make(comm, "dpsgd", model)  # gossip: its own exchanges are no all-reduce
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        counts, params = [], []
        for t in range(2):
            x, y = loop.batch(comm.rank, t)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            if t == 0 and comm.rank == 1:
                model[0].weight.grad[0, 0] = float("inf")  # an fp16 overflow on one peer
            before = loop.flat(model)
            if way == "app":
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                overflow = not all(bool(torch.isfinite(g).all()) for g in grads)
                if opt.agree_overflow(overflow) and not overflow:
                    grads[0].view(-1)[0] = float("inf")  # another peer overflowed: this scaler skips too
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            counts.append(len(agreements))
            params.append(loop.flat(model) != before)
        return counts, params, opt.step_count

    for r, (counts, moved, steps) in enumerate(run_local(N, peer, timeout_s=60)):
        assert counts == [1, 2], f"rank {r}: {counts} agreements after each step, expected one per step"
        assert moved == [False, True] and steps == 1, f"rank {r}: the overflow's step was not skipped alone"


def test_a_rule_written_as_step_is_refused_in_one_line():
    """DistributedOptimizer.step() wraps every rule (the agreed skip, the buffers' exchange); a subclass that
    defines step() itself would lose both, silently: it is refused at construction, saying to write update()."""
    from dpsgd.optim import DistributedOptimizer

    class OldStyle(DistributedOptimizer):
        def step(self, closure=None):
            self.base.step()

    def peer(comm):
        model = loop.model_for(comm.rank)
        with pytest.raises(TypeError, match=r"^OldStyle defines step\(\); write its rule as update\(self\) instead"):
            OldStyle(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm)
        return True

    assert run_local(2, peer, timeout_s=60) == [True, True]


def test_allreduce_overlap_refuses_a_grad_scaler_in_one_line():
    def peer(comm):
        model = loop.model_for(comm.rank)
        opt = loop.make(comm, "allreduce", model, overlap=True)
        scaler = torch.amp.GradScaler("cpu")
        x, y = loop.batch(comm.rank, 0)
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        with pytest.raises(ValueError, match="use overlap=false with a GradScaler"):
            scaler.step(opt)
        return True

    assert run_local(2, peer, timeout_s=60) == [True, True]


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_users_loop_under_mpiexec_restores_exactly_and_survives_an_inf_on_one_peer(tmp_path):
    """4 mpi peers: warmup then cosine, two groups, clipping, bf16 autocast, a restore at step 4 equal to the
    uninterrupted run for every synchronous algorithm; a GradScaler with an inf on rank 1 and module= on ranks
    seeded differently (their whole model: buffers, a frozen layer) for every algorithm."""
    code = spawn("mpi", N, [SCRIPT, "mpi", str(tmp_path)], timeout_s=240)
    assert code == 0, f"mpi peers exited with {code}"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(N)]
    for name in loop.SYNCHRONOUS:
        for r, result in enumerate(ranks):
            runs = result["restore"][name]
            assert runs["restored"] == runs["uninterrupted"], f"{name}, rank {r}: the restored run differs"
            lrs = [step[0][0] for step in runs["uninterrupted"]["used"]]
            assert lrs[0] < lrs[3] and lrs[-1] < lrs[3], f"{name}: the warmup and cosine did not reach the base"
    rank0 = {k: v.double().reshape(-1).tolist() for k, v in loop.whole_model(0).state_dict().items()}
    for name in ALGORITHMS:
        assert all(r["module"][name] == ranks[0]["module"][name] for r in ranks), f"{name}: module= left them apart"
        assert ranks[0]["module"][name] == rank0, f"{name}: not rank 0's state"
        for r, result in enumerate(ranks):
            got = result["scaler"][name]
            assert all(math.isfinite(v) for v in got["inf"]), f"{name}, rank {r}: an inf reached the parameters"
            if "skipped" in got:
                assert got["inf"] == got["skipped"], f"{name}, rank {r}: the peers did not skip together"
        if name in EXACT:
            assert all(r["scaler"][name]["inf"] == ranks[0]["scaler"][name]["inf"] for r in ranks), name


@pytest.mark.parametrize("wrapper", ["trimmed_mean", "top_k"])
def test_the_skip_and_rank_0s_buffers_travel_plain_under_robust_rules_and_compression(wrapper):
    """The skip flag and the broadcast buffers are no model exchange: a robust rule would trim the one peer's
    flag away (and hang the others), a codec would encode them; both go through the plain communicator."""
    from dpsgd.comm import codecs, robust
    from dpsgd.optim import DPSGD

    def peer(comm):
        spec = {"name": "top_k", "ratio": 0.5}
        wrapped = robust.wrap(comm, wrapper) if wrapper == "trimmed_mean" else codecs.wrap(comm, spec)
        model = loop.whole_model(comm.rank)
        base = torch.optim.SGD(model[0].parameters(), lr=0.1)
        opt = DPSGD(base, topology=loop.topologies.make("ring", comm.size), comm=wrapped, module=model)
        scaler = torch.amp.GradScaler("cpu")
        x = torch.randn(8, 5, generator=torch.Generator().manual_seed(comm.rank))
        scaler.scale(model(x).pow(2).mean()).backward()
        if comm.rank == 1:
            model[0].weight.grad[0, 0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        skipped = opt.step_count == 0 and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        model(x * (1 + comm.rank)).pow(2).mean().backward()  # the peers' statistics differ
        opt.step()
        return skipped, model[1].running_mean.clone()

    results = run_local(N, peer, timeout_s=60)
    assert all(skipped for skipped, _ in results), "a peer stepped while another's gradients held an inf"
    assert all(torch.equal(mean, results[0][1]) for _, mean in results), "the buffers are not rank 0's"


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_help_shows_the_keywords_every_optimizer_takes(name):
    """NoLoCo, DeMo, SparseLoCo and DESLOC took module= and buffers= (through the base class) while their
    signature, and so help(), did not show them."""
    import inspect

    parameters = inspect.signature(ALGORITHMS[name]).parameters
    handed_on = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())  # QGM, BMUF: **options
    assert handed_on or {"topology", "comm", "broadcast_initial", "module", "buffers"} <= set(parameters)


# x_i (a global model) flattened at construction; fragments of that vector
REFUSE_NEW_GROUPS = {"adpsgd", "async_local_sgd", "streaming_diloco"}
# the rules act in 4 steps (SPARTA's 0.5% of entries would seldom reach the 18 of the head in 4 steps)
SHORT_PERIODS = {"period": 2, "param_period": 2, "momentum_period": 2, "variance_period": 2, "fraction": 0.5}


def head_trajectory(comm, name: str, head_is: str) -> list[list[float]]:
    """4 steps of `name` on a two-layer model whose head (second layer, lr 0.05) is a group given to the base at
    construction (head_is="built"), added before the first step (head_is="added"), or stepped by a plain torch
    SGD of its own, outside the algorithm (head_is="outside"). Returns the head's parameters after each step."""
    model = loop.model_for(comm.rank)
    momentum = loop.momentum(name)
    body, head = list(model[0].parameters()), list(model[2].parameters())
    groups = [{"params": body}] + ([{"params": head, "lr": 0.05}] if head_is == "built" else [])
    options = loop.runs.own_options(name)
    options.update({k: v for k, v in SHORT_PERIODS.items() if k in options})
    topology = loop.topologies.make(loop.TOPOLOGY.get(name, "ring"), comm.size)
    opt = loop.build(name, torch.optim.SGD(groups, lr=0.1, momentum=momentum), topology=topology, comm=comm, **options)
    outside = None
    if head_is == "added":
        opt.add_param_group({"params": head, "lr": 0.05})
    elif head_is == "outside":
        comm.broadcast_(head, root=0)  # the start the other two take from rank 0
        outside = torch.optim.SGD(head, lr=0.05, momentum=momentum)
    out = []
    for t in range(4):
        x, y = loop.batch(comm.rank, t)
        opt.zero_grad()
        if outside is not None:
            outside.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if outside is not None:
            outside.step()
        out.append(torch.cat([p.detach().reshape(-1) for p in head]).tolist())
    return out


@pytest.mark.parametrize(
    "name",
    [n for n in ALGORITHMS if n not in REFUSE_NEW_GROUPS],  # DeMo, SparseLoCo and NoLoCo once left it out
)
def test_a_group_added_before_the_first_step_takes_part_in_the_rule(name):
    """Torch's contract: add_param_group before the first step is as if the group had been there from the start.
    The head added then follows the trajectory of the head given at construction, which differs from the head's
    own local steps (the rule acts on it within the 4 steps)."""

    def peer(comm):
        return [head_trajectory(comm, name, how) for how in ("built", "added", "outside")]

    for r, (built, added, outside) in enumerate(run_local(N, peer, timeout_s=60)):
        for t, (a, b) in enumerate(zip(added, built)):
            torch.testing.assert_close(
                torch.tensor(a), torch.tensor(b), rtol=1e-6, atol=1e-7,
                msg=lambda m, t=t, r=r: f"{name}, rank {r}, step {t + 1}: added head off the rule: {m}",
            )  # fmt: skip
        assert max(abs(u - v) for u, v in zip(built[-1], outside[-1])) > 1e-4, (
            f"{name}: the rule never acted on the head"
        )


def test_only_the_algorithms_with_a_fixed_layout_refuse_a_new_group():
    def peer(comm):
        refused = set()
        for name in ALGORITHMS:
            model = loop.model_for(comm.rank)
            opt = loop.make(comm, name, model, head=False)
            try:
                opt.add_param_group({"params": list(model[2].parameters()), "lr": 0.05})
            except ValueError as exc:
                assert "cannot take a new parameter group" in str(exc), (name, exc)
                refused.add(name)
            if opt.asynchronous:
                opt.set_budget(steps=0, samples=0)
                opt.finish()
        return refused

    assert run_local(N, peer, timeout_s=60) == [REFUSE_NEW_GROUPS] * N
