"""The host-aware cost model (`network.peers_per_host`): peers of one host talk over a fast intra-host
link and share the host's one link to other hosts. The emulator's clock of real (threaded) peers against
closed forms written here from the link arithmetic alone, on 2 hosts x 2 peers."""

from __future__ import annotations

import numpy as np
import pytest
from emulated import emulated_steps

import topologies
from dpsgd.comm import run_local
from dpsgd.comm.netem import Hosts, Link, NetworkEmulator
from dpsgd.optim import DPSGD, AllReduce, LocalSGD

ALPHA, BETA = 1e-3, 1e7  # between hosts: 1 ms per message, 10 MB/s
INTRA_ALPHA, INTRA_BETA = 1e-5, 1e9  # inside a host
FLOOR = 0.02
NUMEL = 25_000  # 100 kB of float32
M = 4 * NUMEL
HOSTS = {
    "latency_s": ALPHA,
    "bandwidth_bytes_per_s": BETA,
    "peers_per_host": 2,
    "intra_latency_s": INTRA_ALPHA,
    "intra_bandwidth_bytes_per_s": INTRA_BETA,
}


def _clock(comm, algorithm, network: dict, steps: int, **options) -> float:
    """`steps` steps of `algorithm` on a quadratic under `network`; this peer's emulated seconds per step."""
    make = lambda base, c: algorithm(base, comm=c, **options)  # noqa: E731
    return emulated_steps(comm, make, NUMEL, {"compute_time": FLOOR, **network}, steps)[0] / steps


def _ring_allreduce(n: int, alpha: float, beta: float) -> float:
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * M / beta


def test_allreduce_on_two_hosts_costs_what_the_ring_puts_on_each_host_link():
    # the ring 0-1-2-3-0 leaves each host once: one hop of M/n a round on each host's link
    want = FLOOR + _ring_allreduce(4, ALPHA, BETA)
    assert run_local(4, _clock, AllReduce, HOSTS, 4) == pytest.approx([want] * 4, rel=1e-9)
    # all four on one host: every hop inside it
    one_host = {**HOSTS, "peers_per_host": 4}
    want = FLOOR + _ring_allreduce(4, INTRA_ALPHA, INTRA_BETA)
    assert run_local(4, _clock, AllReduce, one_host, 4) == pytest.approx([want] * 4, rel=1e-9)


def test_halving_doubling_keeps_the_halves_inside_the_hosts():
    """network.allreduce=halving_doubling on 2 x 2: the reduce-scatter exchanges M/2 with rank XOR 1 (inside the
    host), then M/4 with rank XOR 2 (across: both of a host's peers, M/2 on its link); the all-gather the same
    rounds backwards. One model a step on each host link where the ring puts 1.5 (MPICH's all-reduce between
    test hosts carried 0.668 of the ring's bytes: docs/results/network.md)."""
    network = {**HOSTS, "allreduce": "halving_doubling"}
    rounds = (INTRA_ALPHA + M / 2 / INTRA_BETA) + (ALPHA + 2 * (M / 4) / BETA)
    assert run_local(4, _clock, AllReduce, network, 4) == pytest.approx([FLOOR + 2 * rounds] * 4, rel=1e-9)
    # one peer a host: 2 log2(n) latencies and the ring's bytes, M (1 - 1/n) each way
    hosts, link = Hosts(1, allreduce="halving_doubling"), Link(ALPHA, BETA)
    assert hosts.allreduce_time(link, M, 8) == pytest.approx(2 * 3 * ALPHA + 2 * 7 / 8 * M / BETA, rel=1e-12)
    # 3 peers a host on 8 (hosts 0-2, 3-5, 6-7), the most peers of one host pairing across, by hand:
    # XOR 1: only 2-3 crosses (1 of a host); XOR 2: host 1's 3-1, 4-6, 5-7 all cross (3); XOR 4: 0-4, 1-5, 2-6 (3)
    hosts = Hosts(3, Link(INTRA_ALPHA, INTRA_BETA), "halving_doubling")
    across = [1, 3, 3]
    want = 2 * sum(
        max(INTRA_ALPHA + M / 2 ** (k + 1) / INTRA_BETA, ALPHA + a * M / 2 ** (k + 1) / BETA)
        for k, a in enumerate(across)
    )
    assert hosts.allreduce_time(link, M, 8) == pytest.approx(want, rel=1e-12)


