"""Network emulation: the emulated clock against the closed-form costs, sleep mode's real delays, and
stragglers under all-reduce and AD-PSGD."""

from __future__ import annotations

import json
import time

import pytest
import torch
from emulated import emulated_steps

import topologies
from dpsgd.comm import run_local
from dpsgd.comm.netem import ComputeSlowdown, Link, NetworkEmulator
from dpsgd.optim import ADPSGD, DPSGD, AllReduce

ALPHA, BETA = 1e-3, 1e7  # 1 ms per message, 10 MB/s
FLOOR = 0.02  # each step's compute on the emulated clock (model mode: the real compute does not enter)
STEPS = 6


def test_link_closed_forms():
    link = Link(ALPHA, BETA)
    assert link.message_time(1e6) == pytest.approx(ALPHA + 1e6 / BETA)
    assert link.message_time(1e6, count=2) == pytest.approx(ALPHA + 2e6 / BETA)
    assert link.allreduce_time(1e6, 8) == pytest.approx(14 * ALPHA + 2 * 7 / 8 * 1e6 / BETA)
    assert link.allreduce_time(1e6, 1) == 0.0
    assert Link().free and Link().message_time(1e9) == 0.0
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s"):
        Link(0.0, 0.0)
    with pytest.raises(ValueError, match="unknown network option"):
        NetworkEmulator.from_config({"bandwidth": 1e9})
    with pytest.raises(ValueError, match="mode"):
        NetworkEmulator.from_config({"mode": "fast"})


def _train(comm, algorithm, numel, network: dict, steps=STEPS, **options):
    """`steps` steps of `algorithm` on a quadratic with `numel` parameters under `network`;
    returns (emulated elapsed per step on this peer, comm stats)."""
    make = lambda base, c: algorithm(base, comm=c, **options)  # noqa: E731
    elapsed, waited = emulated_steps(comm, make, numel, {"compute_time": FLOOR, **network}, steps)
    return elapsed / steps, waited


@pytest.mark.parametrize("n", [4, 8])
def test_allreduce_step_equals_closed_form(n):
    numel = 25_000  # 100 kB of float32
    per_step = run_local(n, _train, AllReduce, numel, {"latency_s": ALPHA, "bandwidth_bytes_per_s": BETA})
    want = FLOOR + Link(ALPHA, BETA).allreduce_time(4 * numel, n)
    for got, _ in per_step:
        assert got == pytest.approx(want, rel=1e-9)


def test_one_peer_dpsgd_step_equals_closed_form():
    n, numel = 8, 25_000
    topo = topologies.make("one_peer_exponential", n)
    per_step = run_local(n, _train, DPSGD, numel, {"latency_s": ALPHA, "bandwidth_bytes_per_s": BETA}, topology=topo)
    want = FLOOR + ALPHA + 4 * numel / BETA  # one message each way, full duplex
    for got, _ in per_step:
        assert got == pytest.approx(want, rel=1e-9)


def test_ring_sends_two_messages_per_step():
    n, numel = 4, 25_000
    per_step = run_local(
        n,
        _train,
        DPSGD,
        numel,
        {"latency_s": ALPHA, "bandwidth_bytes_per_s": BETA},
        topology=topologies.make("ring", n),
    )
    want = FLOOR + Link(ALPHA, BETA).message_time(4 * numel, count=2)
    assert [round(t, 12) for t, _ in per_step] == [round(want, 12)] * n


def test_overlap_hides_communication_behind_compute():
    """DPSGD's overlap starts the exchange before the backward pass: with compute (20 ms) longer than
    the message (1 ms + 10 ms), the step costs the compute alone and nobody waits."""
    n, numel = 4, 25_000
    topo = topologies.make("one_peer_exponential", n)
    network = {"latency_s": ALPHA, "bandwidth_bytes_per_s": BETA}
    hidden = run_local(n, _train, DPSGD, numel, network, topology=topo, overlap=True)
    exposed = run_local(n, _train, DPSGD, numel, network, topology=topo)
    for (t_on, wait_on), (t_off, wait_off) in zip(hidden, exposed):
        assert t_on == pytest.approx(FLOOR, rel=1e-9) and wait_on == 0.0
        assert t_off == pytest.approx(FLOOR + ALPHA + 4 * numel / BETA, rel=1e-9)
        assert wait_off == pytest.approx(STEPS * (ALPHA + 4 * numel / BETA), rel=1e-9)


def test_straggler_paces_every_peer_under_allreduce():
    per_step = run_local(4, _train, AllReduce, 1000, {"slow_peers": [2], "compute_scale": 4.0})
    for got, _ in per_step:  # free links: every step waits for the 4x slower peer
        assert got == pytest.approx(4 * FLOOR, rel=1e-9)


