"""Asynchronous Local-SGD (dpsgd.optim.async_local_sgd): the merger's update step by step against a few lines of numpy
restating the equations (delayed Nesterov, Nesterov on every arrival as torch's SGD, DyLU periods, the
sample-weighted quorum merge), and whole runs: the event simulator (stragglers, random delays, failures), the local
backend against the simulator on constant compute times, a silent worker, and the app on mpi processes."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from runs import algorithm, experiment

from dpsgd.backends.launch import peer_env
from dpsgd.comm import PeerTimeoutError, run_local
from dpsgd.config import parse
from dpsgd.optim import AsyncLocalSGD
from dpsgd.optim.async_local_sgd import Merger, dylu_period
from dpsgd.sim.events import ComputeTimes, SimulatedCommunicator, Simulation
from dpsgd.sim.run import train_fleet

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parent.parent


def merger(x0, n=4, **options) -> Merger:
    settings = dict(lr=0.7, momentum=0.9, delayed_nesterov=True, dn_every=n, quorum=1, grace_s=0.0, period=8)
    settings.update(periods=None, dylu=True, speeds=None)
    settings.update(options)
    return Merger(torch.tensor(x0, dtype=torch.float64), n, **settings)


def numpy_server(x0, grads, lr, beta, every, delayed=True):
    """The equations of AsyncLocalSGD's docstring, update by update: the global model after each."""
    x, m, acc, out = np.array(x0, dtype=np.float64), np.zeros(len(x0)), np.zeros(len(x0)), []
    for t, g in enumerate(grads, start=1):
        if not delayed:
            m = beta * m + g
            x = x - lr * (g + beta * m)
        else:
            acc = acc + g
            if t % every == 0:
                m = beta * m + acc / every
                x = x - lr * (g / every + beta * m)
                acc = np.zeros_like(acc)
            else:
                x = x - lr * g / every
        out.append(x.copy())
    return out


def arrivals(count=11, dim=5, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(dim) for _ in range(count)]


@pytest.mark.parametrize("delayed,every", [(True, 4), (True, 3), (True, 1), (False, 4)])
def test_each_arrival_updates_the_global_model_as_the_equations_say(delayed, every):
    x0, grads = np.linspace(-1, 1, 5), arrivals()
    m = merger(x0, delayed_nesterov=delayed, dn_every=every, lr=0.6, momentum=0.8)
    want = numpy_server(x0, grads, 0.6, 0.8, every, delayed)
    for t, g in enumerate(grads):
        m.push(t % 4, torch.tensor(g), samples=16, steps=1, now=float(t), pulled=m.version)
        np.testing.assert_allclose(m.x.numpy(), want[t], rtol=0, atol=1e-12, err_msg=f"update {t + 1}")
    assert m.updates == m.version == m.merges == m.arrivals == len(grads)


def test_nesterov_on_every_arrival_is_torch_sgd_and_dn_with_n_1_equals_it():
    """Independent of the numpy above: torch's SGD(nesterov) stepping on g is both forms with N = 1."""
    x0, grads = np.linspace(-1, 1, 5), arrivals(7, seed=1)
    w = torch.tensor(x0, requires_grad=True)
    sgd = torch.optim.SGD([w], lr=0.7, momentum=0.9, nesterov=True)
    plain, delayed = merger(x0, delayed_nesterov=False), merger(x0, dn_every=1)
    for g in grads:
        w.grad = torch.tensor(g)
        sgd.step()
        for m in (plain, delayed):
            m.push(1, torch.tensor(g), samples=1, steps=1, now=0.0, pulled=0)
            torch.testing.assert_close(m.x, w.detach(), rtol=0, atol=1e-12)


