"""SGP, Choco, D2, GradientTracking and QGM against independent numpy references of their update
equations (written here from the papers), on the local backend and under real MPI processes;
mass conservation, state_dict round trips and the refusals of combinations that make no sense."""

from __future__ import annotations

import io
import json
import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import runs
import torch
from peers import quadratic as q
from peers import suite_peer as s
from reference import grads

import topologies
from dpsgd.backends import spawn
from dpsgd.comm import run_local
from dpsgd.optim import ALGORITHMS, D2, DPSGD, SGP, Choco, GradientTracking, build

N = 4
PEER_SCRIPT = str(Path(__file__).parent / "peers" / "suite_peer.py")
CONF = Path(__file__).parent.parent / "conf" / "algorithm"


# --- numpy references ------------------------------------------------------------------------
def sgd_step(g, x, buf, lr, momentum=0.0, weight_decay=0.0):
    """torch.optim.SGD's increment: g += wd x; buf <- momentum buf + g (g at first); d = -lr buf."""
    g = g + weight_decay * x
    if momentum:
        buf = g.copy() if buf is None else momentum * buf + g
        return -lr * buf, buf
    return -lr * g, None


def ref_sgp(A, b, x0, W, steps, lr, momentum=0.0, **_):
    x, w, buf, out = x0.copy(), np.ones(len(x0)), None, []
    for k in range(steps):
        z = x / w[:, None]
        d, buf = sgd_step(grads(A, b, z), z, buf, lr, momentum)
        x, w = W(k) @ (x + d), W(k) @ w
        out.append(x / w[:, None])
    return np.array(out)


def top_k_rows(v, k):
    out = np.zeros_like(v)
    for i, row in enumerate(v):
        idx = np.argsort(-np.abs(row))[:k]
        out[i, idx] = row[idx]
    return out


def ref_choco(A, b, x0, W, steps, lr, momentum=0.0, ratio=1.0, gamma=1.0, **_):
    k = math.ceil(ratio * x0.shape[1])
    x, x_hat, buf, out = x0.copy(), np.zeros_like(x0), None, []
    for t in range(steps):
        d, buf = sgd_step(grads(A, b, x), x, buf, lr, momentum)
        x = x + d
        x_hat = x_hat + top_k_rows(x - x_hat, k)
        x = x + gamma * (W(t) @ x_hat - x_hat)
        out.append(x.copy())
    return np.array(out)


def ref_d2(A, b, x0, W, steps, lr, momentum=0.0, lazy=False, **_):
    x, x_prev, d_prev, buf, out = x0.copy(), None, None, None, []
    for k in range(steps):
        d, buf = sgd_step(grads(A, b, x), x, buf, lr, momentum)
        half = x + d if k == 0 else 2 * x - x_prev + d - d_prev
        Wk = (np.eye(len(x)) + W(k)) / 2 if lazy else W(k)
        x_prev, d_prev, x = x, d, Wk @ half
        out.append(x.copy())
    return np.array(out)


def ref_gt(A, b, x0, W, steps, lr, momentum=0.0, **_):
    x, y, g_prev, buf, out = x0.copy(), None, None, None, []
    for k in range(steps):
        g = grads(A, b, x)
        y = g if k == 0 else W(k - 1) @ y + g - g_prev
        d, buf = sgd_step(y, x, buf, lr, momentum)
        x, g_prev = W(k) @ (x + d), g
        out.append(x.copy())
    return np.array(out)


def ref_qgm(A, b, x0, W, steps, lr, weight_decay=0.0, order="atc", beta=0.9, mu=None, **_):
    mu = beta if mu is None else mu
    x, m_hat, out = x0.copy(), np.zeros_like(x0), []
    for k in range(steps):
        m = grads(A, b, x) + beta * m_hat + weight_decay * x
        new = W(k) @ x - lr * m if order == "cta" else W(k) @ (x - lr * m)
        m_hat = mu * m_hat + (1 - mu) * (x - new) / lr
        x = new
        out.append(x.copy())
    return np.array(out)


