"""The event simulator of AD-PSGD (dpsgd.sim.events): its parameters equal a numpy replay of its own
event log (gradients recomputed from the log's order of steps and averagings), one history per seed,
stragglers and link costs acting as they should, compute-time distributions of the stated mean."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from dpsgd import data
from dpsgd.comm.netem import Link
from dpsgd.config import parse
from dpsgd.sim.events import ComputeTimes, Simulation

torch.set_num_threads(1)
CONF = Path(__file__).parent.parent / "conf"


def config(peers=4, topology="ring", model="linear", momentum=0.9, **algo) -> dict:
    def load(group, name):
        return yaml.safe_load((CONF / group / f"{name}.yaml").read_text())

    return {
        "algorithm": {**load("algorithm", "adpsgd"), **algo},
        "optimizer": {"name": "sgd", "lr": 0.1, "momentum": momentum},
        "topology": load("topology", topology),
        "model": load("model", model),
        "data": load("data", "digits"),
        "backend": {"name": "fleet"},
        "network": load("network", "loopback"),
        "peers": peers,
        "seed": 5,
        "epochs": 2,
        "batch_size": 16,
        "log_every": 10,
        "device": "cpu",
        "comm": {"timeout_s": 60},
    }


def softmax_grad(w: np.ndarray, x: np.ndarray, y: np.ndarray, classes: int) -> np.ndarray:
    """Gradient of the mean cross-entropy of a linear model, parameters flat as torch orders them
    (weight (classes, features) row-major, then bias)."""
    features = x.shape[1]
    weight, bias = w[: classes * features].reshape(classes, features), w[classes * features :]
    logits = x @ weight.T + bias
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(y)), y] -= 1
    p /= len(y)
    return np.concatenate([(p.T @ x).reshape(-1), p.sum(0)])


def replay(cfg: dict, sim: Simulation, x0: np.ndarray, weight: float = 0.5) -> np.ndarray:
    """Apply the event log in order, in float64: a step takes its peer's next batch, the gradient at
    the peer's snapshot (its live value after its previous step), -lr g added to the live value; an
    averaging moves each of its two peers `weight` of the way to the other (1/2: both to their mean).
    Checks each logged staleness on the way."""
    n, lr = cfg["peers"], cfg["optimizer"]["lr"]
    live = np.tile(x0.astype(np.float64), (n, 1))
    snap = live.copy()
    version, snap_version = np.zeros(n, int), np.zeros(n, int)
    seed, split = cfg["seed"], sim.plan.split
    batches = [
        data.Batches(split.x_train[s], split.y_train[s], cfg["batch_size"], seed=seed * 1000 + r + 1)
        for r, s in enumerate(sim.plan.shares)
    ]
    for event in sim.log:
        if event[0] == "step":
            _, _, i, _, stale = event
            assert version[i] - snap_version[i] == stale
            xb, yb = batches[i].next()
            g = softmax_grad(snap[i], xb.reshape(len(xb), -1).double().numpy(), yb.numpy(), split.num_classes)
            live[i] -= lr * g
            snap_version[i] = version[i]
            snap[i] = live[i]
        else:
            _, _, a, _, p = event
            live[a], live[p] = live[a] + weight * (live[p] - live[a]), live[p] + weight * (live[a] - live[p])
            version[a] += 1
            version[p] += 1
    return live


@pytest.mark.parametrize("link", [Link(), Link(latency_s=0.004, bandwidth_bytes_per_s=2.5e5)])
@pytest.mark.parametrize("distribution", ["constant", "lognormal"])
def test_parameters_equal_a_numpy_replay_of_the_event_log(link, distribution):
    cfg = config(peers=6, momentum=0.0)
    sim = Simulation(parse(cfg), link=link, compute=ComputeTimes(6, 0.01, distribution, seed=1, scales={1: 3.0}))
    x0 = sim.live[0].double().numpy().copy()
    sim.run()
    assert any(e[0] == "avg" for e in sim.log) and max(opt.measurements()["staleness_max"] for opt in sim.opts) >= 1
    expected = replay(cfg, sim, x0)
    np.testing.assert_allclose(sim.live.double().numpy(), expected, rtol=0, atol=2e-5)


def test_protocol_invariants():
    cfg = config(peers=8, topology="hypercube", model="mlp")
    sim = Simulation(parse(cfg), link=Link(latency_s=0.02))  # slower links than compute: steps wait
    sim.run()
    active = {r for r in range(8) if sim.opts[r].role == "active"}
    for e in sim.log:
        if e[0] == "avg":
            assert e[2] in active and e[4] not in active and e[4] in sim.opts[e[2]].averaging.partners
    m = [opt.measurements() for opt in sim.opts]
    assert sum(p["averagings_initiated"] for p in m) == sum(p["averagings_served"] for p in m)
    assert sum(p["averagings_served"] for p in m) == sum(e[0] == "avg" for e in sim.log)
    assert sum(sim.steps) * cfg["batch_size"] >= sim.budget_samples
    waits = [p["wait_s"] for p in m]
    assert all(waits[r] > 0 for r in active) and all(waits[r] == 0 for r in range(8) if r not in active)
    # a link 20 ms per message: every averaging costs an active peer two messages in flight
    assert sim.end_time >= max(p["averagings_initiated"] for p in m) * 2 * 0.02


def test_one_history_per_seed():
    cfg = config(peers=4, model="mlp")
    runs = [Simulation(parse(cfg), compute=ComputeTimes(4, 0.01, "pareto", seed=3)).run() for _ in range(2)]
    assert runs[0].log == runs[1].log
    assert torch.equal(runs[0].live, runs[1].live)
    other = Simulation(parse(cfg), compute=ComputeTimes(4, 0.01, "pareto", seed=4)).run()
    assert other.log != runs[0].log


def test_a_straggler_slows_only_itself():
    cfg = config(peers=8, model="linear")
    cfg["network"].update(slow_peers=[3], compute_scale=4.0)
    sim = Simulation(parse(cfg)).run()
    others = [s for r, s in enumerate(sim.steps) if r != 3]
    assert sim.steps[3] <= min(others) / 3  # about a quarter of the others' steps
    assert max(others) - min(others) <= 2


# the median of each factor of mean 1: 1, ln 2, exp(-sigma^2 / 2) (sigma 0.5), 2^(1/a) (a - 1) / a (a 2.5)
MEDIANS = {"constant": 1.0, "exponential": math.log(2), "lognormal": math.exp(-0.125), "pareto": 2**0.4 * 0.6}


@pytest.mark.parametrize("distribution", ["constant", "exponential", "lognormal", "pareto"])
def test_compute_time_distributions_have_the_stated_mean(distribution):
    """The stated mean (exact for constant) and each distribution's own median, which tells them apart.
    Seeded 20,000 draws per peer land within 1.2% of the mean and 0.8% of the median; the checks allow 2%."""
    times = ComputeTimes(2, 0.01, distribution, seed=0, scales={1: 4.0})
    draws = np.array([[times.draw(r) for _ in range(20000)] for r in range(2)])
    if distribution == "constant":
        np.testing.assert_array_equal(draws, np.broadcast_to([[0.01], [0.04]], draws.shape))
    np.testing.assert_allclose(draws.mean(1), [0.01, 0.04], rtol=0.02)
    np.testing.assert_allclose(np.median(draws, 1), np.array([0.01, 0.04]) * MEDIANS[distribution], rtol=0.02)
    with pytest.raises(ValueError, match="compute distribution must be one of"):
        ComputeTimes(2, 0.01, "gauss")
