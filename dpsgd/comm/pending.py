"""Operations in flight and how a peer waits for them: what a transport returns when it starts an
exchange, an all-reduce or one message (`Pending`, `Exchange`, `Request`), the errors a wait ends with,
and `poll_until`, the wait every transport shares: tests that yield the core, sleeping polls, and for long waits on
a process's main thread yielding tests again (each leaves the core to a computing peer).
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
        # one message: a control message or a peer's answer, not a transfer that sleeping polls would move sooner,
        # so where it may, the wait yields from the start (see poll_until)
        poll_until(self.test, deadline, self.peers_outstanding, yield_from_s=0.0)


# threads that must get the interpreter promptly (the asynchronous optimizers' communication threads, gloo's request
# waiters): while one runs, the process's waits sleep between their tests. Registered from any thread, read by the
# main thread: under the lock
_communication_threads: list[threading.Thread] = []
_communication_threads_lock = threading.Lock()


def communication_thread(thread: threading.Thread) -> threading.Thread:
    """Register `thread` as one whose work must not wait for the interpreter lock (see `may_spin`); returns it."""
    with _communication_threads_lock:
        _communication_threads[:] = [t for t in _communication_threads if t.is_alive() or t.ident is None]
        _communication_threads.append(thread)
    return thread


def may_spin() -> bool:
    """Whether this thread's long waits may yield the core between tests instead of sleeping (`poll_until`): only on
    the main thread of a process where no communication thread runs, since a thread that spins holds the interpreter
    lock, which another thread of the process (a communication thread; the local backend's peers) then gets only
    every few milliseconds."""
    if threading.current_thread() is not threading.main_thread():
        return False
    with _communication_threads_lock:
        return not any(t.is_alive() for t in _communication_threads)


_POLL_MIN_S, _POLL_MAX_S = 2e-5, 1e-3
_TESTS_PER_YIELD, _YIELDS_PER_CLOCK = 4, 4  # while spinning (poll_until's first phase)
YIELD_FROM_S, YIELD_UNTIL_S = 3e-3, 0.1  # when a main thread's wait yields between tests instead of sleeping


def poll_until(
    test,
    deadline: float,
    outstanding=list,
    abort: Callable[[], bool] | None = None,
    spin_s: float = 0.0,
    yield_from_s: float = YIELD_FROM_S,
) -> bool:
    """Wait for `test()` to be true, in three phases, each measured with 4 ranks on 2 cores (results: benchmarks.md).
    For the first `spin_s`, test without sleeping, yielding the core after every few tests: a collective's peers arrive
    together, and even 20 us sleeps made a 1 MiB exchange several times slower than MPI's own spinning wait (MPI's
    non-blocking operations progress only inside a test). Then sleep between tests for 1/20 of the time waited so
    far, 20 us to 1 ms: each wake-up runs at once, which finished a 1 MiB exchange 6-9% sooner than yielding for the
    whole wait. From `yield_from_s` to `YIELD_UNTIL_S`, while `may_spin()`, yield again: the growing sleeps delay a
    long transfer (sleeping on made an 11 MiB exchange 8% and all-reduce 24-28% slower than yielding from 3 ms), and
    each wake-up preempts a rank that computes on the same core (beside a partner in sleeping polls it ran 4-15%
    slower, in yields at most 7%). Past that, 1 ms sleeps again: such a wait is for a straggler, a peer starting up
    or one that died, where a yielding loop would hold a core for seconds (MPI-heavy tests ran 4-6% slower) to
    notice 1 ms sooner.
    True once `test()` is; False if `abort()` becomes true first (it is asked before the deadline)."""
    start = time.monotonic()
    spin_until = min(start + spin_s, deadline)
    if abort is None:
        # the first phase as tight as a hand-written loop: a few tests between yields (MPI's non-blocking collectives
        # move only inside a test; one test per yield made a 1 MiB all-reduce on mpi 3-4% slower than MPI's own Wait,
        # four matched it) and the clock read once per _YIELDS_PER_CLOCK yields (reading it at every test cost 1-3%)
        while time.monotonic() < spin_until:
            for _ in range(_YIELDS_PER_CLOCK):
                for _ in range(_TESTS_PER_YIELD):
                    if test():
                        return True
                os.sched_yield()
    _fine_timer_slack()  # only sleeps need it
    yield_from, yield_to = start + yield_from_s, start + YIELD_UNTIL_S
    while not test():
        if abort is not None and abort():
            return False
        now = time.monotonic()
        # may_spin() asked each time: a test() may start a communication thread (gloo's request waiter)
        if now <= deadline and (now < spin_until or (yield_from <= now < yield_to and may_spin())):
            os.sched_yield()
            continue
        if now > deadline:
            raise PeerTimeoutError(f"peers {outstanding()} did not answer")
        time.sleep(min(_POLL_MAX_S, max(_POLL_MIN_S, (now - start) / 20)))
    return True


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