def expected(case):
    name, topo_name, base, options = case
    A, b, x0 = q.problem(N)
    topo = topologies.make(topo_name, N)
    options = dict(options)
    if name == "dpsgd":  # DPSGD(qgm=True)
        name = "qgm"
        options = {"order": options["order"], "beta": options["qgm_beta"]}
    if name == "d2":
        lazy = options.get("lazy_mixing", False)
        options["lazy"] = lazy is True or (
            lazy == "auto" and np.linalg.eigvalsh(topo.mixing_matrix()).min() <= -1 / 3 + 1e-9
        )
    ref = {"sgp": ref_sgp, "choco": ref_choco, "d2": ref_d2, "gradient_tracking": ref_gt, "qgm": ref_qgm}[name]
    return ref(A, b, x0, topo.mixing_matrix, s.STEPS, **base, **options)


def check(per_rank):
    """per_rank[r][case] is rank r's trajectory (steps, d)."""
    for c, case in enumerate(s.CASES):
        got = np.stack([np.array(per_rank[r][c]) for r in range(N)], axis=1)  # (steps, n, d)
        np.testing.assert_allclose(got, expected(case), rtol=0, atol=1e-10, err_msg=f"case {case}")


def test_reference_d2_case_uses_lazy_mixing_on_a_ring_of_four():
    assert np.linalg.eigvalsh(topologies.make("ring", N).mixing_matrix()).min() == pytest.approx(-1 / 3)


def test_local_backend_matches_reference():
    check(run_local(N, s.all_trajectories))


def test_mpi_processes_match_reference(tmp_path):
    code = spawn("mpi", N, [PEER_SCRIPT, "mpi", str(tmp_path)], timeout_s=120)
    assert code == 0, f"mpi peers exited with {code}"
    check([json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(N)])


# --- conservation ----------------------------------------------------------------------------
def test_sgp_conserves_numerators_and_weights_with_lr_zero():
    def peer(comm):
        params, loss = s.model(comm)
        opt = SGP(
            torch.optim.SGD(params, lr=0.0),
            topology=topologies.make("directed_exponential", N),
            comm=comm,
            broadcast_initial=False,
        )
        out = []
        for _ in range(6):
            opt.zero_grad()
            loss().backward()
            opt.step()
            st = opt.algorithm_state()
            z = torch.cat([p.detach() for p in params])
            out.append((torch.cat(st["x"]).numpy(), float(st["w"]), z.numpy()))
        return out

    per_rank = run_local(N, peer)
    _, _, x0 = q.problem(N)
    for k in range(6):
        xs = np.array([per_rank[r][k][0] for r in range(N)])
        ws = np.array([per_rank[r][k][1] for r in range(N)])
        np.testing.assert_allclose(xs.sum(0), x0.sum(0), rtol=0, atol=1e-12)
        assert ws.sum() == pytest.approx(N, abs=1e-12)
        zs = np.array([per_rank[r][k][2] for r in range(N)])
        np.testing.assert_allclose(zs, xs / ws[:, None], rtol=0, atol=1e-12)  # parameters hold z = x / w