def test_dn_moves_as_one_nesterov_step_on_the_mean_of_n_arrivals():
    """Over N arrivals, delayed Nesterov moves x by what one synchronous outer step on the N gradients' mean does."""
    x0, grads = np.zeros(5), arrivals(8, seed=2)
    m = merger(x0, dn_every=4)
    w = torch.zeros(5, dtype=torch.float64, requires_grad=True)
    sgd = torch.optim.SGD([w], lr=0.7, momentum=0.9, nesterov=True)
    for k in range(2):
        block = grads[4 * k : 4 * k + 4]
        for g in block:
            m.push(0, torch.tensor(g), samples=1, steps=1, now=0.0, pulled=0)
        w.grad = torch.tensor(np.mean(block, axis=0))
        sgd.step()
        torch.testing.assert_close(m.x, w.detach(), rtol=0, atol=1e-12)


def test_dylu_periods_are_h_times_relative_speed_floored():
    speeds = [100.0, 100.0, 25.0, 37.5, 0.1, 60.0]
    want = [max(1, math.floor(8 * v / max(speeds))) for v in speeds]
    assert want == [8, 8, 2, 3, 1, 4]  # 60 / 100 x 8 = 4.8: floored
    assert [dylu_period(8, v, max(speeds)) for v in speeds] == want
    m = merger(np.zeros(2), n=6, speeds=speeds)
    assert [m.period_of(r) for r in range(6)] == want
    measured = merger(np.zeros(2), n=6)
    assert measured.period_of(3) == 8  # nothing measured yet: H
    for r, v in enumerate(speeds):
        measured.report_speed(r, v)
    assert [measured.period_of(r) for r in range(6)] == want
    assert [merger(np.zeros(2), n=6, periods=[8, 4, 2, 2, 1, 3]).period_of(r) for r in range(6)] == [8, 4, 2, 2, 1, 3]
    assert [merger(np.zeros(2), n=6, speeds=speeds, dylu=False).period_of(r) for r in range(6)] == [8] * 6


def test_quorum_merge_weights_by_samples_and_waits_at_most_the_grace_window():
    x0, (d1, d2, d3, d4) = np.linspace(0, 1, 5), arrivals(4, seed=3)
    m = merger(x0, quorum=2, grace_s=1.0, dn_every=2, lr=0.5, momentum=0.9)
    m.push(1, torch.tensor(d1), samples=10, steps=1, now=0.0, pulled=0)
    assert m.updates == 0 and m.due() is None  # below the quorum
    m.push(2, torch.tensor(d2), samples=30, steps=3, now=0.5, pulled=0)
    assert m.updates == 0 and m.due() == 1.5  # quorum reached: waits for the others up to the grace window
    assert not m.tick(1.0)
    m.push(3, torch.tensor(d3), samples=20, steps=2, now=1.2, pulled=0)
    assert m.updates == 0  # rank 0 has not contributed: still waiting
    assert m.tick(1.5)
    g = (10 * d1 + 30 * d2 + 20 * d3) / 60
    np.testing.assert_allclose(m.x.numpy(), numpy_server(x0, [g], 0.5, 0.9, 2)[0], rtol=0, atol=1e-12)
    assert (m.merges, m.arrivals, m.useful_steps, m.useful_samples) == (1, 3, 6, 60)
    # every active worker in: merged at once, no grace; a worker that said DONE is not waited for
    m.done.add(3)
    for r, d, s in ((0, d4, 5), (1, d1, 15), (2, d2, 20)):
        m.push(r, torch.tensor(d), samples=s, steps=1, now=2.0, pulled=1)
    g2 = (5 * d4 + 15 * d1 + 20 * d2) / 40
    np.testing.assert_allclose(m.x.numpy(), numpy_server(x0, [g, g2], 0.5, 0.9, 2)[1], rtol=0, atol=1e-12)
    assert m.staleness == [0, 0, 0, 0, 0, 0]


def test_dn_default_period_is_workers_per_quorum():
    def opt(quorum):
        comm = SimulatedCommunicator(0, 8, lambda: 0.0, {})
        w = torch.nn.Parameter(torch.zeros(3))
        return AsyncLocalSGD(torch.optim.SGD([w], lr=0.1), comm=comm, quorum=quorum, broadcast_initial=False)

    assert [opt(q).merger.every for q in (1, 2, 3, 8)] == [8, 4, 2, 1]


