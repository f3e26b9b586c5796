"""Network and straggler emulation, applied inside a communicator: per-link latency and bandwidth,
jitter, per-peer compute slowdown, and an emulated clock per peer.

Configured by the `network` config group (`network=ethernet_1g`, ...):
- `latency_s` (alpha) and `bandwidth_bytes_per_s` (beta; 0 or null: unlimited): one message of M bytes
  costs alpha + M / beta; a peer sending k messages in one operation serialises them on its link,
  alpha + k M / beta; a ring all-reduce of M bytes among n peers costs 2 (n-1) alpha + 2 (n-1)/n M / beta.
- `peers_per_host` (default 1): ranks [k p, (k + 1) p) share host k (as `launcher.hosts` places them).
  Messages inside a host take the intra-host link (`intra_latency_s`, `intra_bandwidth_bytes_per_s`:
  shared memory, fast); messages between hosts leave through the host's one link, which every message
  its peers send between hosts in the same operation shares: a peer whose host sends L of them in
  all waits alpha + L M / beta for its own (see `Hosts`). With one peer per host this is the per-peer
  link above.
- `allreduce` (default `ring`): the all-reduce's algorithm. `ring`: 2 (n-1) rounds of M / n to the next
  rank (gloo's, NCCL's ring). `halving_doubling` (n a power of two): a reduce-scatter by recursive halving,
  round k exchanging M / 2^(k+1) with the rank 2^k away (rank XOR 2^k), then an all-gather by recursive
  doubling, the same rounds backwards (Rabenseifner's; MPICH's above its short-message size): 2 log2(n)
  latencies instead of 2 (n-1), the same bytes a peer, and with hosts the larger halves stay inside them.
- `jitter_s`: each message takes an extra uniform [0, jitter_s) seconds (seeded per peer).
- `slow_peers`, `compute_scale`, `compute_time`: the compute slowdown (stragglers) and the per-step
  compute time. In `sleep` mode `compute_time` is a floor: a peer's step takes max(real compute,
  compute_time) x its slowdown, really. In `model` mode a given `compute_time` is the step's compute time
  on the emulated clock (x slowdown), so the contention of many peers for a few cores does not enter the
  figures; with `compute_time: 0` it takes `calibrated_s`, the workload's compute measured once (dpsgd.calibration
  fills it in, `compute: calibrated`), or else each step's real compute time (`compute: measured`).
- `mode`: `model` adds every cost to the peer's emulated clock only (runs stay fast: nothing is slept);
  `sleep` really waits (the clock is the real one), so overlap and asynchrony are exercised for real.

The clock is honest about waiting: each message carries the sender's time at which it arrives, and an
operation completes at the latest arrival it needs, so a peer that starts late delays its neighbours
(and, through an all-reduce, everyone), and communication started before computation (D-PSGD's
overlap) is hidden behind it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from dpsgd.seeds import link_jitter_seed

NETWORK_KEYS = tuple(
    "name mode latency_s bandwidth_bytes_per_s jitter_s slow_peers compute_scale compute_time peers_per_host "
    "intra_latency_s intra_bandwidth_bytes_per_s allreduce compute calibrated_s".split()
)
MODES = ("model", "sleep")
ALLREDUCES = ("ring", "halving_doubling")


def ring_allreduce_bytes(nbytes: float, n: int) -> float:
    """What each peer sends (and receives) in a bandwidth-optimal ring all-reduce of `nbytes`:
    2 (n - 1) / n of it. Traffic counts and the network emulator's cost model both use it."""
    return 2 * (n - 1) / n * nbytes


@dataclass(frozen=True)
class Link:
    """The cost model of one link: latency alpha (seconds) and bandwidth beta (bytes/s; None: unlimited)."""

    latency_s: float = 0.0
    bandwidth_bytes_per_s: float | None = None

    def __post_init__(self):
        if not self.latency_s >= 0:
            raise ValueError(f"network.latency_s must be >= 0 seconds, got {self.latency_s}")
        if self.bandwidth_bytes_per_s is not None and not self.bandwidth_bytes_per_s > 0:
            raise ValueError(
                f"network.bandwidth_bytes_per_s must be > 0 bytes/s (or null for unlimited), "
                f"got {self.bandwidth_bytes_per_s}"
            )

    @property
    def free(self) -> bool:
        return self.latency_s == 0 and self.bandwidth_bytes_per_s is None

    def transfer_time(self, nbytes: float) -> float:
        return 0.0 if self.bandwidth_bytes_per_s is None else nbytes / self.bandwidth_bytes_per_s

    def message_time(self, nbytes: float, count: int = 1) -> float:
        """`count` messages of `nbytes` sent back to back from one peer: alpha + count M / beta."""
        return 0.0 if count <= 0 else self.latency_s + self.transfer_time(count * nbytes)

    def allreduce_time(self, nbytes: float, n: int) -> float:
        """A bandwidth-optimal ring all-reduce: 2 (n-1) alpha + 2 (n-1)/n M / beta."""
        return 0.0 if n <= 1 else 2 * (n - 1) * self.latency_s + self.transfer_time(ring_allreduce_bytes(nbytes, n))


