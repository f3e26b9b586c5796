"""Hierarchical asynchronous Local-SGD (AsyncLocalSGD with `groups: G`, dpsgd.optim.hierarchical): the group servers'
and the global merger's updates step by step against a few lines of numpy restating the equations, groups 1 equal to
the flat rule, whole runs on the event simulator, and the refusals."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from runs import algorithm, experiment
from test_async_local_sgd import steps_under_random_delays

from dpsgd.comm import run_local
from dpsgd.config import parse
from dpsgd.optim import AsyncLocalSGD
from dpsgd.optim.async_local_sgd import Merger
from dpsgd.optim.hierarchical import GroupServer, group_of
from dpsgd.sim.events import ComputeTimes, SimulatedCommunicator, Simulation
from dpsgd.sim.run import train_fleet

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parent.parent


def merger(x0, n, lr, momentum, every) -> Merger:
    return Merger(
        torch.tensor(x0, dtype=torch.float64),
        n,
        lr=lr,
        momentum=momentum,
        delayed_nesterov=True,
        dn_every=every,
        quorum=1,
        grace_s=0.0,
        period=8,
        periods=None,
        dylu=False,
        speeds=None,
    )


class NumpyOuter:
    """Delayed Nesterov, as AsyncLocalSGD's docstring states it: update t with outer gradient g."""

    def __init__(self, x0, lr, beta, every):
        self.x, self.m, self.acc = np.array(x0, dtype=np.float64), np.zeros(len(x0)), np.zeros(len(x0))
        self.lr, self.beta, self.every, self.t = lr, beta, every, 0

    def update(self, g):
        self.t += 1
        self.acc = self.acc + g
        if self.t % self.every == 0:
            self.m = self.beta * self.m + self.acc / self.every
            self.x = self.x - self.lr * (g / self.every + self.beta * self.m)
            self.acc = np.zeros_like(self.acc)
        else:
            self.x = self.x - self.lr * g / self.every


def test_group_servers_and_the_global_merger_step_by_step_as_the_equations_say():
    """Two groups of 3 workers, K = 2, a push in flight while more local merges land (random order, seeded): after every
    event the group models y_g, their anchors and the global model x equal the numpy restatement:
    local: y_g <- DN(y_g, Delta_i); every K local merges with no push in flight: D_g = anchor_g - y_g, y_sent = y_g,
    anchor_g <- y_g, x <- DN_global(x, D_g); on the answer: y_g <- x + (y_g - y_sent), anchor_g <- x."""
    rng = np.random.default_rng(5)
    x0, K = np.linspace(-1, 1, 6), 2
    servers = [GroupServer(merger(x0, 3, 0.6, 0.8, 3), K, range(3 * g, 3 * g + 3)) for g in range(2)]
    glob = merger(x0, 2, 0.9, 0.5, 2)
    ref_local = [NumpyOuter(x0, 0.6, 0.8, 3) for _ in range(2)]
    ref_global = NumpyOuter(x0, 0.9, 0.5, 2)
    anchor, sent, since, answer = [x0.copy(), x0.copy()], [None, None], [0, 0], [None, None]
    pushed = 0
    for event in range(60):
        g = int(rng.integers(2))
        if answer[g] is not None and rng.random() < 0.4:  # the global model comes back
            x_answer, version = answer[g]
            servers[g].adopt(torch.tensor(x_answer), version)
            ref_local[g].x = x_answer + (ref_local[g].x - sent[g])
            anchor[g], sent[g], answer[g] = x_answer.copy(), None, None
        else:  # a worker's outer gradient arrives at its group server
            delta = rng.standard_normal(6) * 0.1
            servers[g].merger.push(3 * g + int(rng.integers(3)), torch.tensor(delta), 8, 1, float(event), 0)
            ref_local[g].update(delta)
            since[g] += 1
        assert servers[g].due() == (sent[g] is None and since[g] >= K)
        if servers[g].due():
            d = servers[g].take_push()
            want = anchor[g] - ref_local[g].x
            sent[g], anchor[g], since[g] = ref_local[g].x.copy(), ref_local[g].x.copy(), 0
            glob.push(g, d, 8, 1, float(event), 0)
            ref_global.update(want)
            answer[g] = (glob.x.numpy().copy(), glob.version)
            pushed += 1
            np.testing.assert_allclose(d.numpy(), want, rtol=0, atol=1e-12, err_msg=f"D_g at event {event}")
        for h in range(2):
            np.testing.assert_allclose(servers[h].merger.x.numpy(), ref_local[h].x, rtol=0, atol=1e-12)
            np.testing.assert_allclose(servers[h].anchor.numpy(), anchor[h], rtol=0, atol=1e-12)
        np.testing.assert_allclose(glob.x.numpy(), ref_global.x, rtol=0, atol=1e-12, err_msg=f"x at event {event}")
    assert pushed >= 8 and glob.updates == pushed == sum(s.pushes for s in servers)


