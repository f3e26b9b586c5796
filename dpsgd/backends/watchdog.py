"""The driver's watchdog: when no peer has begun a step for longer than comm.timeout_s plus a margin,
the run is stuck (every peer hung at once, or the only peer of peers=1, where no communication
timeout can fire) and the driver ends it with one line.

How it works: docs/guide/internals.md#watchdog.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

MARGIN_S = 10.0  # beyond comm.timeout_s: a step's evaluation and checkpoint also take time
STARTUP_S = 60.0  # before the first step: importing torch and joining the world take seconds on a loaded machine


class Watchdog:
    """Calls `on_stall(line)` once, from its own thread, when `last_progress()` (time.monotonic() of
    the newest step any peer began, or None before the first) is older than the limit."""

    def __init__(
        self,
        timeout_s: float,
        last_progress: Callable[[], float | None],
        on_stall: Callable[[str], None],
        steps: Callable[[], dict[int, int]],
    ):
        self.limit_s = float(timeout_s) + MARGIN_S
        self._last, self._on_stall, self._steps = last_progress, on_stall, steps
        self._started = time.monotonic()
        self._done = threading.Event()
        self.line: str | None = None  # the one line, once the watchdog fired
        self._thread = threading.Thread(target=self._watch, name="dpsgd-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(timeout=2)

    def _watch(self) -> None:
        while not self._done.wait(0.2):
            last = self._last()
            since = self._started if last is None else max(last, self._started)
            limit = self.limit_s + (STARTUP_S if last is None else 0.0)
            idle = time.monotonic() - since
            if idle > limit:
                self.line = self._describe(idle, last is None)
                self._on_stall(self.line)
                return

    def _describe(self, idle: float, before_first: bool) -> str:
        where = "before any peer began its first step"
        if not before_first and (steps := self._steps()):
            where = "last steps begun: " + ", ".join(f"peer {r} step {s}" for r, s in sorted(steps.items()))
        return (
            f"no peer made progress for {idle:.0f} s (the driver's watchdog allows comm.timeout_s + "
            f"{MARGIN_S:.0f} s = {self.limit_s:.0f} s; {where}): every peer is stuck; if steps are "
            "legitimately this slow, raise comm.timeout_s"
        )