def circulant_senders(rank: int, send_to: Sequence[int], n: int) -> Callable[[int], list[int]]:
    """Every peer's destinations in an operation where `rank` sends to `send_to`, assuming every peer sends
    to the same offsets (exact for a ring, the exponential graphs and a ring all-reduce's hops)."""
    offsets = [(d - rank) % n for d in send_to]
    return lambda j: [(j + o) % n for o in offsets]


@dataclass(frozen=True)
class Hosts:
    """Peers grouped into hosts of `peers_per_host` consecutive ranks. A message between two peers of one
    host takes the `intra` link; the messages a host's peers send to other hosts in one operation leave
    through the host's one link, back to back, so each waits for all of them (a fair share of the link
    ends every equal message at about the same time)."""

    peers_per_host: int = 1
    intra: Link = field(default_factory=Link)
    allreduce: str = "ring"  # the all-reduce's algorithm (the module's text)

    def __post_init__(self):
        if not (isinstance(self.peers_per_host, int) and self.peers_per_host >= 1):
            raise ValueError(f"network.peers_per_host must be an integer >= 1, got {self.peers_per_host!r}")
        if self.allreduce not in ALLREDUCES:
            raise ValueError(f"network.allreduce must be one of {', '.join(ALLREDUCES)}, got {self.allreduce!r}")

    def check_size(self, n: int) -> None:
        """Refuse a world this all-reduce cannot run on."""
        if self.allreduce == "halving_doubling" and n & (n - 1):
            below = 1 << (n.bit_length() - 1)
            raise ValueError(
                f"network.allreduce=halving_doubling needs a power-of-two number of peers, got {n}; "
                f"use network.allreduce=ring, or peers={below} or peers={2 * below}"
            )

    def host(self, rank: int) -> int:
        return rank // self.peers_per_host

    def mates(self, rank: int, n: int) -> range:
        """The ranks on `rank`'s host (itself included) in a world of `n`."""
        first = self.host(rank) * self.peers_per_host
        return range(first, min(first + self.peers_per_host, n))

    def send_time(self, link: Link, rank: int, n: int, nbytes: float, senders: Callable[[int], Sequence[int]]) -> float:
        """How long after an operation starts every message `rank` sends in it (`senders(rank)`, `nbytes`
        each) has arrived, every peer of its host sending its own (`senders(j)`) from the same time: its
        messages inside the host back to back on the intra-host link, alpha' + k M / beta'; its messages
        to other hosts alpha + L M / beta, L the messages its whole host sends to other hosts."""
        mine = list(senders(rank))
        home = self.host(rank)
        inside = sum(1 for d in mine if self.host(d) == home)
        out = self.intra.message_time(nbytes, inside)
        if inside < len(mine):
            shared = sum(1 for j in self.mates(rank, n) for d in senders(j) if self.host(d) != home)
            out = max(out, link.message_time(nbytes, shared))
        return out

    def allreduce_time(self, link: Link, nbytes: float, n: int) -> float:
        """The all-reduce of `nbytes` among n peers, each round as long as its slowest exchange.

        ring: 2 (n - 1) rounds of M / n from each peer to the next. The ring over the ranks in order leaves
        each host once, so a host's link carries one hop a round, as a peer's own link would:
        2 (n - 1) (alpha + M / (n beta)) once the ring crosses hosts, alpha' and beta' while it does not.
        halving_doubling: twice (reduce-scatter, all-gather) the rounds k = 0 .. log2(n) - 1 of chunks
        M / 2^(k+1) between ranks 2^k apart; a round's pairs inside a host take alpha' + chunk / beta', those
        across leave through their host's link together, alpha + L chunk / beta with L the most peers of
        one host pairing across."""
        if n <= 1:
            return 0.0
        if self.allreduce == "halving_doubling":
            self.check_size(n)
            total = 0.0
            for k, (inside, across) in enumerate(_halving_rounds(n, self.peers_per_host)):
                chunk = nbytes / 2 ** (k + 1)
                inner = self.intra.message_time(chunk) if inside else 0.0
                total += max(inner, link.message_time(chunk, across))
            return 2 * total
        hops = ([link] if n > self.peers_per_host else []) + ([self.intra] if self.peers_per_host > 1 else [])
        return 2 * (n - 1) * max(hop.message_time(nbytes / n) for hop in hops)