def test_groups_are_contiguous_and_led_by_their_first_rank():
    assert [group_of(r, 8, 2)[:2] for r in range(8)] == [(0, 0)] * 4 + [(1, 4)] * 4
    assert list(group_of(5, 6, 3)[2]) == [4, 5]
    assert [group_of(r, 3, 1)[1] for r in range(3)] == [0, 0, 0]


def config(peers=8, epochs=1, backend="fleet", **options) -> dict:
    cfg = experiment(algorithm("async_local_sgd", **options), topology="complete", peers=peers, backend=backend)
    cfg.update(epochs=epochs, batch_size=32)
    return cfg


def test_groups_1_is_the_flat_rule_bit_for_bit():
    """groups: 1 (explicit, and with global options that then play no part) gives today's numbers exactly."""
    runs = []
    for options in ({}, {"groups": 1}, {"groups": 1, "global_every": 3, "global_lr": 0.5}):
        sim = Simulation(parse(config(peers=4, **options)), compute=ComputeTimes(4, 0.01, scales={3: 4.0})).run()
        runs.append((sim.live.clone(), sim.opts[0].summary([o.measurements() for o in sim.opts])))
    for live, summary in runs[1:]:
        assert torch.equal(live, runs[0][0]) and summary == runs[0][1]
    assert "global_arrivals" not in runs[0][1]


def test_event_simulator_two_groups_every_push_reaches_the_global_model():
    """8 peers in 2 groups, peer 5 4x slower, links with latency: every worker push merges at its group server, every
    group delta reaches the global merger (the last ones once the groups are done), every peer ends on the global model;
    group workers talk only to their leader and only leaders to rank 0, so rank 0 sends less than the flat merger."""
    from dpsgd.comm.netem import Link

    cfg = config(epochs=2, groups=2, global_every=3)  # 8 and 7 merges: 2 and 1 left for the last push
    sim = Simulation(parse(cfg), link=Link(latency_s=0.003), compute=ComputeTimes(8, 0.01, scales={5: 4.0})).run()
    s = sim.opts[0].summary([o.measurements() for o in sim.opts])
    assert s["arrivals"] == s["merges"] == sum(s["pushes_per_peer"]) and s["useful_steps"] == sum(s["steps_per_peer"])
    assert s["global_arrivals"] == sum(s["global_pushes_per_group"]) and s["global_arrivals"] == 6
    assert s["period_per_peer"][5] < min(s["period_per_peer"][4:5] + s["period_per_peer"][6:])  # DyLU in the group
    assert [o.leader for o in sim.opts] == [0] * 4 + [4] * 4 and sim.opts[4].group_server is not None
    assert sim.opts[0].global_merger is not None and sim.opts[4].global_merger is None
    assert sim.opts[0].global_merger.every == 2 and sim.opts[4].merger.every == 4  # N: G globally, s in a group
    assert [sim.opts[4 * g].merger.merges for g in (0, 1)] == [8, 7] and s["global_pushes_per_group"] == [3, 3]
    assert [o.partners for o in sim.opts[4:]] == [frozenset()] + [frozenset({4})] * 3
    assert torch.isfinite(sim.live).all() and (sim.live - sim.live[0]).abs().max() == 0
    for g in (0, 1):  # each group ends with nothing unpushed: y_g = anchor_g
        group = sim.opts[4 * g].group_server
        assert group is not None and group.sent is None and torch.equal(group.merger.x, group.anchor)
    assert sim.bytes_sent[4] > sim.bytes_sent[5] > 0  # the leader's pushes to rank 0 and replies to its workers
    flat = Simulation(
        parse(config(epochs=2)), link=Link(latency_s=0.003), compute=ComputeTimes(8, 0.01, scales={5: 4.0})
    )
    flat.run()
    assert sim.bytes_sent[0] < 0.8 * flat.bytes_sent[0]  # rank 0 answers 3 workers and 1 group, not 7 workers


