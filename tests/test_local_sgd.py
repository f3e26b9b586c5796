"""LocalSGD / SlowMo / DiLoCo against an independent numpy reference of their update equations,
on the local backend and under real MPI processes, plus mass conservation, state_dict round
trips, period 1 == AllReduce, and the errors for options that make no sense."""

from __future__ import annotations

import functools
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from peers import local_sgd_peer as peer
from peers import quadratic as q
from reference import grads, sgd_increment

from dpsgd.backends import spawn
from dpsgd.comm import run_local
from dpsgd.optim import ALGORITHMS, BMUF, AllReduce, DiLoCo, LocalSGD, SlowMo, build
from dpsgd.options import factories

N = 4
PEER_SCRIPT = str(Path(__file__).parent / "peers" / "local_sgd_peer.py")
CONF = Path(__file__).parent.parent / "conf" / "algorithm"
# the defaults each registered name gives (the papers' ones: SlowMo as fairscale, DiLoCo's paper), as the
# reference's rules: average (no outer optimizer), momentum (SlowMo's, scaled by the base lr), nesterov
DEFAULTS = {
    "local_sgd": dict(period=4, outer="average", outer_lr=1.0, outer_momentum=0.0),
    "slowmo": dict(period=4, outer="momentum", outer_lr=1.0, outer_momentum=0.5),
    "diloco": dict(period=8, outer="nesterov", outer_lr=0.7, outer_momentum=0.9),
    "bmuf": dict(period=4, outer="momentum", outer_lr=1.0, outer_momentum=1 - 1 / N),  # 1 - 1/n
}


# --- the reference ----------------------------------------------------------------------------
def adamw_increment(x, g, st, lr, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8):
    """torch.optim.AdamW's step per peer (rows of x); st = (t, m, v) or None after a reset."""
    t, m, v = st if st is not None else (0, np.zeros_like(x), np.zeros_like(x))
    t += 1
    m = betas[0] * m + (1 - betas[0]) * g
    v = betas[1] * v + (1 - betas[1]) * g * g
    decayed = x * (1 - lr * weight_decay)
    step = lr / (1 - betas[0] ** t) * m / (np.sqrt(v) / np.sqrt(1 - betas[1] ** t) + eps)
    return decayed - step - x, (t, m, v)


def outer_rule(name, opts):
    """A case's outer rule as the reference reads it: (rule, lr, momentum), or ("adam", lr, betas)."""
    defaults, outer = DEFAULTS[name], opts.get("outer")
    if outer is None:
        return defaults["outer"], defaults["outer_lr"], defaults["outer_momentum"]
    if isinstance(outer, functools.partial):  # the library's form
        target, options = outer.func.__name__, outer.keywords
    else:  # a config's
        target, options = outer["_target_"].rpartition(".")[2], outer
    if target == "Adam":
        return "adam", options["lr"], options.get("betas", (0.9, 0.999))
    return ("nesterov" if options.get("nesterov") else defaults["outer"]), options["lr"], options.get("momentum", 0)