@functools.lru_cache(maxsize=64)
def _halving_rounds(n: int, peers_per_host: int) -> tuple[tuple[bool, int], ...]:
    """Per round k of recursive halving among n peers on hosts of `peers_per_host` consecutive ranks: whether
    some pair is inside a host, and the most peers of one host whose partner (rank XOR 2^k) is on another."""
    ranks = np.arange(n)
    host = ranks // peers_per_host
    rounds, distance = [], 1
    while distance < n:
        crosses = host[ranks ^ distance] != host
        across = np.bincount(host[crosses], minlength=host[-1] + 1).max() if crosses.any() else 0
        rounds.append((bool((~crosses).any()), int(across)))
        distance *= 2
    return tuple(rounds)


class EmulatedClock:
    """One peer's time. `model`: a number advanced by compute and by modelled waits. `sleep`: the real
    clock (seconds since the epoch, so peers on several hosts agree to NTP precision); waits sleep."""

    def __init__(self, mode: str = "model"):
        if mode not in MODES:
            raise ValueError(f"network.mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode, self._now, self._origin = mode, 0.0, 0.0
        self.reset()

    def now(self) -> float:
        return self._now if self.mode == "model" else time.time()

    def reset(self, elapsed: float = 0.0) -> None:
        """Start counting (after the peers' common barrier); `elapsed` continues a resumed run."""
        if self.mode == "model":
            self._now, self._origin = elapsed, 0.0
        else:
            self._origin = time.time() - elapsed

    def elapsed(self) -> float:
        return self.now() - self._origin

    def catch_up(self, latest: float) -> None:
        """After a barrier the peers really met at (a paused evaluation's collectives), a `sleep` clock behind the
        latest peer's `latest` (its elapsed time on entering) moves up to it: waiting there for that peer is part
        of the run, only the evaluation itself is not. The `model` clock keeps its own time: an uncounted
        collective does not touch it, and messages carry their arrival times."""
        if self.mode == "sleep" and latest > self.elapsed():
            self.reset(latest)

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside the block (evaluation, metrics) is left off the clock: in `sleep` mode the origin
        moves by it; the `model` clock advances only by what is added to it anyway."""
        if self.mode == "model":
            yield
            return
        t0 = time.time()
        try:
            yield
        finally:
            self._origin += time.time() - t0

    def advance(self, seconds: float) -> None:
        """Computation took `seconds` (in `sleep` mode it really did: nothing to add)."""
        if self.mode == "model":
            self._now += seconds

    def wait_until(self, t: float) -> float:
        """Block until time `t` (an arrival); returns the time waited."""
        waited = max(0.0, t - self.now())
        if self.mode == "model":
            self._now += waited
        elif waited > 0:
            time.sleep(waited)
        return waited


@dataclass
class ComputeSlowdown:
    """One peer's compute emulation (`compute_time` and `compute_scale` above): call `start()` before the
    forward pass and `finish()` after the backward pass."""

    rank: int = 0
    slow_peers: tuple[int, ...] = ()
    compute_scale: float = 1.0
    compute_time: float = 0.0
    slept_s: float = field(default=0.0, init=False)  # total injected delay (sleep mode)
    _t0: float | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if not self.compute_scale >= 1.0:
            raise ValueError(
                f"network.compute_scale must be >= 1 (how many times slower a slow peer is), got {self.compute_scale}"
            )
        if not self.compute_time >= 0.0:
            raise ValueError(f"network.compute_time must be >= 0 seconds, got {self.compute_time}")
        self.slow_peers = tuple(int(p) for p in self.slow_peers)

    @property
    def scale(self) -> float:
        return self.compute_scale if self.rank in self.slow_peers else 1.0

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def finish(self, sleep: bool = True) -> float:
        """The step's emulated compute time; with `sleep`, the process sleeps out the difference to its
        real compute time (the step then really took that long)."""
        if self._t0 is None:
            return 0.0
        elapsed = time.perf_counter() - self._t0
        self._t0 = None
        if not sleep:
            return (self.compute_time or elapsed) * self.scale
        step = max(elapsed, self.compute_time) * self.scale
        if step > elapsed:
            time.sleep(step - elapsed)
            self.slept_s += step - elapsed
        return step


class NetworkEmulator:
    """Everything one peer emulates: its link model, clock, compute slowdown and jitter. A communicator
    with one attached (`comm.attach_network`) stamps its messages and applies the costs."""

    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        link: Link | None = None,
        mode: str = "model",
        jitter_s: float = 0.0,
        slowdown: ComputeSlowdown | None = None,
        seed: int = 0,
        hosts: Hosts | None = None,
    ):
        if not jitter_s >= 0:
            raise ValueError(f"network.jitter_s must be >= 0 seconds, got {jitter_s}")
        self.rank, self.size = rank, size
        self.link = link or Link()  # between hosts (with one peer per host: each peer's own link)
        self.hosts = hosts or Hosts()
        self.clock = EmulatedClock(mode)
        self.jitter_s = float(jitter_s)
        self.slowdown = slowdown or ComputeSlowdown(rank)
        self._rng = random.Random(link_jitter_seed(seed, rank))

    @classmethod
    def from_config(cls, network, rank: int = 0, size: int | None = None, seed: int = 0) -> NetworkEmulator:
        """The emulator of a `network=` section (dpsgd.config.NetworkConfig, or a mapping of its keys; None:
        nothing emulated) for peer `rank` of `size`."""
        is_section = dataclasses.is_dataclass(network) and not isinstance(network, type)
        network = dataclasses.asdict(network) if is_section else dict(network or {})
        if unknown := sorted(set(network) - set(NETWORK_KEYS)):
            raise ValueError(f"unknown network option(s) {unknown}; valid: {', '.join(NETWORK_KEYS)}")
        slow = network.get("slow_peers") or ()
        if isinstance(slow, int):
            slow = (slow,)
        if size is not None and (bad := [p for p in slow if not 0 <= int(p) < size]):
            raise ValueError(f"network.slow_peers {bad} are not ranks of a world of {size} peers")
        bandwidth = network.get("bandwidth_bytes_per_s") or None
        link = Link(float(network.get("latency_s") or 0.0), None if bandwidth is None else float(bandwidth))
        compute = network.get("compute_time") or network.get("calibrated_s") or 0.0  # given, else calibrated
        slowdown = ComputeSlowdown(rank, tuple(slow), float(network.get("compute_scale") or 1.0), float(compute))
        intra_bandwidth = network.get("intra_bandwidth_bytes_per_s") or None
        intra = Link(
            float(network.get("intra_latency_s") or 0.0), None if intra_bandwidth is None else float(intra_bandwidth)
        )
        per_host = network.get("peers_per_host")
        hosts = Hosts(
            1 if per_host is None else _whole(per_host, "network.peers_per_host"),
            intra,
            network.get("allreduce") or "ring",
        )
        if size is not None:
            hosts.check_size(size)
        mode, jitter = network.get("mode") or "model", float(network.get("jitter_s") or 0.0)
        return cls(rank, size or 1, link, mode, jitter, slowdown, seed, hosts)

    @property
    def active(self) -> bool:
        """Whether anything is emulated: messages cost more than on the real transport, or compute is slowed."""
        slowdown = self.slowdown
        links_free = self.link.free and (self.hosts.peers_per_host == 1 or self.hosts.intra.free)
        return not links_free or self.jitter_s > 0 or slowdown.scale != 1.0 or slowdown.compute_time > 0

    def jitter(self) -> float:
        return self._rng.uniform(0.0, self.jitter_s) if self.jitter_s > 0 else 0.0

    def start_compute(self) -> None:
        self.slowdown.start()

    def finish_compute(self) -> float:
        """End a step's computation: advance the clock by its emulated duration (sleeping it in sleep mode)."""
        seconds = self.slowdown.finish(sleep=self.clock.mode == "sleep")
        self.clock.advance(seconds)
        return seconds

    def send_stamp(
        self, nbytes: float, send_to: Sequence[int], senders: Callable[[int], Sequence[int]] | None = None
    ) -> float:
        """When the messages of `nbytes` this peer starts sending now to `send_to` have all arrived; `senders(j)`
        is peer j's destinations in the same operation (default: `circulant_senders`), which decide how many
        messages share this peer's host link."""
        if not send_to:
            return self.clock.now()
        senders = senders or circulant_senders(self.rank, send_to, self.size)
        cost = self.hosts.send_time(
            self.link, self.rank, self.size, nbytes, lambda j: send_to if j == self.rank else senders(j)
        )
        return self.clock.now() + cost + self.jitter()

    def allreduce_time(self, nbytes: float) -> float:
        """This world's all-reduce of `nbytes` (`Hosts.allreduce_time`)."""
        return self.hosts.allreduce_time(self.link, nbytes, self.size)


def _whole(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    return int(value)