def test_two_groups_reach_the_flat_runs_metric_with_one_peer_4x_slower(tmp_path):
    """8 peers, peer 1 4x slower, 20 epochs on digits (the fleet's event simulator, constant compute 0.01 s per step):
    the hierarchical run (2 groups, K = 2) ends within 0.03 of the flat asynchronous run's test accuracy, on the same
    emulated time. Measured 2026-12-06 (deterministic virtual time): flat 0.914, groups 2 0.903, 55 global updates."""
    results = {}
    for name, options in (("flat", {}), ("groups", {"groups": 2, "global_every": 2})):
        cfg = config(epochs=20, period=8, **options)
        cfg["network"].update(slow_peers=[1], compute_scale=4.0, compute_time=0.01)
        (tmp_path / name).mkdir()
        train_fleet(parse(cfg), tmp_path / name)
        results[name] = json.loads((tmp_path / name / "summary.json").read_text())
    flat, grouped = results["flat"], results["groups"]
    assert grouped["async_local_sgd"]["global_arrivals"] > 10
    assert abs(grouped["test_accuracy"] - flat["test_accuracy"]) < 0.03 and grouped["test_accuracy"] > 0.85
    assert grouped["emulated_time_s"] == pytest.approx(flat["emulated_time_s"], rel=0.05)


@pytest.mark.parametrize("peers,groups", [(4, 2), (6, 3)])
def test_local_backend_threads_under_random_delays(peers, groups):
    """Real threads sleeping a random 0-4 ms before each step: every push reaches its group server, every group delta
    the global merger (rank 0's in memory, the others' over the link), every peer ends on the same finite model."""
    import random

    def peer(comm):
        rng = random.Random(comm.rank)
        torch.manual_seed(comm.rank)
        w = torch.nn.Parameter(torch.randn(8))
        opt = AsyncLocalSGD(torch.optim.SGD([w], lr=0.05), comm=comm, period=3, groups=groups, global_every=2)
        opt.set_budget(samples=40 * peers, samples_per_step=1)
        return steps_under_random_delays(opt, w, comm.rank, rng)

    results = run_local(peers, peer, timeout_s=20)
    s = AsyncLocalSGD.summary(None, [m for _, m in results])  # type: ignore[arg-type]
    assert s["arrivals"] == s["merges"] == sum(s["pushes_per_peer"])
    assert s["useful_steps"] == sum(s["steps_per_peer"]) >= 40 * peers
    assert s["global_arrivals"] == sum(s["global_pushes_per_group"]) and min(s["global_pushes_per_group"]) >= 2
    for w, _ in results:
        assert torch.isfinite(w).all()
        torch.testing.assert_close(w, results[0][0], rtol=0, atol=0)
    assert not torch.allclose(results[0][0], torch.zeros(8))


def test_a_silent_group_is_named_by_the_global_merger():
    """On the local backend, group 1 (ranks 2 and 3) stops after 3 steps without a word: once rank 0's worker is done,
    the global merger names the silent leader within comm.timeout_s instead of waiting for ever."""
    from dpsgd.comm import PeerTimeoutError

    def peer(comm):
        torch.manual_seed(comm.rank)
        w = torch.nn.Parameter(torch.randn(6))
        opt = AsyncLocalSGD(torch.optim.SGD([w], lr=0.05), comm=comm, period=2, groups=2, budget="steps")
        opt.set_budget(steps=12, samples_per_step=1)
        opt.start()
        while not opt.should_stop():
            if comm.rank >= 2 and opt.step_count == 3:
                return None  # silent from here on
            opt.zero_grad()
            w.pow(2).sum().backward()
            opt.step()
        opt.finish()
        return w.detach().clone()

    with pytest.raises(PeerTimeoutError, match=r"global merger heard nothing for 0.5 s from group leader\(s\) \[2\]"):
        run_local(4, peer, timeout_s=0.5)


