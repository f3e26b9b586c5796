"""What the asynchronous optimizers (AD-PSGD, asynchronous Local-SGD) share on real peers: communication threads whose
errors reach the main thread, bounded waits that name what they awaited, and the budget's amounts. A class using
`ThreadedPeer` sets `label` (its name in messages), `_abort` (a threading.Event), `_errors`, `_threads`, `wait_s`,
`run_budget` (adpsgd.budget.Budget) and `samples_per_step` in its constructor."""

from __future__ import annotations

import threading
import time
from typing import Any, ClassVar

from dpsgd.comm import CommError, PeerTimeoutError
from dpsgd.comm.pending import communication_thread, poll_until


class ThreadedPeer:
    label: ClassVar[Any]
    comm: Any
    clock: Any
    run_budget: Any
    samples_per_step: int
    wait_s: float
    _abort: threading.Event
    _errors: list[BaseException]
    _threads: list[threading.Thread]

    def set_budget(
        self,
        steps: int | None = None,
        samples: int | None = None,
        seconds: float | None = None,
        samples_per_step: int | None = None,
    ) -> None:
        """The amounts of the budgets (only the one named by `budget` ends the run)."""
        self.run_budget.set(steps=steps, samples=samples, seconds=seconds)
        if samples_per_step is not None:
            self.samples_per_step = int(samples_per_step)

    def _spawn(self, target, what: str) -> None:
        """Run `target` on a daemon thread; an exception there sets `_abort` and is raised on the main thread by
        `_raise_thread_error`."""

        def run():
            try:
                target()
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                self._errors.append(exc)
                self._abort.set()

        prefix = type(self).__name__.lower()
        t = communication_thread(threading.Thread(target=run, name=f"{prefix}-{what}-{self.comm.rank}", daemon=True))
        self._threads.append(t)
        t.start()

    def _raise_thread_error(self) -> None:
        if self._errors:
            exc = self._errors[0]
            if isinstance(exc, CommError):
                raise exc
            raise CommError(
                f"rank {self.comm.rank}: {self.label}'s communication thread failed: {type(exc).__name__}: {exc}"
            ) from exc

    def _wait(self, test, what: str, then: str) -> None:
        """Wait for `test()` within the communicator's deadline, counted in `wait_s`; a communication
        thread's error is raised instead, and past the deadline an error saying that `what`."""
        t0, since = time.monotonic(), self.clock()
        try:
            done = poll_until(test, t0 + self.comm.timeout_s, abort=self._abort.is_set)
        except PeerTimeoutError:
            done = False
        if not done:
            self._raise_thread_error()
            raise PeerTimeoutError(
                f"rank {self.comm.rank}: {self.label}'s {what} within {self.comm.timeout_s:g} s{then}"
            )
        self.wait_s += self.clock() - since

    def _join_threads(self, seconds: float) -> None:
        """Wait for every communication thread to end, raising a thread's error at once, and past `seconds` an error
        naming the thread that did not end."""
        deadline = time.monotonic() + seconds
        for t in self._threads:
            while t.is_alive():
                t.join(timeout=0.05)
                self._raise_thread_error()
                if time.monotonic() > deadline:
                    raise PeerTimeoutError(
                        f"rank {self.comm.rank}: {self.label}'s {t.name} thread did not end within {seconds:g} s"
                    )
        self._raise_thread_error()