def test_options_are_refused_in_one_line():
    comm = SimulatedCommunicator(0, 4, lambda: 0.0, {})
    w = torch.nn.Parameter(torch.zeros(3))
    cases = {
        "quorum must be an integer in [1, 4]": dict(quorum=5),
        "period must be an integer >= 1": dict(period=0),
        "speeds must list one number > 0 per peer (4)": dict(speeds=[1, 2]),
        "failures takes [[peer, at_s, down_s], ...] with peer in [1, 4)": dict(failures=[[0, 1.0, 1.0]]),
        "grace_s must be >= 0": dict(grace_s=-1.0),
    }
    for words, options in cases.items():
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            AsyncLocalSGD(torch.optim.SGD([w], lr=0.1), comm=comm, broadcast_initial=False, **options)

    def real(comm):
        AsyncLocalSGD(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1), comm=comm, failures=[[1, 0.1, 1]])

    with pytest.raises(ValueError, match="on real peers inject a failure with faults.kill_peer"):
        run_local(2, real)


# --- whole runs --------------------------------------------------------------------------------------
def config(peers=4, backend="fleet", epochs=1, **options) -> dict:
    cfg = experiment(algorithm("async_local_sgd", **options), topology="complete", peers=peers, backend=backend)
    cfg.update(epochs=epochs, batch_size=32)
    return cfg


@pytest.mark.parametrize("options", [{}, {"groups": 1}])  # groups: 1 (the default) is the flat rule, number for number
def test_event_simulator_straggler_takes_fewer_local_steps_and_every_step_is_merged(options):
    sim = Simulation(parse(config(**options)), compute=ComputeTimes(4, 0.01, scales={3: 4.0})).run()
    rows = [o.measurements() for o in sim.opts]
    s = sim.opts[0].summary(rows)
    assert s["period_per_peer"] == [8, 8, 8, 2]  # DyLU from the speeds measured in virtual time
    assert s["speeds"] == {"0": 100.0, "1": 100.0, "2": 100.0, "3": 25.0}
    assert s["arrivals"] == s["merges"] == sum(s["pushes_per_peer"])
    assert s["useful_steps"] == sum(s["steps_per_peer"]) and s["lost_steps"] == 0
    assert torch.isfinite(sim.live).all() and (sim.live - sim.live[0]).abs().max() == 0  # all on the final model
    assert s["goodput_steps_per_s"] == pytest.approx(s["useful_steps"] / sim.end_time)


def test_event_simulator_under_random_delays():
    """Lognormal compute times and slow links: every push arrives and merges, the run ends finite."""
    from dpsgd.comm.netem import Link

    cfg = config(peers=5)
    sim = Simulation(parse(cfg), link=Link(latency_s=0.004), compute=ComputeTimes(5, 0.01, "lognormal", seed=4)).run()
    s = sim.opts[0].summary([o.measurements() for o in sim.opts])
    assert s["arrivals"] == sum(s["pushes_per_peer"]) == s["merges"] and s["useful_steps"] == sum(s["steps_per_peer"])
    assert s["staleness_max"] >= 1 and torch.isfinite(sim.live).all()
    assert max(o.wait_s for o in sim.opts) == 0  # steps compute while the push-pull is in flight (see the guide)