def test_local_backend_agrees_with_the_event_simulator_on_constant_compute_times(tmp_path):
    """4 peers in 2 groups, peer 3 3x slower (real threads on the emulator's modelled compute clock, and the event
    simulator drawing it): DyLU gives it the same period within its group, every push and group delta merges, the
    accuracies are close. The modelled clock, not sleeps: speeds measured on the wall clock moved with the machine's
    load (a loaded CI measured peer 3 at more than 3/8 of peer 2's speed: period 3)."""
    from dpsgd.training import train

    runs = {}
    for backend in ("local", "fleet"):
        cfg = config(peers=4, backend=backend, groups=2, global_every=2)
        cfg["network"].update(slow_peers=[3], compute_scale=3.0, compute_time=0.03, mode="model")
        (tmp_path / backend).mkdir()
        if backend == "local":
            run_local(4, lambda comm, c=cfg: train(comm, parse(c), tmp_path / "local"), timeout_s=60)
        else:
            train_fleet(parse(cfg), tmp_path / "fleet")
        runs[backend] = json.loads((tmp_path / backend / "summary.json").read_text())
    real, sim = runs["local"], runs["fleet"]
    a, b = real["async_local_sgd"], sim["async_local_sgd"]
    assert a["period_per_peer"][3] == b["period_per_peer"][3] == 2  # floor(8 / 3), against peer 2 in its group
    for s in (a, b):
        assert s["arrivals"] == s["merges"] == sum(s["pushes_per_peer"]) and s["lost_steps"] == 0
        assert s["global_arrivals"] == sum(s["global_pushes_per_group"]) >= 2
    assert abs(real["test_accuracy"] - sim["test_accuracy"]) < 0.1


