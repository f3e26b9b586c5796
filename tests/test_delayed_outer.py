"""DiLoCo's delayed and eager outer steps (`outer_delay=1`, `eager`) against a numpy statement of Kale et al. 2025's
equations, on real peers (local backend) and the fleet, and their exchange counted as overlapped."""

from __future__ import annotations

import numpy as np
import pytest
import runs
import torch
from peers import local_sgd_peer as peer
from peers import quadratic as q
from reference import grads
from test_fleet import assert_fleet_equals_local, config

from dpsgd import models
from dpsgd.comm import run_local
from dpsgd.config import parse
from dpsgd.optim import DiLoCo
from experiments import cost_model
from experiments.reproductions import kale2025

torch.set_num_threads(1)
N, H, STEPS, LR, ALPHA, BETA = 4, 3, 13, 0.05, 0.7, 0.9


def reference(delay: int, eager: bool) -> np.ndarray:
    """(steps, n, d): plain SGD inner steps, every H steps outer step t with Delta_i^t = theta_i - x_i from peer i's
    own copy theta_i of the global model and Nesterov SGD (u <- beta u + G, theta <- theta - alpha (G + beta u)) on
    G_i^t = mean_j Delta_j^t (synchronous), mean_j Delta_j^{t-1} (delayed: Delta^0 = 0), or eager
    Delta_i^t / n + sum_{j != i} Delta_j^{t-1} / n; then x_i <- theta_i."""
    A, b, x0 = q.problem(N)
    x = x0.copy()
    theta = np.broadcast_to(x0.mean(0), x.shape).copy()  # broadcast_initial=False: the first anchor is the mean
    u, last, out = np.zeros_like(x), np.zeros_like(x), []
    for t in range(1, STEPS + 1):
        x = x - LR * grads(A, b, x)
        if t % H == 0:
            delta = theta - x
            if not delay:
                G = np.broadcast_to(delta.mean(0), x.shape)
            else:
                G = np.broadcast_to(last.mean(0), x.shape)  # the previous round's, arrived now
                if eager:  # own share fresh, the others' a round late
                    G = (delta + (last.sum(0) - last)) / N
                last = delta
            u = BETA * u + G
            theta = theta - ALPHA * (G + BETA * u)
            x = theta.copy()
        out.append(x.copy())
    return np.array(out)


def case(delay: int, eager: bool):
    return ("diloco", "sgd", {"lr": LR}, {"period": H, "outer_delay": delay, "eager": eager})


@pytest.mark.parametrize("delay, eager", [(1, False), (1, True)], ids=["delayed", "eager"])
def test_real_peers_follow_the_papers_equations(delay, eager):
    got = np.stack(run_local(N, peer.trajectory, case(delay, eager), STEPS), axis=1)
    want = reference(delay, eager)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)
    synchronous = reference(0, False)
    assert np.abs(want[H:] - synchronous[H:]).max() > 1e-2  # the delay changes the trajectory
    if eager:
        assert np.ptp(want[-1], axis=0).max() > 1e-3  # each peer its own global copy
        assert np.abs(want - reference(1, False)).max() > 1e-2


def test_reference_without_delay_is_diloco():
    got = np.stack(run_local(N, peer.trajectory, case(0, False), STEPS), axis=1)
    np.testing.assert_allclose(got, reference(0, False), rtol=0, atol=1e-10)


@pytest.mark.parametrize("eager", [False, True], ids=["delayed", "eager"])
def test_fleet_equals_real_peers(eager):
    assert_fleet_equals_local(config("diloco", "ring", 4, period=3, outer_delay=1, eager=eager), 10)


def test_a_checkpoint_with_an_exchange_in_flight_resumes_identically():
    """10 eager steps in one go == 4 steps (round 1's exchange in flight), state_dict, a fresh optimizer, 6 more."""
    import io

    def fn(comm):
        straight = peer.trajectory(comm, case(1, True), steps=10)
        params, loss = peer.model(comm)
        make = lambda: DiLoCo(  # noqa: E731
            torch.optim.SGD(params, lr=LR), comm=comm, period=H, outer_delay=1, eager=True, broadcast_initial=False
        )
        opt = make()
        first = peer.take_steps(opt, params, loss, 4)
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        buf.seek(0)
        resumed = make()
        resumed.load_state_dict(torch.load(buf))
        return straight, first + peer.take_steps(resumed, params, loss, 6)

    for straight, resumed in run_local(N, fn):
        np.testing.assert_array_equal(np.array(resumed), np.array(straight))


