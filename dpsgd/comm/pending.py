"""Operations in flight and how a peer waits for them: what a transport returns when it starts an
exchange, an all-reduce or one message (`Pending`, `Exchange`, `Request`), the errors a wait ends with,
and `poll_until`, the wait every transport shares: sleeping polls that leave the core to computing peers,
after an optional short spin for collectives whose ranks arrive together.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch


class CommError(RuntimeError):
    """A collective or point-to-point operation could not complete."""


class PeerTimeoutError(CommError):
    """A peer did not answer before the deadline."""


class PeerFailedError(CommError):
    """Another peer of the same world failed, so this operation can never complete."""


class Pending(ABC):
    """A backend's in-flight operation."""

    @abstractmethod
    def wait(self, deadline: float) -> None:
        """Block until done; raise PeerTimeoutError past `deadline` (time.monotonic)."""

    def peers_outstanding(self) -> list[int]:
        """Peers whose part has not completed yet (for error messages)."""
        return []

    def progress(self) -> None:  # noqa: B027 - most backends progress on their own
        """Let the operation advance without waiting for it (MPI's non-blocking collectives move only
        while a rank tests them; other backends progress in their own threads)."""


class Exchange(Pending):
    """A point-to-point exchange: after `wait`, `received[peer]` holds each peer's buffer."""

    received: dict[int, torch.Tensor]


class Request(Pending):
    """One started message of an asynchronous protocol (`start_send` / `start_recv`): unlike the
    symmetric operations above, it can be tested without blocking, and a receive may accept any
    sender (`source` then tells who sent it, once complete)."""

    source: int | None = None

    @abstractmethod
    def test(self) -> bool:
        """True once the message has been sent (the buffer may be reused) or received."""

    def wait(self, deadline: float) -> None:
        poll_until(self.test, deadline, self.peers_outstanding)


def poll_until(
    test, deadline: float, outstanding=list, abort: Callable[[], bool] | None = None, spin_s: float = 0.0
) -> bool:
    """Wait for `test()` to be true without spinning a core: sleep between polls for 1/20 of the
    time waited so far, from 20 us up to 1 ms (waiting ranks that spin halve the speed of
    computing ones on small machines). A wait thus notices completion at most about 5% late, and a
    long wait costs about a hundred quick polls, then one per millisecond. Quick polls matter for
    MPI's non-blocking operations: they progress only while each rank polls, so 1 ms sleeps from the
    start made a 1 MiB all-reduce on 4 ranks 4x slower than a blocking one.
    `spin_s`: first poll without sleeping for up to that long, yielding the core to any other runnable
    process between polls (a collective whose peers arrive together: even 20 us sleeps made a 1 MiB
    exchange of MPI's pipelined copies several times slower than MPI's own spinning wait).
    True once `test()` is; False if `abort()` becomes true first (it is asked before the deadline)."""
    _fine_timer_slack()
    start = time.monotonic()
    spin_until = min(start + spin_s, deadline)
    while not test():
        if abort is not None and abort():
            return False
        now = time.monotonic()
        if now < spin_until:
            os.sched_yield()
            continue
        if now > deadline:
            raise PeerTimeoutError(f"peers {outstanding()} did not answer")
        time.sleep(min(_POLL_MAX_S, max(_POLL_MIN_S, (now - start) / 20)))
    return True


_POLL_MIN_S, _POLL_MAX_S = 2e-5, 1e-3


_slack = threading.local()


def _fine_timer_slack() -> None:
    """Let this thread's short sleeps end on time: Linux lets a sleep overshoot by the thread's timer
    slack, 50 us by default, which made a 20 us poll last 70-140 us and added most of the toolkit's
    latency on small messages. Set once per thread, to 1 us (PR_SET_TIMERSLACK; elsewhere nothing)."""
    if getattr(_slack, "set", False):
        return
    _slack.set = True
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)
        except (OSError, AttributeError):
            pass


_PR_SET_TIMERSLACK = 29