@pytest.mark.slow  # soak: 4 mpi processes through the app (about a minute on 2 busy cores); the default suite keeps the
# same protocol on the local backend (test_local_backend_threads_under_random_delays, test_local_backend_agrees...)
@pytest.mark.timeout(300)
def test_the_app_runs_two_groups_on_mpi_processes(tmp_path):
    from dpsgd.backends.launch import peer_env

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "experiments.train", "algorithm=async_local_sgd", "backend=mpi", "peers=4"]
    cmd += ["algorithm.groups=2", "algorithm.global_every=2", "algorithm.period=4", "epochs=2", "network=straggler"]
    cmd += ["network.compute_time=0.002", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=peer_env(), capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    a = s["async_local_sgd"]
    assert s["backend"] == "mpi" and math.isfinite(s["train_loss"]) and s["test_accuracy"] > 0.3
    assert s["consensus_distance"] < 1e-9  # every peer ends on the global model
    assert a["arrivals"] == sum(a["pushes_per_peer"]) and a["useful_steps"] == sum(a["steps_per_peer"])
    assert a["global_arrivals"] == sum(a["global_pushes_per_group"]) >= 2


def test_two_regions_over_a_slow_link_the_groups_finish_sooner_at_the_flat_runs_metric(tmp_path):
    """8 peers on 2 hosts of 4 (network.peers_per_host: 4), 50 ms between the hosts, nothing inside a host, 10 epochs
    on the event simulator: flat, each of host 1's workers pulls across the slow link and waits for it every round;
    with 2 groups only its leader's group pushes cross it. Measured 2026-12-06 (virtual time, so load-free): flat 0.931
    in 1.38 emulated s, groups 0.936 in 0.68 s (staleness 6.5 -> 2.8 local updates)."""
    results = {}
    for name, options in (("flat", {}), ("groups", {"groups": 2, "global_every": 2})):
        cfg = config(epochs=10, period=8, **options)
        cfg["network"].update(peers_per_host=4, latency_s=0.05, compute_time=0.01, mode="model")
        (tmp_path / name).mkdir()
        train_fleet(parse(cfg), tmp_path / name)
        results[name] = json.loads((tmp_path / name / "summary.json").read_text())
    flat, grouped = results["flat"], results["groups"]
    assert grouped["emulated_time_s"] < 0.6 * flat["emulated_time_s"]
    assert grouped["test_accuracy"] > flat["test_accuracy"] - 0.03 and grouped["test_accuracy"] > 0.85
    assert grouped["async_local_sgd"]["staleness_mean"] < flat["async_local_sgd"]["staleness_mean"]


def test_hierarchical_options_are_refused_in_one_line():
    w = torch.nn.Parameter(torch.zeros(3))
    cases = {
        "groups must be a whole divisor of the peers (8)": dict(groups=3),
        "global_every must be an integer >= 1": dict(groups=2, global_every=0),
        "needs global_lr > 0 and 0 <= global_momentum < 1": dict(groups=2, global_momentum=1.0),
        "global_dn_every must be an integer >= 1 or null": dict(groups=2, global_dn_every=0),
        "groups > 1 takes neither a quorum nor failures yet": dict(groups=2, quorum=2),
    }
    for words, options in cases.items():
        comm = SimulatedCommunicator(0, 8, lambda: 0.0, {})
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")) as caught:
            AsyncLocalSGD(torch.optim.SGD([w], lr=0.1), comm=comm, broadcast_initial=False, **options)
        assert "\n" not in str(caught.value)


def test_state_dict_holds_the_group_server_and_the_global_merger():
    def opt():
        w = torch.nn.Parameter(torch.arange(4.0))
        comm = SimulatedCommunicator(0, 4, lambda: 0.0, {})
        o = AsyncLocalSGD(torch.optim.SGD([w], lr=0.1), comm=comm, groups=2, global_every=1, broadcast_initial=False)
        o.set_budget(samples=1000, samples_per_step=4)
        o.start(threads=False)
        return o

    a = opt()
    assert a.group_server is not None and a.global_merger is not None
    a.merger.push(1, torch.full((4,), 0.5, dtype=a.live.dtype), samples=8, steps=2, now=0.0, pulled=0)
    up = a.upstream()
    assert up is not None and up[0] == 0
    a.complete_upstream(0, a.serve(up[1]))
    a.merger.push(1, torch.full((4,), 0.25, dtype=a.live.dtype), samples=8, steps=2, now=0.0, pulled=0)
    b = opt()
    b.load_state_dict(a.state_dict())
    assert b.group_server.pushes == 1 and b.global_merger.version == 1 and b.group_server.due()
    for left, right in ((b.merger.x, a.merger.x), (b.group_server.anchor, a.group_server.anchor)):
        torch.testing.assert_close(left, right, rtol=0, atol=0)
    torch.testing.assert_close(b.global_merger.x, a.global_merger.x, rtol=0, atol=0)
    leader = AsyncLocalSGD(
        torch.optim.SGD([torch.nn.Parameter(torch.arange(4.0))], lr=0.1),
        comm=SimulatedCommunicator(2, 4, lambda: 0.0, {}),
        groups=2,
        broadcast_initial=False,
    )
    with pytest.raises(
        ValueError,
        match=r"saved on a rank with other servers \(another rank, or other groups\) and cannot load on rank 2",
    ):
        leader.load_state_dict(a.state_dict())  # rank 0's (with the global merger) on group 1's leader


def test_the_apps_check_takes_groups_and_refuses_bad_values_in_one_line():
    """experiments.validate builds peer 0 before any starts (on the event simulator as the simulator builds it)."""
    from dpsgd.config import ConfigError
    from experiments.validate import validate

    validate(parse(config(groups=2, global_every=2)))
    validate(parse(config(backend="local", groups=2, global_every=2)))
    for backend, options, words in (
        ("local", {"groups": 2, "quorum": 2}, "groups > 1 takes neither a quorum nor failures yet"),
        ("fleet", {"groups": 3}, "groups must be a whole divisor of the peers (8)"),
    ):
        cfg = experiment(algorithm("async_local_sgd", **options), topology="complete", peers=8, backend=backend)
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")) as caught:
            validate(parse(cfg))
        assert "\n" not in str(caught.value)