def _halving_doubling_by_messages(n: int, p: int, link: Link, intra: Link, nbytes: float) -> float:
    """Rabenseifner's all-reduce written out message by message: reduce-scatter round k, every rank r sends
    M / 2^(k+1) to r XOR 2^k; a message inside a host takes the intra link, one across leaves with the other
    messages its host sends across in that round (alpha + L chunk / beta); a round lasts its slowest message;
    the all-gather repeats the rounds backwards."""
    rounds, k = [], 0
    while 2**k < n:
        chunk = nbytes / 2 ** (k + 1)
        pairs = [(r, r ^ 2**k) for r in range(n)]
        leaving: dict[int, int] = {}
        for r, partner in pairs:
            if r // p != partner // p:
                leaving[r // p] = leaving.get(r // p, 0) + 1
        rounds.append(
            max(
                intra.latency_s + intra.transfer_time(chunk)
                if r // p == partner // p
                else link.latency_s + link.transfer_time(leaving[r // p] * chunk)
                for r, partner in pairs
            )
        )
        k += 1
    return sum(rounds) + sum(reversed(rounds))


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_halving_doubling_against_its_messages(p):
    """`Hosts.allreduce_time` against the all-reduce's messages counted one by one, for 2-64 peers, hosts of
    p (3: the last host short), a slow and a free intra-host link."""
    link = Link(ALPHA, BETA)
    for intra in (Link(INTRA_ALPHA, INTRA_BETA), Link(0.0, None), Link(5e-3, 1e6)):
        hosts = Hosts(p, intra, "halving_doubling")
        for n in (2, 4, 8, 16, 32, 64):
            want = _halving_doubling_by_messages(n, p, link, intra, M)
            assert hosts.allreduce_time(link, M, n) == pytest.approx(want, rel=1e-12), (n, intra)


def test_halving_doubling_needs_a_power_of_two_and_a_known_name():
    with pytest.raises(
        ValueError, match="power-of-two number of peers, got 6; use network.allreduce=ring, or peers=4 or peers=8"
    ):
        NetworkEmulator.from_config({"allreduce": "halving_doubling"}, size=6)
    with pytest.raises(ValueError, match="network.allreduce must be one of ring, halving_doubling, got 'tree'"):
        NetworkEmulator.from_config({"allreduce": "tree"})
    assert NetworkEmulator.from_config({"allreduce": "halving_doubling"}, size=8).hosts.allreduce == "halving_doubling"


def test_one_peer_gossip_shares_the_host_link():
    """One-peer exponential on 4 peers alternates offsets 1 and 2. Offset 1: one peer of each host sends
    across (host link: 1 model), the other inside; offset 2: both send across (2 models on the link). Every
    peer waits for a message from the other host, so each step takes the host link's time: on average
    alpha + 1.5 M / beta, where a link per peer would give alpha + M / beta."""
    topo = topologies.make("one_peer_exponential", 4)
    steps = 6
    across = np.array([1 if s % 2 == 0 else 2 for s in range(steps)])  # messages on a host's link at step s
    offsets = [(sorted(topo.neighbors(0, s).send)[0] - 0) % 4 for s in range(steps)]
    assert offsets == [3, 2] * 3  # the schedule assumed above: offset 1 (to rank - 1), then 2
    want = FLOOR + np.mean(ALPHA + across * M / BETA)
    got = run_local(4, _clock, DPSGD, HOSTS, steps, topology=topo)
    assert got == pytest.approx([want] * 4, rel=1e-9)
    flat = {k: v for k, v in HOSTS.items() if not k.startswith(("peers", "intra"))}
    assert run_local(4, _clock, DPSGD, flat, steps, topology=topo) == pytest.approx(
        [FLOOR + ALPHA + M / BETA] * 4, rel=1e-9
    )


def test_local_sgd_pays_one_all_reduce_a_period():
    period, steps = 3, 6
    want = FLOOR + _ring_allreduce(4, ALPHA, BETA) / period
    assert run_local(4, _clock, LocalSGD, HOSTS, steps, period=period) == pytest.approx([want] * 4, rel=1e-9)


def test_ring_gossip_on_two_hosts_sends_one_model_across_each_way():
    """Ring on 2 x 2: each peer sends to both neighbours, one inside its host and one across; each host
    sends 2 messages across (ranks 1 -> 2 and 0 -> 3 from host 0)."""
    topo = topologies.make("ring", 4)
    want = FLOOR + max(ALPHA + 2 * M / BETA, INTRA_ALPHA + M / INTRA_BETA)
    assert run_local(4, _clock, DPSGD, HOSTS, 4, topology=topo) == pytest.approx([want] * 4, rel=1e-9)


def test_hosts_send_time_counts_the_whole_hosts_messages():
    hosts, link = Hosts(2, Link(INTRA_ALPHA, INTRA_BETA)), Link(ALPHA, BETA)
    sends = {0: [1], 1: [2], 2: [3], 3: [0]}.__getitem__  # offset 1 on 2 x 2
    assert hosts.send_time(link, 0, 4, M, sends) == pytest.approx(INTRA_ALPHA + M / INTRA_BETA)
    assert hosts.send_time(link, 1, 4, M, sends) == pytest.approx(ALPHA + M / BETA)
    across = {0: [2], 1: [3], 2: [0], 3: [1]}.__getitem__
    assert hosts.send_time(link, 0, 4, M, across) == pytest.approx(ALPHA + 2 * M / BETA)
    assert Hosts(1).send_time(link, 0, 4, M, across) == pytest.approx(link.message_time(M))
    assert Hosts(1).allreduce_time(link, M, 8) == pytest.approx(link.allreduce_time(M, 8))


def test_peers_per_host_must_be_a_whole_number():
    with pytest.raises(ValueError, match="peers_per_host"):
        NetworkEmulator.from_config({"peers_per_host": 0})
    with pytest.raises(ValueError, match="peers_per_host"):
        NetworkEmulator.from_config({"peers_per_host": 1.5})
    assert NetworkEmulator.from_config({"peers_per_host": 2.0}).hosts.peers_per_host == 2


def test_a_paused_clock_leaves_evaluation_off_the_sleep_mode_clock():
    import time

    from dpsgd.comm.netem import EmulatedClock

    clock = EmulatedClock("sleep")
    with clock.paused():
        time.sleep(0.05)
    assert clock.elapsed() < 0.02
    time.sleep(0.03)
    assert clock.elapsed() >= 0.03
    model = EmulatedClock("model")
    with model.paused():
        model.advance(1.0)  # model mode: only what is added counts, paused or not
    assert model.elapsed() == 1.0


def test_a_sleep_clock_behind_the_latest_catches_up_after_an_evaluation():
    """The evaluation's collectives are a barrier: a sleep-mode clock behind the latest peer's (its elapsed time
    on entering) moves up to it, never back; a model-mode clock keeps its own time."""
    from dpsgd.comm.netem import EmulatedClock

    clock = EmulatedClock("sleep")
    clock.reset(2.0)
    clock.catch_up(5.0)
    assert 5.0 <= clock.elapsed() < 5.02
    clock.catch_up(1.0)
    assert clock.elapsed() >= 5.0
    model = EmulatedClock("model")
    model.advance(1.0)
    model.catch_up(5.0)
    assert model.elapsed() == 1.0