def emulated_summary(tmp_path, delay: int, latency_s: float = 1e-3, eager: bool = False, slowdown: float = 1.0) -> dict:
    """DiLoCo (period 3) on 4 real peers over an emulated 1 Gb/s link with 1 ms latency and 10 ms of compute a
    step (model mode: the emulated clock only): an outer all-reduce costs about 6 ms, a round computes 30 ms.
    `slowdown`: peer cost_model.STRAGGLER computes that many times slower."""
    from dpsgd.training import train

    cfg = runs.experiment(runs.algorithm("diloco", period=3, outer_delay=delay, eager=eager), "ring", 4, "local")
    net = cost_model.Network(latency_s=latency_s, bandwidth_bytes_per_s=1.25e8, slowdown=slowdown)
    cfg["network"] = {**runs.load("network", "ethernet_1g"), **net.config(0.01, 4)}
    cfg["log_every"] = 1000
    out = tmp_path / f"delay{delay}-{eager}-{latency_s}-{slowdown}"
    out.mkdir()
    run_local(4, train, parse(cfg), out, timeout_s=60)
    return runs.summary(out)


def test_the_outer_exchange_is_hidden_on_the_emulator(tmp_path):
    """outer_delay=1 (and eager, which sends the same exchange): the outer all-reduce runs behind the next round's
    compute, so the emulated clock waits for it no more (exposed communication per round about 0, against the
    synchronous round's whole all-reduce) and the run ends sooner with the same bytes; the wall-clock window it had
    is counted in comm_overlap_s. The final test loss: eager's between synchronous DiLoCo's and the delayed run's, the
    shape Kale et al. report (issue 39's line also asks the delayed run to end within kale2025's tolerance of
    synchronous DiLoCo; at this size, as in the reproduction, it does not: docs/reproductions.md)."""
    delayed, synchronous = emulated_summary(tmp_path, 1), emulated_summary(tmp_path, 0)
    eager = emulated_summary(tmp_path, 1, eager=True)
    rounds = synchronous["steps"] // 3
    exposed = {
        k: s["emulated_wait_s"] / rounds for k, s in (("delayed", delayed), ("eager", eager), ("sync", synchronous))
    }
    assert exposed["sync"] > 5e-3, exposed
    assert max(exposed["delayed"], exposed["eager"]) < kale2025.HIDDEN * exposed["sync"], exposed
    assert delayed["emulated_time_s"] < synchronous["emulated_time_s"] - 0.9 * synchronous["emulated_wait_s"]
    assert eager["emulated_time_s"] == delayed["emulated_time_s"]
    assert delayed["mb_sent_per_peer"] == synchronous["mb_sent_per_peer"] == eager["mb_sent_per_peer"]
    assert delayed["comm_overlap_s"] > synchronous["comm_overlap_s"]
    losses = [run["test_loss"] for run in (synchronous, eager, delayed)]
    assert losses == sorted(losses), losses


@pytest.mark.parametrize("slowdown", [1.0, 4.0], ids=["even", "straggler"])
def test_the_cost_models_closed_form_is_the_emulators_clock(tmp_path, slowdown):
    """experiments.cost_model's periodic form with `delayed` (outer_delay=1, and eager's) and without gives the
    emulator's clock, where the round's compute hides the exchange (1 ms links) and where it does not (10 ms: 60 ms
    a round), with every peer as fast and with peer 1 4x slower (the exchange starts when the straggler gets there)."""
    nbytes = 4 * sum(p.numel() for p in models.build("mlp", (64,), 10, seed=0).parameters())
    for latency_s in (1e-3, 1e-2):
        net = cost_model.Network(latency_s=latency_s, bandwidth_bytes_per_s=1.25e8, slowdown=slowdown)
        for delay, eager in ((1, False), (0, False), *(((1, True),) if slowdown != 1 else ())):
            summary = emulated_summary(tmp_path, delay, latency_s, eager, slowdown)
            form = cost_model.Algorithm("diloco", (), "periodic", period=3, delayed=bool(delay))
            predicted = cost_model.clock_after(form, summary["steps"], 4, nbytes, 0.01, net)
            assert predicted == pytest.approx(summary["emulated_time_s"], rel=1e-3), (latency_s, delay, eager)


def test_bad_combinations_are_refused_in_one_line():
    def build(comm, **options):
        params, _ = peer.model(comm)
        return DiLoCo(torch.optim.SGD(params, lr=LR), comm=comm, **options)

    for options, words in (
        ({"eager": True}, "set outer_delay=1"),
        ({"outer_delay": 2}, "must be 0"),
        ({"outer_delay": 1, "outer": None}, "needs an outer optimizer"),
        ({"outer_delay": 1, "inner_state": "average"}, "inner_state keep or reset"),
    ):
        with pytest.raises(ValueError, match=words):
            run_local(1, build, **options)