def test_straggler_slows_only_itself_under_adpsgd_in_model_mode():
    def peer(comm):
        net = NetworkEmulator.from_config(
            {"compute_time": FLOOR, "slow_peers": [1], "compute_scale": 4.0, "latency_s": ALPHA}, comm.rank, comm.size
        )
        comm.attach_network(net)
        w = torch.nn.Parameter(torch.zeros(8))
        opt = ADPSGD(torch.optim.SGD([w], lr=0.1), comm=comm, topology=topologies.make("ring", comm.size))
        opt.set_budget(steps=10)
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

    elapsed = run_local(4, peer)
    # the straggler's own compute; the others': each averaging (2 ms) hides behind the next gradient
    # (20 ms), and an active peer's run ends when its last averaging does
    assert 10 * 4 * FLOOR - 1e-9 <= elapsed[1] <= 10 * 4 * FLOOR + 2 * ALPHA + 1e-9, elapsed
    for r in (0, 2, 3):
        assert 10 * FLOOR - 1e-9 <= elapsed[r] <= 10 * FLOOR + 2 * ALPHA + 1e-9, elapsed


def test_jitter_is_seeded_and_bounded():
    a = NetworkEmulator.from_config({"jitter_s": 0.002}, rank=1, seed=3)
    b = NetworkEmulator.from_config({"jitter_s": 0.002}, rank=1, seed=3)
    draws = [a.jitter() for _ in range(100)]
    assert draws == [b.jitter() for _ in range(100)]
    assert all(0 <= d < 0.002 for d in draws) and len(set(draws)) == 100


def test_sleep_mode_really_waits():
    """In sleep mode a 60 ms message really takes 60 ms of wall time; in model mode it costs nothing."""

    def peer(comm, mode):
        net = NetworkEmulator.from_config({"mode": mode, "latency_s": 0.06}, comm.rank, comm.size)
        comm.attach_network(net)
        x = torch.ones(10)
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(3):
            comm.exchange([x], 1 - comm.rank)
        return (time.perf_counter() - t0) / 3, net.clock.elapsed()

    slept = run_local(2, peer, "sleep")
    modelled = run_local(2, peer, "model")
    for wall, _ in slept:
        assert 0.06 <= wall < 0.12, slept
    for wall, emulated in modelled:
        assert wall < 0.03 and emulated == pytest.approx(0.18), modelled


def test_compute_floor_in_model_mode_does_not_sleep():
    s = ComputeSlowdown(0, slow_peers=(0,), compute_scale=3.0, compute_time=0.05)
    t0 = time.perf_counter()
    s.start()
    assert s.finish(sleep=False) == pytest.approx(0.15)
    assert time.perf_counter() - t0 < 0.02


def test_uncounted_traffic_costs_nothing():
    def peer(comm):
        net = NetworkEmulator.from_config({"latency_s": 1.0}, comm.rank, comm.size)
        comm.attach_network(net)
        with comm.uncounted():
            comm.allreduce_mean([torch.ones(3)])
        return net.clock.elapsed()

    assert run_local(2, peer) == [0.0, 0.0]


def test_sleep_mode_straggler_paces_every_peer_under_allreduce():
    """The same straggler, for real: with sleep mode every all-reduce step waits out the slow peer's 40 ms."""

    def peer(comm):
        net = NetworkEmulator.from_config(
            {"mode": "sleep", "compute_time": 0.01, "slow_peers": [2], "compute_scale": 4.0}, comm.rank, comm.size
        )
        comm.attach_network(net)
        w = torch.nn.Parameter(torch.zeros(8))
        opt = AllReduce(torch.optim.SGD([w], lr=0.1), comm=comm)
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(5):
            net.start_compute()
            opt.zero_grad()
            w.pow(2).sum().backward()
            net.finish_compute()
            opt.step()
        return time.perf_counter() - t0

    for wall in run_local(4, peer):
        assert 5 * 0.04 <= wall < 5 * 0.04 + 0.3


@pytest.mark.slow  # make soak: tests/test_bench.py's step_time_vs_network checks the clock on real mpi ranks
@pytest.mark.timeout(180)
def test_emulated_step_time_of_real_mpi_peers(app, tmp_path):
    """Real processes: 4 mpi peers of one-peer D-PSGD and of all-reduce under ethernet_1g report the
    closed-form emulated step time (a given compute_time is each step's compute in model mode)."""
    link = Link(1e-4, 1.25e8)
    params = 64 * 64 + 64 + 64 * 10 + 10  # the default MLP on digits
    for algorithm, topology, comm_s in (
        ("dpsgd", "one_peer_exponential", link.message_time(4 * params)),
        ("allreduce", "ring", link.allreduce_time(4 * params, 4)),
    ):
        run_dir = tmp_path / algorithm
        args = [
            f"algorithm={algorithm}",
            f"topology={topology}",
            "network=ethernet_1g",
            "network.compute_time=0.002",
            "epochs=2",
            "peers=4",
            "backend=mpi",
        ]
        proc = app(args, run_dir, timeout=150)
        assert proc.returncode == 0, proc.stderr[-2000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["emulated_s_per_step"] == pytest.approx(0.002 + comm_s, rel=1e-6)
        assert summary["emulated_time_s"] == pytest.approx(summary["steps"] * (0.002 + comm_s), rel=1e-6)
