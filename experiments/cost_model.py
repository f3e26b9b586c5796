"""The emulator's cost model as closed forms over a run: the emulated clock after S steps of an algorithm, for n peers
on hosts of `peers_per_host` (dpsgd.comm.netem's `Link` and `Hosts`), each peer computing for its own time a step (a
straggler: one peer slower). What the emulator's clock does, step by step, without running a model:

- all-reduce (of gradients, after the backward pass): every step ends at the slowest peer's compute plus the
  all-reduce (`Hosts.allreduce_time`: a ring, or halving and doubling), max_i c_i + AR(M);
- LocalSGD and DiLoCo with period H: local steps, and an all-reduce of the model (DiLoCo: of the outer delta, as
  large) at every H-th step, which starts when the slowest peer gets there; with the outer step delayed a round
  (`delayed`: DiLoCo's outer_delay=1) the all-reduce runs behind the next round's H steps, so after the first round
  each round takes max(H max_i c_i, AR(M)) and the last exchange is still in flight;
- gossip (D-PSGD without overlap) on a topology: the max-plus recurrence of the emulator's messages,
  T_i(t+1) = max over j in {i} and i's in-neighbours at t of T_j(t) + c_j + s_j(t), s_j(t) the time until peer j's
  messages of step t have arrived (`Hosts.send_time`: its host's link shared by every message leaving the host);
- AD-PSGD: each peer averages with a neighbour (a request and a reply, 2 (alpha + M / beta) as the emulator charges
  an averaging) behind its next gradient, max(c_i, 2 m) a step; a global step (every peer's updates / n) at the rate
  n / sum_i 1 / max(c_i, 2 m).

Which of these forms prices an algorithm is the algorithm's own declaration (its class's `cost_form`, one of KINDS).
`tests/test_map.py` checks these against the emulator's clock of real (threaded) peers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

import topologies
from dpsgd.comm.netem import Hosts, Link

KINDS = ("allreduce", "periodic", "gossip", "async", "pairwise")  # the forms above


@dataclass(frozen=True)
class Algorithm:
    """One algorithm of the map: its label, the overrides that run it, and how its steps communicate."""

    label: str
    overrides: tuple[str, ...]
    kind: str  # allreduce, periodic, gossip, async, pairwise
    period: int = 1  # periodic: steps between all-reduces; pairwise: between group exchanges
    topology: str | None = None  # gossip: the graph
    delayed: bool = False  # periodic: the all-reduce runs behind the next round (DiLoCo's outer_delay=1)


@dataclass(frozen=True)
class Network:
    """One cell of the grid: the link between hosts, peers per host, the intra-host link, a straggler's slowdown."""

    latency_s: float
    bandwidth_bytes_per_s: float | None
    peers_per_host: int = 1
    slowdown: float = 1.0  # peer STRAGGLER computes this many times slower
    intra_latency_s: float = 2e-6
    intra_bandwidth_bytes_per_s: float | None = 1e10
    allreduce: str = "ring"  # the all-reduce's algorithm (dpsgd.comm.netem's `allreduce`)

    @property
    def link(self) -> Link:
        return Link(self.latency_s, self.bandwidth_bytes_per_s)

    @property
    def hosts(self) -> Hosts:
        return Hosts(self.peers_per_host, Link(self.intra_latency_s, self.intra_bandwidth_bytes_per_s), self.allreduce)

    def config(self, compute_s: float, n: int) -> dict:
        """The `network` config that emulates this cell (model mode; `compute_s` each step's compute)."""
        slow = self.slowdown != 1.0 and n > STRAGGLER
        return {
            "name": "map_cell",
            "mode": "model",
            "latency_s": self.latency_s,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "peers_per_host": self.peers_per_host,
            "intra_latency_s": self.intra_latency_s,
            "intra_bandwidth_bytes_per_s": self.intra_bandwidth_bytes_per_s,
            "allreduce": self.allreduce,
            "slow_peers": [STRAGGLER] if slow else [],
            "compute_scale": self.slowdown if slow else 1.0,
            "compute_time": compute_s,
            "jitter_s": 0.0,
        }


STRAGGLER = 1  # the slow peer's rank (conf/network/straggler.yaml's)


def computes(n: int, compute_s: float, net: Network) -> np.ndarray:
    c = np.full(n, float(compute_s))
    if n > STRAGGLER:
        c[STRAGGLER] *= net.slowdown
    return c