def test_quorum_merge_with_2_of_8_peers_killed_and_restarted(tmp_path):
    """Done-when of issue 39: the run finishes with every surviving peer's parameters finite and its goodput."""
    cfg = config(peers=8, epochs=2, quorum=5, grace_s=0.02, failures=[[2, 0.05, 0.1], [6, 0.08, 0.05]])
    cfg["network"].update(slow_peers=[1], compute_scale=2.0)
    summary = train_fleet(parse(cfg), tmp_path)
    saved = json.loads((tmp_path / "summary.json").read_text())
    a = saved["async_local_sgd"]
    assert summary["async_local_sgd"] == a
    assert a["lost_steps"] > 0 and a["useful_steps"] + a["lost_steps"] == sum(a["steps_per_peer"])
    assert 0 < a["goodput_steps_per_s"] < sum(a["steps_per_peer"]) / saved["emulated_time_s"]
    assert a["merges"] < a["arrivals"] == sum(a["pushes_per_peer"])  # quorums merged several pushes at once
    assert math.isfinite(saved["train_loss"]) and saved["test_accuracy"] > 0.3


def test_local_backend_agrees_with_the_event_simulator_on_constant_compute_times(tmp_path):
    """The same run, real threads on the emulator's modelled compute clock with a 3x straggler, and the event
    simulator drawing it: DyLU gives every peer the same period, every push merges, and the final accuracies are
    close. The modelled clock, not sleeps: speeds measured on the wall clock move with the machine's load (a few ms
    of load on each step already make the straggler's period 3)."""
    from dpsgd.training import train

    common = dict(epochs=2)  # two passes: at one, the threads' arrival order moved the accuracy by up to 0.11
    cfg = config(peers=4, backend="local", **common)
    cfg["network"].update(mode="model", slow_peers=[3], compute_scale=3.0, compute_time=0.03)
    (tmp_path / "local").mkdir()
    run_local(4, lambda comm: train(comm, parse(cfg), tmp_path / "local"), timeout_s=60)
    fleet = config(peers=4, **common)
    fleet["network"].update(slow_peers=[3], compute_scale=3.0, compute_time=0.03)
    (tmp_path / "fleet").mkdir()
    train_fleet(parse(fleet), tmp_path / "fleet")
    real, sim = (json.loads((tmp_path / k / "summary.json").read_text()) for k in ("local", "fleet"))
    a, b = real["async_local_sgd"], sim["async_local_sgd"]
    assert a["period_per_peer"] == b["period_per_peer"] == [8, 8, 8, 2]  # floor(8 / 3) for the straggler
    for s in (a, b):
        assert s["arrivals"] == s["merges"] == sum(s["pushes_per_peer"]) and s["lost_steps"] == 0
    assert min(real["samples"], sim["samples"]) >= 22 * 32 * 4  # the synchronous run's samples, each a few steps over
    assert abs(real["test_accuracy"] - sim["test_accuracy"]) < 0.1


def test_a_silent_worker_is_left_behind_with_a_quorum_and_named_without():
    """On the local backend, worker 3 stops after 3 steps without a word: with quorum 2 the merger ends without it
    (departed) and the others take the final model; with quorum 1 the merger names it."""

    def peer(comm, quorum):
        torch.manual_seed(comm.rank)
        w = torch.nn.Parameter(torch.randn(6))
        base = torch.optim.SGD([w], lr=0.05)
        opt = AsyncLocalSGD(base, comm=comm, period=2, quorum=quorum, grace_s=0.05, budget="steps")
        opt.set_budget(steps=12, samples_per_step=1)
        opt.start()
        while not opt.should_stop():
            if comm.rank == 3 and opt.step_count == 3:
                return None  # silent from here on
            opt.zero_grad()
            w.pow(2).sum().backward()
            opt.step()
        opt.finish()
        return w.detach().clone(), opt.departed

    results = run_local(4, peer, 2, timeout_s=0.5)
    assert results[3] is None and results[0][1] == [3]
    for w, _ in results[:3]:
        assert torch.isfinite(w).all()
        torch.testing.assert_close(w, results[0][0], rtol=0, atol=0)
    with pytest.raises(PeerTimeoutError, match=r"heard nothing for 0.5 s from worker\(s\) \[3\]"):
        run_local(4, peer, 1, timeout_s=0.5)