def reference(case, A, b, x0, steps, lr_at=None):
    """Trajectory (steps, n, d) of the update equations in dpsgd/optim/local_sgd.py's docstring;
    lr_at(t) is the base lr of step t (the case's own by default)."""
    name, kind, base, opts = case
    o = {**DEFAULTS[name], "warmup_steps": 0, "inner_state": "keep", "group_size": None, "global_period": None, **opts}
    o["outer"], o["outer_lr"], o["outer_momentum"] = outer_rule(name, opts)
    n = len(x0)
    mom = base.get("momentum", 0.0)
    every = np.full((n, n), 1.0 / n)
    g_size = o["group_size"] or n
    groups = np.kron(np.eye(n // g_size), np.full((g_size, g_size), 1.0 / g_size))
    x, st, anchor, u, outer_state, out = x0.copy(), None, None, 0.0, None, []
    for t in range(1, steps + 1):
        lr = lr_at(t) if lr_at else base["lr"]
        g = grads(A, b, x)
        if t <= o["warmup_steps"]:
            g = np.broadcast_to(g.mean(0), g.shape)
        elif o["outer"] != "average" and anchor is None:
            anchor = x.mean(0)
        if kind == "sgd":
            d, st = sgd_increment(g, st, lr, mom)
        else:
            d, st = adamw_increment(x, g, st, lr, base.get("weight_decay", 0.01))
        x = x + d
        s = t - o["warmup_steps"]
        if s >= 1 and (s % o["period"] == 0):
            is_global = o["global_period"] is None or s % o["global_period"] == 0
            M = every if is_global else groups
            x_avg = M @ x
            if o["inner_state"] == "average":
                st = M @ st if kind == "sgd" else (st[0], M @ st[1], M @ st[2])
            if o["inner_state"] == "reset":
                st = None
            if not is_global or o["outer"] == "average":
                x = x_avg
            else:  # the outer optimizer, at global averagings only
                G = anchor - x_avg[0]
                beta, alpha = o["outer_momentum"], o["outer_lr"]
                if o["outer"] == "momentum":
                    u = beta * u + G / lr
                    anchor = anchor - alpha * lr * u
                elif o["outer"] == "adam":  # torch.optim.Adam on the anchor, beta its betas
                    d, outer_state = adamw_increment(anchor[None], G[None], outer_state, alpha, 0.0, beta)
                    anchor = anchor + d[0]
                else:
                    u = beta * u + G
                    anchor = anchor - alpha * (G + beta * u)
                x = np.broadcast_to(anchor, x.shape).copy()
        out.append(x.copy())
    return np.array(out)


def check(per_rank):
    """per_rank[r][c] is rank r's trajectory (steps, d) for case c."""
    A, b, x0 = q.problem(N)
    for c, case in enumerate(peer.CASES):
        got = np.stack([np.array(per_rank[r][c]) for r in range(N)], axis=1)
        want = reference(case, A, b, x0, peer.STEPS)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-10, err_msg=f"case {case}")


# --- parity -----------------------------------------------------------------------------------
def test_reference_sanity():
    """The reference itself: averaging steps leave identical rows, local steps do not."""
    A, b, x0 = q.problem(N)
    traj = reference(peer.CASES[0], A, b, x0, 6)
    assert np.ptp(traj[2], axis=0).max() == 0 and np.ptp(traj[5], axis=0).max() == 0
    assert np.ptp(traj[3], axis=0).max() > 1e-3


def test_local_backend_matches_reference():
    check(run_local(N, peer.all_trajectories))


@pytest.mark.slow  # soak: make test keeps test_algorithms' mpi processes against the reference
def test_mpi_processes_match_reference(tmp_path):
    code = spawn("mpi", N, [PEER_SCRIPT, "mpi", str(tmp_path)], timeout_s=120)
    assert code == 0, f"mpi peers exited with {code}"
    check([json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(N)])


# --- properties -------------------------------------------------------------------------------
def _run_recording(comm, options, steps=8, lr=0.05):
    """Plain SGD: the model before averaging is x - lr g, computable outside the optimizer."""
    params, loss = peer.model(comm)
    opt = LocalSGD(torch.optim.SGD(params, lr=lr), comm=comm, **options)
    before, after = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss().backward()
        before.append(torch.cat([(p - lr * p.grad).detach() for p in params]).numpy())
        opt.step()
        after.append(torch.cat([p.detach() for p in params]).numpy())
    return np.array(before), np.array(after)


def test_plain_averaging_conserves_mass():
    res = run_local(N, _run_recording, {"period": 3})
    before = np.stack([r[0] for r in res], axis=1)  # (steps, n, d)
    after = np.stack([r[1] for r in res], axis=1)
    for k in (2, 5):  # steps 3 and 6 average
        np.testing.assert_allclose(after[k].mean(0), before[k].mean(0), rtol=0, atol=1e-14)
        assert np.ptp(after[k], axis=0).max() == 0  # the all-reduce gives the same bits everywhere
    np.testing.assert_allclose(after[3], before[3], rtol=0, atol=1e-15)  # local steps: the base step alone


def test_group_averaging_conserves_group_mass():
    res = run_local(N, _run_recording, {"period": 2, "group_size": 2, "global_period": 4})
    before = np.stack([r[0] for r in res], axis=1)
    after = np.stack([r[1] for r in res], axis=1)
    k = 1  # step 2: within groups {0,1} and {2,3}
    for grp in ([0, 1], [2, 3]):
        np.testing.assert_allclose(
            after[k, grp], np.broadcast_to(before[k, grp].mean(0), (2, q.DIM)), rtol=0, atol=1e-14
        )
    assert np.abs(after[k, 0] - after[k, 2]).max() > 1e-6  # the groups did not mix
    np.testing.assert_allclose(after[3], np.broadcast_to(before[3].mean(0), after[3].shape), rtol=0, atol=1e-14)


@pytest.mark.parametrize(
    "case",
    [peer.CASES[5], peer.CASES[9], peer.CASES[12], peer.CASES[4], peer.CASES[14], peer.CASES[15]],
    ids=["slowmo", "diloco-adamw-reset", "hierarchical-slowmo", "average-state", "adam-outer", "diloco-adam-outer"],
)
def test_state_dict_round_trip_resumes_identically(case):
    """10 steps in one go == 5 steps, save, load into a fresh optimizer (and model), 5 more."""

    def fn(comm):
        straight = peer.trajectory(comm, case, steps=10)
        name, kind, base_options, options = case
        params, loss = peer.model(comm)
        opt = build(
            name, peer.make_base(kind, params, base_options), comm=comm, broadcast_initial=False, **factories(options)
        )
        first = peer.take_steps(opt, params, loss, 5)
        buf = io.BytesIO()
        torch.save({"opt": opt.state_dict(), "params": [p.detach().clone() for p in params]}, buf)
        for _ in range(3):  # the old optimizer moves on: the saved state must not move with it
            peer.take_steps(opt, params, loss, 1)
        buf.seek(0)
        saved = torch.load(buf)
        params2, loss2 = peer.model(comm)
        with torch.no_grad():
            for p, s in zip(params2, saved["params"]):
                p.copy_(s)
        opt2 = build(
            name, peer.make_base(kind, params2, base_options), comm=comm, broadcast_initial=False, **factories(options)
        )
        opt2.load_state_dict(saved["opt"])
        assert opt2.step_count == 5
        return straight, first + peer.take_steps(opt2, params2, loss2, 5)

    for straight, resumed in run_local(N, fn):
        assert straight == resumed  # the same floats, not merely close


def test_a_state_dict_from_before_torch_outer_optimizers_is_refused():
    """Its bare momentum list cannot become a torch optimizer's state: a silent fresh anchor would not resume."""
    from dpsgd.optim.base import STATE_KEY

    def fn(comm):
        params, loss = peer.model(comm)
        opt = SlowMo(torch.optim.SGD(params, lr=0.05), comm=comm, period=2)
        peer.take_steps(opt, params, loss, 2)
        old = opt.state_dict()
        old[STATE_KEY] = {"step_count": 2, "anchor": [p.detach() for p in params], "outer_buffer": None}
        with pytest.raises(ValueError, match="predates torch outer optimizers"):
            opt.load_state_dict(old)

    run_local(N, fn)


def test_period_one_with_averaged_momentum_is_allreduce():
    """Averaging models (and momentum) after every step == averaging gradients, from a common start."""

    def fn(comm, algorithm):
        A, b, x0 = q.problem(comm.size)
        w = torch.nn.Parameter(torch.tensor(x0[0]))
        A_i, b_i = torch.tensor(A[comm.rank]), torch.tensor(b[comm.rank])
        base = torch.optim.SGD([w], lr=0.05, momentum=0.9)
        opt = (
            AllReduce(base, comm=comm)
            if algorithm == "allreduce"
            else LocalSGD(base, comm=comm, period=1, inner_state=algorithm)
        )
        out = []
        for _ in range(10):
            opt.zero_grad()
            (0.5 / q.ROWS * (A_i @ w - b_i).pow(2).sum()).backward()
            opt.step()
            out.append(w.detach().clone().numpy())
        return np.array(out)

    want = run_local(N, fn, "allreduce")
    for inner_state in ("keep", "average"):  # with SGD momentum both are linear in the buffers
        for got in run_local(N, fn, inner_state):
            np.testing.assert_allclose(got, want[0], rtol=0, atol=1e-12)


def test_averaging_traffic_is_one_model_per_period():
    def fn(comm):
        params, loss = peer.model(comm)
        opt = LocalSGD(torch.optim.SGD(params, lr=0.05), comm=comm, period=4)
        peer.take_steps(opt, params, loss, 12)
        return comm.stats.as_dict()

    stats = run_local(N, fn)[0]
    assert stats["calls"] == {"allreduce_mean": 3}
    assert stats["bytes_sent"] == 3 * 2 * (N - 1) / N * q.DIM * 8


# --- registry, configs, errors ----------------------------------------------------------------
def test_slowmo_scales_by_the_base_lr_of_each_averaging():
    """SlowMo's u <- beta u + G / gamma, x <- x_anchor - alpha gamma u with gamma changed mid-run (at a
    constant gamma plain SGD on G gives the same numbers; here it would not)."""
    case = ("slowmo", "sgd", {"lr": 0.05}, {"period": 3})
    lr_at = lambda t: 0.05 if t <= 4 else 0.02  # noqa: E731

    def fn(comm):
        params, loss = peer.model(comm)
        opt = build("slowmo", torch.optim.SGD(params, lr=0.05), comm=comm, broadcast_initial=False, period=3)
        out = []
        for t in range(1, 10):
            opt.param_groups[0]["lr"] = lr_at(t)
            out += peer.take_steps(opt, params, loss, 1)
        return out

    got = np.stack([np.array(r) for r in run_local(N, fn)], axis=1)
    A, b, x0 = q.problem(N)
    np.testing.assert_allclose(got, reference(case, A, b, x0, 9, lr_at), rtol=0, atol=1e-10)
    unscaled = reference(
        ("diloco", "sgd", {"lr": 0.05}, {"period": 3, "outer": {**peer.SGD, "lr": 1.0, "momentum": 0.5}}),
        A,
        b,
        x0,
        9,
        lr_at,
    )
    assert np.abs(got - unscaled).max() > 1e-4  # the check above tells the two apart


def _outer_options(opt) -> dict:
    """What a LocalSGD's outer optimizer is: its class, lr, momentum, nesterov, and SlowMo's scaling."""
    outer = opt.outer_optimizer
    if outer is None:
        return {"period": opt.period, "outer": None}
    keys = ("lr", "momentum", "nesterov")
    return {
        "period": opt.period,
        "outer": (type(outer), *(outer.defaults[k] for k in keys)),
        "scaled": opt.scale_by_base_lr,
    }


def test_registered_names_have_their_papers_defaults():
    assert ALGORITHMS["local_sgd"] is LocalSGD and ALGORITHMS["slowmo"] is SlowMo
    assert ALGORITHMS["diloco"] is DiLoCo and ALGORITHMS["bmuf"] is BMUF
    w = torch.nn.Parameter(torch.zeros(2))
    for name, o in DEFAULTS.items():
        opt = run_local(N, lambda comm, name=name: build(name, torch.optim.SGD([w], lr=0.1), comm=comm))[0]
        want = {"period": o["period"], "outer": None}
        if o["outer"] != "average":
            sgd = (torch.optim.SGD, o["outer_lr"], o["outer_momentum"], o["outer"] == "nesterov")
            want = {**want, "outer": sgd, "scaled": o["outer"] == "momentum"}
        assert _outer_options(opt) == want, name


@pytest.mark.parametrize("name", ["local_sgd", "slowmo", "diloco", "bmuf"])
def test_config_options_are_accepted(name):
    """conf/algorithm/NAME.yaml builds the registered class with its papers' defaults (outer included)."""
    cfg = yaml.safe_load((CONF / f"{name}.yaml").read_text())
    assert cfg["name"] == name
    options = {k: v for k, v in cfg.items() if k not in ("name", "_target_", "defaults")}
    w = torch.nn.Parameter(torch.zeros(2))
    opt, default = run_local(
        8,
        lambda comm: [
            build(name, torch.optim.SGD([w], lr=0.1), comm=comm, **factories(options)),
            build(name, torch.optim.SGD([w], lr=0.1), comm=comm),
        ],
    )[0]
    assert isinstance(opt, ALGORITHMS[name])
    assert _outer_options(opt) == _outer_options(default)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"period": 0}, "period must be an integer >= 1"),
        ({"period": 2.5}, "period must be an integer"),
        ({"warmup_steps": -1}, "warmup_steps must be an integer >= 0"),
        ({"outer": "nesterov"}, "outer must be a torch optimizer factory"),
        ({"outer": {"lr": 0.7}}, "outer must be a torch optimizer factory .* is neither"),
        ({"outer": {"_target_": "torch.optim.Nesterov"}}, "has no attribute 'Nesterov'"),
        (
            {"outer": {"_target_": "torch.optim.SGD", "lr": -1}},
            "cannot build its outer optimizer: Invalid learning rate",
        ),
        ({"outer": {"_target_": "torch.optim.SGD", "lr": 0.7, "beta": 0.9}}, "unexpected keyword argument 'beta'"),
        ({"scale_by_base_lr": True}, "scale_by_base_lr scales an outer optimizer, and outer is None"),
        ({"inner_state": "sum"}, "inner_state must be one of"),
        ({"group_size": 3, "global_period": 4}, "group_size 3 does not divide the 4 peers"),
        ({"group_size": 2}, "needs both group_size and global_period"),
        ({"period": 3, "group_size": 2, "global_period": 4}, "global_period 4 must be a multiple of period 3"),
    ],
)
def test_nonsense_is_refused(options, message):
    def fn(comm):
        with pytest.raises(ValueError, match=message) as err:
            # a config's `_target_` dicts made factories as a run's build makes them
            LocalSGD(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), comm=comm, **factories(options))
        assert "\n" not in str(err.value)

    run_local(N, fn)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