@pytest.mark.parametrize(
    "case",
    [
        ("d2", "exponential", {}),
        ("d2", "ring", {"lazy_mixing": True}),
        ("gradient_tracking", "ring", {}),
        ("gradient_tracking", "one_peer_exponential", {}),
    ],
)
def test_average_model_moves_by_the_average_increment(case):
    name, topo_name, options = case
    lr = 0.05

    def peer(comm):
        params, loss = s.model(comm)
        opt = build(
            name,
            torch.optim.SGD(params, lr=lr),
            topology=topologies.make(topo_name, N),
            comm=comm,
            broadcast_initial=False,
            **options,
        )
        out = []
        for _ in range(8):
            opt.zero_grad()
            loss().backward()
            x = torch.cat([p.detach() for p in params]).numpy().copy()
            g = torch.cat([p.grad for p in params]).numpy().copy()
            opt.step()
            out.append((x, g, torch.cat([p.detach() for p in params]).numpy().copy()))
        return out

    per_rank = run_local(N, peer)
    for k in range(8):
        before, g, after = (np.mean([per_rank[r][k][i] for r in range(N)], axis=0) for i in range(3))
        np.testing.assert_allclose(after - before, -lr * g, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "compressor",
    [
        {"compressor": "top_k", "ratio": 0.2},
        {"compressor": "qsgd", "levels": 4},
        {"compressor": "sign"},
        {"compressor": "random_k", "ratio": 0.4},
    ],
)
def test_choco_keeps_the_average_model_with_lr_zero(compressor):
    def peer(comm):
        params, loss = s.model(comm)
        opt = Choco(
            torch.optim.SGD(params, lr=0.0),
            topology=topologies.make("ring", N),
            comm=comm,
            gamma=0.5,
            broadcast_initial=False,
            **compressor,
        )
        out = []
        for _ in range(8):
            opt.zero_grad()
            loss().backward()
            opt.step()
            out.append(torch.cat([p.detach() for p in params]).numpy().copy())
        return out

    per_rank = run_local(N, peer)
    _, _, x0 = q.problem(N)
    for k in range(8):
        np.testing.assert_allclose(np.mean([per_rank[r][k] for r in range(N)], axis=0), x0.mean(0), rtol=0, atol=1e-12)
    assert not np.allclose(per_rank[0][-1], x0[0])  # the consensus step did move the peers


# --- state_dict round trip -------------------------------------------------------------------
ROUND_TRIP = [
    ("sgp", "one_peer_directed_exponential", {"lr": 0.05, "momentum": 0.9}, {}),
    ("choco", "ring", {"lr": 0.05, "momentum": 0.9}, {"compressor": "random_k", "ratio": 0.4, "seed": 3}),
    ("choco", "ring", {"lr": 0.05}, {"compressor": "qsgd", "levels": 4}),
    ("d2", "exponential", {"lr": 0.05, "momentum": 0.9}, {}),
    ("gradient_tracking", "one_peer_exponential", {"lr": 0.05, "momentum": 0.9}, {}),
    ("qgm", "one_peer_exponential", {"lr": 0.05}, {"order": "atc"}),
]


@pytest.mark.parametrize("case", ROUND_TRIP, ids=[c[0] for c in ROUND_TRIP])
def test_state_dict_round_trip_resumes_identically(case):
    def peer(comm):
        params, loss = s.model(comm)
        straight = s.run(s.optimizer(case, params, comm), params, loss, 10)[-1]

        params, loss = s.model(comm)
        opt = s.optimizer(case, params, comm)
        s.run(opt, params, loss, 5)
        blob = io.BytesIO()
        torch.save({"params": [p.detach().clone() for p in params], "opt": opt.state_dict()}, blob)
        blob.seek(0)
        saved = torch.load(blob, weights_only=False)
        fresh, loss = s.model(comm)
        with torch.no_grad():
            for p, v in zip(fresh, saved["params"]):
                p.copy_(v)
        opt = s.optimizer(case, fresh, comm)
        opt.load_state_dict(saved["opt"])
        resumed = s.run(opt, fresh, loss, 5)[-1]
        return straight, resumed

    for straight, resumed in run_local(N, peer):
        assert straight == resumed


# --- refusals --------------------------------------------------------------------------------
class RowStochastic:
    """A duck-typed schedule whose W is row but not column stochastic (topologies.Topology
    validates every matrix, so it cannot hold one)."""

    n, period, directed, name = N, 1, True, "row_stochastic"
    W = np.array([[0.5, 0.5, 0, 0], [0, 0.5, 0.5, 0], [0, 0, 0.5, 0.5], [0.9, 0, 0, 0.1]])

    def mixing_matrix(self, step=0):
        return self.W.copy()


def fake_comm():
    """A stand-in communicator for checks that refuse at construction (no peers to broadcast with)."""
    return {"comm": types.SimpleNamespace(rank=0, size=N), "broadcast_initial": False}


def base():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)


def refusal(make):
    with pytest.raises(ValueError) as err:
        make()
    message = str(err.value)
    assert "\n" not in message
    return message