@pytest.mark.slow  # soak: 3 mpi processes through the app (about a minute on 2 busy cores); the default suite keeps
# the same protocol on the local backend (test_local_backend_agrees..., test_a_silent_worker...)
@pytest.mark.timeout(300)
def test_the_app_runs_it_on_mpi_processes(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "experiments.train", "algorithm=async_local_sgd", "backend=mpi", "peers=3"]
    cmd += ["epochs=2", "algorithm.period=4", "network=straggler", "network.compute_time=0.002"]
    cmd += [f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=peer_env(), capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    a = s["async_local_sgd"]
    assert s["backend"] == "mpi" and math.isfinite(s["train_loss"]) and s["test_accuracy"] > 0.3
    assert s["consensus_distance"] < 1e-9  # every peer ends on the merger's final model (up to the metric's rounding)
    assert a["arrivals"] == sum(a["pushes_per_peer"]) and a["useful_steps"] == sum(a["steps_per_peer"])
    assert a["goodput_steps_per_s"] > 0


def test_with_one_peer_4x_slower_it_reaches_synchronous_dilocos_metric_in_less_emulated_time(tmp_path):
    """Done-when of issue 39, at a small size: 8 peers on digits, peer 1 4x slower. Synchronous DiLoCo trains 10
    epochs; its emulated time is the emulator's cost model for its rounds (experiments.cost_model.clock_after, checked
    against the emulator's clock in test_map): every round waits for the straggler's H steps. Asynchronous Local-SGD
    (delayed Nesterov, DyLU) gets twice the samples, which still end sooner, and reaches synchronous DiLoCo's final
    accuracy less the reproduction's tolerance (experiments.reproductions.liu2024) well before synchronous DiLoCo
    reaches it."""
    from experiments.cost_model import Algorithm, Network, clock_after
    from experiments.targets import LIU2024_TOLERANCE

    def run(name, epochs):
        cfg = experiment(algorithm(name, period=8), topology="complete", peers=8, backend="fleet")
        cfg.update(epochs=epochs, batch_size=32, log_every=4)
        if name != "diloco":  # the fleet's synchronous steps have no clock (the app refuses a network for them)
            cfg["network"].update(slow_peers=[1], compute_scale=4.0, compute_time=0.01)
        out = tmp_path / name
        out.mkdir()
        summary = train_fleet(parse(cfg), out)
        return summary, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    def sync_s(steps):
        return clock_after(
            Algorithm("DiLoCo", (), "periodic", period=8), steps, 8, 0, 0.01, Network(0, None, slowdown=4.0)
        )

    sync, sync_records = run("diloco", 10)
    assert sync_s(sync["steps"]) == pytest.approx(sync["steps"] * 4 * 0.01)  # free links: the straggler's rounds
    target = sync["test_accuracy"] - LIU2024_TOLERANCE
    sync_hit = next(r for r in sync_records if r["test_accuracy"] is not None and r["test_accuracy"] >= target)
    fast, records = run("async_local_sgd", 20)
    assert fast["emulated_time_s"] < sync_s(sync["steps"])  # twice the samples, in less time
    hit = next((r for r in records if r["test_accuracy"] is not None and r["test_accuracy"] >= target), None)
    assert hit is not None, f"asynchronous Local-SGD never reached {target:.3f}"
    assert hit["emulated_time_s"] < 0.5 * sync_s(sync_hit["step"])


def test_one_peer_is_diloco_with_one_worker():
    """Alone, the peer pushes to its own merger every H steps: x after each round is one Nesterov outer step on
    Delta = x_pulled - x_local (delayed Nesterov with N = 1), on the simulator as on the local backend."""
    cfg = config(peers=1)
    sim = Simulation(parse(cfg), compute=ComputeTimes(1, 0.01)).run()
    s = sim.opts[0].summary([sim.opts[0].measurements()])
    assert s["arrivals"] == s["merges"] == -(-s["steps_per_peer"][0] // 8) and s["merges"] > 1
    assert sim.opts[0].merger.every == 1 and torch.isfinite(sim.live).all()
    start = torch.cat([p.detach().reshape(-1) for p in sim.model.parameters()])
    assert not torch.equal(sim.live[0], start)  # the final global model moved


def test_state_dict_holds_the_round_and_the_merger():
    """A worker's round and rank 0's merger (global model, momentum, DN buffer, quorum buffer, speeds, counters) come
    back from state_dict(); loading rank 0's state on another rank is refused in one line."""

    def opt(rank):
        w = torch.nn.Parameter(torch.arange(4.0))
        comm = SimulatedCommunicator(rank, 4, lambda: 0.0, {})
        o = AsyncLocalSGD(torch.optim.SGD([w], lr=0.1), comm=comm, quorum=2, grace_s=1.0, broadcast_initial=False)
        o.set_budget(samples=1000, samples_per_step=4)
        o.start(threads=False)
        return o, w

    a, w = opt(0)
    for _ in range(3):
        w.grad = torch.ones(4)
        a.step()
    a.merger.push(2, torch.full((4,), 0.5), samples=8, steps=2, now=0.0, pulled=0)
    a.merger.push(3, torch.full((4,), 0.25), samples=4, steps=1, now=0.1, pulled=0)  # a quorum, waiting for grace
    a.merger.report_speed(3, 12.5)
    saved = a.state_dict()
    b, _ = opt(0)
    b.load_state_dict(saved)
    assert (b.step_count, b.steps_in_round, b.samples) == (3, 3, 12)
    torch.testing.assert_close(b.live, a.live)
    torch.testing.assert_close(b.anchor, a.anchor)
    assert b.merger.speeds == {3: 12.5} and len(b.merger.buffer) == 2 and b.merger.arrivals == 2
    b.merger.tick(0.0)  # the restored quorum is due at once
    a.merger.tick(5.0)
    torch.testing.assert_close(b.merger.x, a.merger.x)
    c, _ = opt(1)
    with pytest.raises(ValueError, match="was saved on rank 0 and cannot load on rank 1"):
        c.load_state_dict(saved)


@pytest.mark.parametrize("quorum", [1, 3])
def test_local_backend_under_random_delays(quorum):
    """Real threads sleeping a random 0-4 ms before each step (seeded per peer): every push arrives once, every step
    is merged (quorum 1, no grace: each on arrival), and every peer ends on the same finite final model."""
    import random

    def peer(comm):
        rng = random.Random(comm.rank)
        torch.manual_seed(comm.rank)
        w = torch.nn.Parameter(torch.randn(8))
        opt = AsyncLocalSGD(
            torch.optim.SGD([w], lr=0.05),
            comm=comm,
            period=3,
            quorum=quorum,
            grace_s=0.003 * (quorum > 1),
            budget="samples",
        )
        opt.set_budget(samples=120, samples_per_step=1)
        return steps_under_random_delays(opt, w, comm.rank, rng)

    results = run_local(4, peer, timeout_s=20)
    s = AsyncLocalSGD.summary(None, [m for _, m in results])  # type: ignore[arg-type]
    assert s["arrivals"] == sum(s["pushes_per_peer"]) and s["useful_steps"] == sum(s["steps_per_peer"]) >= 120
    assert s["merges"] <= s["arrivals"] and (quorum == 1) == (s["merges"] == s["arrivals"])
    for w, _ in results:
        assert torch.isfinite(w).all()
        torch.testing.assert_close(w, results[0][0], rtol=0, atol=0)


def test_the_default_config_trains_the_default_workload(tmp_path):
    """`algorithm=async_local_sgd backend=fleet` with every other default (the app's 4 peers on digits) trains:
    DiLoCo's outer lr 0.7 with momentum 0.9 diverged here at step 217 (a fresh-clone review), the yaml's 0.5 and 0.5
    reach about 0.97 (liu2024 pins DiLoCo's, as the paper)."""
    from experiments.bench.harness import run_config

    train_fleet(run_config("algorithm=async_local_sgd", "backend=fleet"), tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["test_accuracy"] > 0.9, summary["test_accuracy"]


def steps_under_random_delays(opt, w, rank: int, rng) -> tuple:
    """A peer's loop with a random pause (up to 4 ms) before each step, towards w = rank: its final w and its
    measurements."""
    opt.start()
    while not opt.should_stop():
        time.sleep(rng.uniform(0, 0.004))
        opt.zero_grad()
        (w - rank).pow(2).sum().backward()
        opt.step()
    opt.finish()
    return w.detach().clone(), opt.measurements()


ASYNC_RESUME = ["algorithm=async_local_sgd", "algorithm.budget=steps", "log_every=5", "backend=local"]


def killed_and_resumed(app, tmp_path, args: list[str], peer: int, at_step: int) -> tuple[Path, Path]:
    """The app run uninterrupted (full), and run again with `peer` killed at `at_step` then resumed (killed)."""
    full, killed = tmp_path / "full", tmp_path / "killed"
    assert app(args, full, timeout=150).returncode == 0
    proc = app([*args, f"faults.kill_peer={peer}", f"faults.at_step={at_step}"], killed, timeout=150)
    assert proc.returncode == 1 and f"peer {peer} exited at step {at_step}" in proc.stderr, proc.stderr
    proc = app([*args, "resume=true"], killed, timeout=150)
    assert proc.returncode == 0, proc.stderr
    return full, killed


@pytest.mark.slow  # soak: three app runs (about 30 s on 2 cores; the state_dict round trip is in the default suite)
@pytest.mark.processes
@pytest.mark.timeout(200)
def test_the_app_resumes_an_async_run_to_the_numbers_of_an_uninterrupted_one(app, tmp_path):
    """One peer (the merger training as a worker: a deterministic schedule) killed at step 25 and resumed from its
    checkpoint at 20 ends with the uninterrupted run's records and merger counts."""
    from runs import summary, timeless_records

    args = [*ASYNC_RESUME, "peers=1", "epochs=1", "checkpoint.every=10"]
    full, killed = killed_and_resumed(app, tmp_path, args, peer=0, at_step=25)
    a, b = summary(full), summary(killed)
    assert b["resumed_from"] == 20
    for key in ("steps", "samples", "test_accuracy", "test_loss", "train_loss"):
        assert json.dumps(a[key]) == json.dumps(b[key]), key
    counts = ("arrivals", "merges", "useful_steps", "steps_per_peer", "pushes_per_peer", "period_per_peer")
    assert {k: a["async_local_sgd"][k] for k in counts} == {k: b["async_local_sgd"][k] for k in counts}

    def records(run_dir):  # the final record's block holds timings (goodput, speeds): its counts are checked above
        return [{k: v for k, v in r.items() if k != "async_local_sgd"} for r in timeless_records(run_dir)]

    assert records(full) == records(killed)


@pytest.mark.slow  # soak: three runs of four local peers (about 20 s)
@pytest.mark.processes
@pytest.mark.timeout(200)
def test_four_peers_resume_after_a_worker_is_killed(app, tmp_path):
    """Worker 2 killed at step 13, all resumed from step 10: the same steps, every push merged, an accuracy near
    the uninterrupted run's (the arrival order is the threads', so not its numbers)."""
    from runs import summary

    args = [*ASYNC_RESUME, "peers=4", "epochs=2", "checkpoint.every=5"]
    full, killed = killed_and_resumed(app, tmp_path, args, peer=2, at_step=13)
    a, b = summary(full), summary(killed)
    assert b["resumed_from"] == 10 and a["steps"] == b["steps"]
    assert a["async_local_sgd"]["steps_per_peer"] == b["async_local_sgd"]["steps_per_peer"]
    assert b["async_local_sgd"]["arrivals"] == b["async_local_sgd"]["merges"] > 0
    assert abs(a["test_accuracy"] - b["test_accuracy"]) < 0.1
