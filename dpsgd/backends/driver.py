"""What every backend's driver does: start a run's peers, follow them (dpsgd.supervisor), stop them all
at the first failure and say in one line who failed, where and why. A driver record is its backend's
transport record (dpsgd.comm.transport) with these parts added, so the app asks one record for both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path

from dpsgd import progress, runfiles
from dpsgd.comm import transport
from dpsgd.comm.transport import Transport
from dpsgd.config import RunConfig
from dpsgd.runfiles import RunFileError
from dpsgd.supervisor import ENV, Supervisor

from .hosts import placement
from .launch import failure_cause, stop_live
from .watchdog import Watchdog


class RunFailed(RuntimeError):
    """The peers of a run failed; the message is the one line for the user (who failed, why, where the logs are).
    `died`: the rank whose death (a signal, no error message) caused it, else None."""

    def __init__(self, line: str, died: int | None = None):
        super().__init__(line)
        self.died = died


class Backend(Transport):
    """One backend's driver, on top of its transport record. Subclasses override what differs from these
    defaults: the peers as processes (`spawn`) or a `start` of their own."""

    def exit(self) -> None:
        """End a launched rank whose results are written (default: the interpreter's own exit)."""

    def elastic_problem(self) -> str | None:
        """What an elastic run under this backend's own launcher needs of that launcher, else None."""
        return None

    def spawn(
        self,
        n: int,
        argv: list[str],
        timeout_s: float | None = None,
        env: dict | None = None,
        log_dir: Path | None = None,
        codes_out: list | None = None,
        launcher: dict | None = None,
    ) -> int:
        """Run `argv` (a python command line without the interpreter) on n processes of one world, on this
        machine or, with a `launcher` naming hosts, on `launcher["hosts"]` (dpsgd.backends.hosts: placement,
        runner, environment); rank r's stderr to log_dir/rank{r}.log; the exit code (the first failure stops all)."""
        raise ValueError(f"backend={self.name} starts no peer processes; use backend={transport.having('processes')}")

    def start(self, config: RunConfig, run_dir: Path, argv: list[str], peers: int | None = None) -> dict:
        """From the driver, run every peer of the experiment `config` (written to run_dir/config.yaml) and
        return its summary; `argv` is one peer process's command line; `peers`: how many (default
        config.peers; an elastic run's relaunch has fewer). Raises RunFailed: one line naming the peer
        that failed first (followed by dpsgd.supervisor), the step and why."""
        n = config.peers if peers is None else peers
        launcher = dataclasses.asdict(config.launcher) if config.launcher.hosts else None
        logs = run_dir / "logs"
        runfiles.make_folder(logs)
        start = time.monotonic()
        codes: list = []  # each process's exit code when the first failure was seen, where `spawn` knows them
        with Supervisor() as sup, _without_empty_logs(logs):
            # decided here, where stdout is the user's: a peer's may be a pipe to this process (dpsgd.progress)
            env = {progress.ENV: progress.mode(), ENV: sup.path}
            # the watchdog stops the peers when none progresses (every one hung): spawn then returns
            with Watchdog(
                config.comm.timeout_s, lambda: sup.last_progress, lambda _: stop_live(), sup.steps.copy
            ) as dog:
                code = self.spawn(n, argv, env=env, log_dir=logs, codes_out=codes, launcher=launcher)
            if dog.line is not None:
                raise RunFailed(f"{dog.line}; all peers stopped after {time.monotonic() - start:.1f} s (logs: {logs})")
            if code != 0:
                settle = time.monotonic() + 1.0  # the supervisor's thread reads closings: let it see the last
                while len(sup.ended) + len(sup.finished) < len(sup.steps) and time.monotonic() < settle:
                    time.sleep(0.01)
                on = placement(list(launcher["hosts"]), n) if launcher else None
                failure, died = failure_cause(logs, sup, code, n, codes, on)
                raise RunFailed(
                    f"{failure}; all peers stopped after {time.monotonic() - start:.1f} s (logs: {logs})", died
                )
        return json.loads((run_dir / "summary.json").read_text())


@contextlib.contextmanager
def _without_empty_logs(logs: Path) -> Iterator[None]:
    """The run's logs without the files of peers (or a launcher) that said nothing: an empty file under a final name
    would read as one cut off. Removed once the run has ended, however it ended."""
    try:
        yield
    finally:
        for path in logs.glob("*.log"):
            with contextlib.suppress(OSError):
                if path.stat().st_size == 0:
                    path.unlink()


def error_line(rank: int, exc: BaseException) -> str:
    """'rank 2: PeerTimeoutError: neighbor_average timed out ... at step 41; ...': one line."""
    text = (str(exc).strip().splitlines() or [""])[0]
    text = text.removeprefix(f"rank {rank}: ")
    if isinstance(exc, RunFileError):  # its line says what failed and what to do: no class name needed
        return f"rank {rank}: {text}"
    return f"rank {rank}: {type(exc).__name__}: {text}"
