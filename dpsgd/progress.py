"""How far a run is: the steps it plans and an estimate of the time left, shown by the process that writes the run's
files (the loop's writer, dpsgd.training).

On a terminal it is a bar (rich: steps done of planned, the time left, the latest accuracy); elsewhere (a pipe, a
log file, CI) it is a line when the run starts, saying how many steps it plans, one with an estimate after the first
steps, then one now and then (every tenth of the run, at most every few minutes apart), all on stdout so that a
failure stays the one line on stderr. `DPSGD_PROGRESS` chooses: `bar`, `lines` or `off`; unset, a bar where stdout is
a terminal and lines elsewhere (the app's driver sets it for the peers it starts, whose stdout may be a pipe to it).
"""

from __future__ import annotations

import os
import sys
import time

ENV = "DPSGD_PROGRESS"
FIRST_S = 10.0  # the first estimate: after this long, or after a tenth of the run (if that took FIRST_MIN_S)
FIRST_MIN_S = 2.0  # a run shorter than this needs no estimate
EVERY = 0.1  # then a line each tenth of the run ...
AT_MOST_S = 300.0  # ... or after this long without one
AT_LEAST_S = 10.0  # but never two lines closer than this


def mode() -> str:
    """`bar`, `lines` or `off` (see the module)."""
    chosen = os.environ.get(ENV, "").strip().lower()
    if chosen in ("bar", "lines", "off"):
        return chosen
    return "bar" if sys.stdout.isatty() else "lines"


def duration(seconds: float) -> str:
    """'45 s', '12 min', '3.5 h', '9 days', '3,170 years': a duration as people say it."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds < 730 * 86400:
        return f"{seconds / 86400:.0f} days"
    return f"{seconds / (365.25 * 86400):,.0f} years"


class Lines:
    """The progress of a run as lines on stdout (see the module)."""

    def __init__(self, total: int, done: int, what: str = ""):
        self.total, self.start_step = total, done
        self.started = self.last_line = time.monotonic()
        self.next_step = done  # the step after which the next line is due
        self.estimated = False
        left = f"{total - done:,} steps left of {total:,} planned (resumed at step {done:,})" if done else None
        print(f"training: {left or f'{total:,} steps planned'}{f' ({what})' if what else ''}", flush=True)

    def update(self, step: int, status: str = "") -> None:
        now = time.monotonic()
        done, elapsed = step - self.start_step, now - self.started
        if done <= 0 or step >= self.total or now - self.last_line < (0 if not self.estimated else AT_LEAST_S):
            return
        first_due = elapsed >= FIRST_S or (done >= EVERY * (self.total - self.start_step) and elapsed >= FIRST_MIN_S)
        due = first_due if not self.estimated else step >= self.next_step or now - self.last_line >= AT_MOST_S
        if not due:
            return
        left = elapsed / done * (self.total - step)
        share = 100 * step / self.total
        print(
            f"step {step:,} of {self.total:,} ({share:.0f}%), {duration(elapsed)} so far, about {duration(left)} left"
            + (f"; {status}" if status else ""),
            flush=True,
        )
        self.estimated, self.last_line = True, now
        self.next_step = step + max(1, round(EVERY * self.total))

    def close(self) -> None:
        return None


class Bar:
    """The progress of a run as a rich bar on the terminal (removed when the run ends: its table follows)."""

    def __init__(self, total: int, done: int):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        # the peers' stdout may be a pipe to the driver, whose stdout is the terminal (it chose `bar`)
        self._bar = Progress(
            TextColumn("[bold]training"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
            transient=True,
            console=Console(force_terminal=True),
        )
        self._bar.start()
        self._task = self._bar.add_task("train", total=total, completed=done, status="")

    def update(self, step: int, status: str = "") -> None:
        if status:
            self._bar.update(self._task, completed=step, status=status)
        else:
            self._bar.update(self._task, completed=step)

    def close(self) -> None:
        self._bar.stop()


class Off:
    def update(self, step: int, status: str = "") -> None:
        return None

    def close(self) -> None:
        return None


def show(total: int, done: int = 0, what: str = "") -> Lines | Bar | Off:
    """The progress display of a run of `total` steps, `done` of them before it started (a resumed run)."""
    chosen = mode()
    if chosen == "off":
        return Off()
    return Bar(total, done) if chosen == "bar" else Lines(total, done, what)