def test_refusals_are_one_line_and_say_why():
    assert not np.allclose(RowStochastic.W.sum(axis=0), 1)
    msg = refusal(lambda: SGP(base(), topology=RowStochastic(), **fake_comm()))
    assert "column stochastic" in msg and "row_stochastic" in msg
    msg = refusal(lambda: D2(base(), topology=topologies.make("ring", N), **fake_comm(), lazy_mixing=False))
    assert "lambda_min" in msg and "-1/3" in msg
    assert "symmetric" in refusal(
        lambda: D2(base(), topology=topologies.make("one_peer_exponential", N), **fake_comm())
    )
    assert "compressor" in refusal(lambda: Choco(base(), topology=topologies.make("ring", N), **fake_comm()))
    for ratio in (0, 1.5, None):
        assert "(0, 1]" in refusal(
            lambda r=ratio: Choco(
                base(), topology=topologies.make("ring", N), **fake_comm(), compressor="top_k", ratio=r
            )
        )
    assert "static" in refusal(
        lambda: Choco(base(), topology=topologies.make("one_peer_exponential", N), **fake_comm(), compressor="sign")
    )
    push_sum = topologies.from_matrix(RowStochastic.W.T, directed=True)  # column but not row stochastic
    assert "doubly stochastic" in refusal(lambda: GradientTracking(base(), topology=push_sum, **fake_comm()))
    assert "doubly stochastic" in refusal(lambda: D2(base(), topology=push_sum, **fake_comm()))
    assert "momentum" in refusal(
        lambda: DPSGD(
            torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1, momentum=0.9),
            topology=topologies.make("ring", N),
            **fake_comm(),
            qgm=True,
        )
    )


def test_sgp_accepts_directed_and_undirected_d2_accepts_lazy_ring():
    for name in ("directed_exponential", "one_peer_directed_exponential", "ring", "one_peer_exponential"):
        SGP(base(), topology=topologies.make(name, N), **fake_comm())
    D2(base(), topology=topologies.make("ring", N), **fake_comm(), lazy_mixing="auto")
    D2(
        base(), topology=topologies.make("ring", 5), comm=types.SimpleNamespace(rank=0, size=5), broadcast_initial=False
    )  # lambda_min > -1/3


@pytest.mark.parametrize("name", ["sgp", "choco", "d2", "gradient_tracking", "qgm"])
def test_configs_build_their_algorithm(name):
    assert runs.algorithm(name)["name"] == name and name in ALGORITHMS
    options = runs.own_options(name)
    base_cfg = runs.load("optimizer", runs.optimizer_of(name))  # the base optimizer its yaml picks
    params = [torch.nn.Parameter(torch.zeros(3))]
    comm = types.SimpleNamespace(rank=0, size=8)
    opt = build(
        name,
        torch.optim.SGD(params, lr=base_cfg["lr"], momentum=base_cfg["momentum"]),
        topology=topologies.make("ring", 8),
        comm=comm,
        broadcast_initial=False,
        **options,
    )
    assert isinstance(opt, ALGORITHMS[name])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_torch_step_hooks_fire_around_every_algorithms_step():
    def peer(comm):
        calls = []
        for name in ALGORITHMS:
            if ALGORITHMS[name].asynchronous:
                continue  # its step needs its budget and threads (test_adpsgd, test_async_local_sgd)
            w = torch.nn.Parameter(torch.ones(3))
            options = runs.own_options(name)  # as a run's build hands them over
            topology = topologies.make("directed_exponential" if name == "sgp" else "ring", comm.size)
            opt = build(name, torch.optim.SGD([w], lr=0.1), topology=topology, comm=comm, **options)
            opt.register_step_pre_hook(lambda o, args, kwargs, n=name: calls.append(("pre", n, o.step_count)))
            opt.register_step_post_hook(lambda o, args, kwargs, n=name: calls.append(("post", n, o.step_count)))
            w.grad = torch.ones(3)
            opt.step()
        return calls

    calls = run_local(N, peer)[0]
    expected = [
        (when, name, count)
        for name, cls in ALGORITHMS.items()
        if not cls.asynchronous
        for when, count in (("pre", 0), ("post", 1))
    ]
    assert calls == expected
