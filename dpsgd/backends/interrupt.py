"""Signals to the driver: the first SIGINT or SIGTERM raises `Interrupted` where the driver waits, so
the code that started the peers stops them (dpsgd.backends.launch: SIGTERM, SIGKILL after a grace period) and
the app ends with one line saying how to resume; a second signal kills every peer group at once, after the same
line. The same signal twice within REPEAT_S is one request (`timeout` signals the program and then its group).

`timeout`, `kill`, systemd, container runtimes and Slurm's preemption send SIGTERM to the driver
alone: without this the driver died and its peers (in their own sessions) ran on unsupervised.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator

from . import launch

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):  # noqa: N818 - not an error: the user asked to stop
    """The run was stopped by `signum`; the app exits with 128 + signum, as a shell reports it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


REPEAT_S = 0.2  # the same signal again within this long is the same request: `timeout` sends SIGTERM twice


@contextlib.contextmanager
def stop_on_signals(line: Callable[[], str] | None = None) -> Iterator[None]:
    """In the main thread: SIGINT/SIGTERM raise Interrupted once; a second one kills every peer process group the
    run started (dpsgd.backends.launch.LIVE) and this process at once, printing `line()` first (the app's line, with
    `{signal}` for the signal's name). The same signal again within REPEAT_S is not a second one: `timeout` sends
    its SIGTERM to the program and again to the program's process group, which this process is in."""
    seen: list[tuple[int, float]] = []

    def handler(signum, frame):
        now = time.monotonic()
        if seen and seen[-1][0] == signum and now - seen[-1][1] < REPEAT_S:
            return
        seen.append((signum, now))
        if len(seen) > 1:
            launch.stop_live(signal.SIGKILL)
            if line is not None:
                with contextlib.suppress(Exception):  # the line is a courtesy: the exit must happen
                    text = line().format(signal=signal.Signals(signum).name)
                    os.write(2, f"error: {text} (a second signal: every peer killed at once)\n".encode())
            os._exit(128 + signum)
        raise Interrupted(signum)

    old = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def exit_on_signals(line: Callable[[], str] | None) -> None:
    """In a rank a user's launcher started (it forwards the signal to every rank): print `line()`
    (rank 0 passes the resume line, made when the signal comes: it names the checkpoints kept by
    then; the others None) and end at once. Checkpoints are written atomically, so ending mid-write
    leaves the newest complete one intact."""

    def handler(signum, frame):
        if line is not None:
            os.write(2, f"{line().format(signal=signal.Signals(signum).name)}\n".encode())
        os._exit(128 + signum)

    for s in SIGNALS:
        signal.signal(s, handler)