def _pattern(topo: topologies.Topology, t: int, host: np.ndarray):
    """At step t of `topo`: each peer's messages inside its host, its host's messages to other hosts (0 where the
    peer sends none across), and its in-neighbours (padded with itself)."""
    n = topo.n
    sends = [sorted(topo.neighbors(j, t).send) for j in range(n)]
    crossing = np.array([sum(1 for d in s if host[d] != host[j]) for j, s in enumerate(sends)])
    per_host = np.bincount(host, weights=crossing, minlength=host.max() + 1)
    lists = [sorted(topo.neighbors(i, t).recv) for i in range(n)]
    width = max(1, max(len(r) for r in lists))
    recv = np.array([r + [i] * (width - len(r)) for i, r in enumerate(lists)])
    return np.array([len(s) for s in sends]) - crossing, np.where(crossing > 0, per_host[host], 0), recv


@lru_cache(maxsize=256)
def _gossip_pattern(topology: str, n: int, peers_per_host: int, steps: int):
    """`_pattern` of the graph `topology` at each of its steps (one period of a periodic schedule)."""
    topo = topologies.make(topology, n)
    host = np.arange(n) // peers_per_host
    patterns = [_pattern(topo, t, host) for t in range(steps if topo.period is None else min(steps, topo.period))]
    return [p[0] for p in patterns], [p[1] for p in patterns], [p[2] for p in patterns]


def _mix(clock: np.ndarray, pattern, link: Link, intra: Link, nbytes: float) -> np.ndarray:
    """The clocks after one mix of `nbytes` a message: each peer's messages leave when it is ready, and it
    waits for its in-neighbours' (the emulator's message stamps)."""
    inside, across, recv = pattern
    ready = clock + np.maximum(_messages(intra, inside, nbytes), _messages(link, across, nbytes))
    return np.maximum(ready, ready[recv].max(axis=1))


def _messages(link: Link, count: np.ndarray, nbytes: float) -> np.ndarray:
    """`Link.message_time` of `count` messages back to back, elementwise (0 for none)."""
    beta = link.bandwidth_bytes_per_s
    time = link.latency_s + (0.0 if beta is None else count * nbytes / beta)
    return np.where(count > 0, time, 0.0)


def clock_after(algorithm: Algorithm, steps: int, n: int, nbytes: float, compute_s: float, net: Network) -> float:
    """The emulated clock (its latest peer) after `steps` steps of `algorithm`: the time to those steps."""
    c = computes(n, compute_s, net)
    link, hosts = net.link, net.hosts
    if n == 1 or steps == 0:
        return float(steps * c.max())
    if algorithm.kind == "allreduce":
        return steps * (float(c.max()) + hosts.allreduce_time(link, nbytes, n))
    if algorithm.kind == "periodic":
        syncs = steps // algorithm.period
        rest = steps - syncs * algorithm.period
        round_s, exchange_s = algorithm.period * float(c.max()), hosts.allreduce_time(link, nbytes, n)
        if algorithm.delayed and syncs:  # round k + 1 waits for round k's exchange only where it outlasts the compute
            return round_s + (syncs - 1) * max(round_s, exchange_s) + rest * float(c.max())
        return syncs * (round_s + exchange_s) + rest * float(c.max())
    if algorithm.kind == "async":
        averaging = 2 * link.message_time(nbytes)
        return steps * n / float(np.sum(1.0 / np.maximum(c, averaging)))
    if algorithm.kind == "gossip":
        assert algorithm.topology is not None
        inside, across, recv = _gossip_pattern(algorithm.topology, n, hosts.peers_per_host, steps)
        clock = np.zeros(n)
        for t in range(steps):
            k = t % len(inside)
            clock = _mix(clock + c, (inside[k], across[k], recv[k]), link, hosts.intra, nbytes)
        return float(clock.max())
    if algorithm.kind == "pairwise":  # NoLoCo: local steps; every `period` one exchange of two models in its groups
        from dpsgd.optim import NoLoCo

        pairing, host = NoLoCo.pairing(n, 2), np.arange(n) // hosts.peers_per_host
        clock = np.zeros(n)
        for t in range(1, steps + 1):
            clock = clock + c
            if t % algorithm.period == 0:  # [x - phi, phi] in one message to each partner of the step's groups
                clock = _mix(clock, _pattern(pairing, t, host), link, hosts.intra, 2 * nbytes)
        return float(clock.max())
    raise ValueError(f"unknown algorithm kind {algorithm.kind!r}; expected one of {', '.join(KINDS)}")
