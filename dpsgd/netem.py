"""Network and straggler emulation. For now: the per-peer compute slowdown (stragglers).

Configured by the `network` config group (`network=loopback`, `network=straggler`):
- `slow_peers`: ranks that compute slower than the others,
- `compute_scale`: how much slower (4.0: a slow peer takes 4x as long per step),
- `compute_time`: a per-step compute floor in seconds: after its real compute a peer waits until
  `compute_time` (times its slowdown) has passed since the step began, so that many peers sharing a
  few cores keep honest relative timing (the floor, not the contention for cores, sets the pace).

The delay is real (`time.sleep` in the computing thread), so its effect on an algorithm is measured on
real processes, not assumed: a slow peer under all-reduce slows every peer, under AD-PSGD only itself.
Per-link latency and bandwidth emulation and the emulated clock come with issue 7 and will live here,
in the same `network` group.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

NETWORK_KEYS = ("name", "slow_peers", "compute_scale", "compute_time")


@dataclass
class ComputeSlowdown:
    """One peer's compute emulation: call `start()` before the forward pass and `finish()` after the
    backward pass; `finish()` sleeps until max(real compute, compute_time) x scale has passed."""

    rank: int = 0
    slow_peers: tuple[int, ...] = ()
    compute_scale: float = 1.0
    compute_time: float = 0.0
    slept_s: float = field(default=0.0, init=False)  # total injected delay
    _t0: float | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if not self.compute_scale >= 1.0:
            raise ValueError(f"network.compute_scale must be >= 1 (how many times slower a slow peer is), "
                             f"got {self.compute_scale}")
        if not self.compute_time >= 0.0:
            raise ValueError(f"network.compute_time must be >= 0 seconds, got {self.compute_time}")
        self.slow_peers = tuple(int(p) for p in self.slow_peers)

    @classmethod
    def from_config(cls, network: dict | None, rank: int, size: int | None = None) -> ComputeSlowdown:
        network = dict(network or {})
        unknown = sorted(set(network) - set(NETWORK_KEYS) - {"latency_s", "bandwidth_bps", "jitter_s", "mode"})
        if unknown:
            raise ValueError(f"unknown network option(s) {unknown}; valid: {', '.join(NETWORK_KEYS)}")
        slow = network.get("slow_peers") or ()
        if isinstance(slow, int):
            slow = (slow,)
        if size is not None:
            bad = [p for p in slow if not 0 <= int(p) < size]
            if bad:
                raise ValueError(f"network.slow_peers {bad} are not ranks of a world of {size} peers")
        return cls(rank, tuple(slow), float(network.get("compute_scale") or 1.0),
                   float(network.get("compute_time") or 0.0))

    @property
    def scale(self) -> float:
        return self.compute_scale if self.rank in self.slow_peers else 1.0

    @property
    def active(self) -> bool:
        return self.scale != 1.0 or self.compute_time > 0

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def finish(self) -> float:
        """Sleep until this step's emulated compute time has passed; returns the seconds slept."""
        if self._t0 is None or not self.active:
            return 0.0
        elapsed = time.perf_counter() - self._t0
        self._t0 = None
        delay = max(elapsed, self.compute_time) * self.scale - elapsed
        if delay > 0:
            time.sleep(delay)
            self.slept_s += delay
            return delay
        return 0.0
