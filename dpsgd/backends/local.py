"""The `local` backend's driver: the peers as threads of the driver's process (dpsgd.comm.local), no launcher."""

from __future__ import annotations

import time
import traceback
from pathlib import Path

from dpsgd import runfiles, supervisor
from dpsgd.comm import CommError, LocalWorld, run_local
from dpsgd.comm.local import LocalTransport
from dpsgd.config import RunConfig

from .driver import Backend, RunFailed, error_line
from .watchdog import Watchdog


class _PeerError(RuntimeError):
    """A peer failed; the message is its one line (rank, error type, message)."""


def _peer(comm, config: RunConfig, run_dir: Path) -> dict:
    from dpsgd.training import train

    try:
        return train(comm, config, run_dir)
    except Exception as exc:  # noqa: BLE001 - one line for the user, the traceback to the logs
        raise _PeerError(error_line(comm.rank, exc)) from exc


class LocalBackend(LocalTransport, Backend):
    def start(self, config: RunConfig, run_dir: Path, argv: list[str], peers: int | None = None) -> dict:
        start = time.monotonic()
        world = LocalWorld(config.peers if peers is None else peers)
        supervisor.in_process_steps.clear()
        supervisor.in_process_progress = None
        timeout_s = config.comm.timeout_s
        dog = Watchdog(timeout_s, lambda: supervisor.in_process_progress, world.stop, supervisor.in_process_steps.copy)
        try:
            with dog:
                return run_local(config.peers, _peer, config, run_dir, timeout_s=timeout_s, world=world)[0]
        except CommError:
            if dog.line is None:
                raise
            raise RunFailed(f"{dog.line}; all peers stopped after {time.monotonic() - start:.1f} s") from None
        except _PeerError as exc:  # the first peer that failed; the others were released at once
            where = run_dir / "logs" / "traceback.log"
            try:
                runfiles.make_folder(where.parent)
                runfiles.write_atomic(where, "".join(traceback.format_exception(exc.__cause__ or exc)).encode())
                kept = f" (traceback: {where})"
            except OSError:  # the failure may be that nothing can be written there (a full disk)
                kept = ""
            raise RunFailed(f"{exc}; all peers stopped after {time.monotonic() - start:.1f} s{kept}") from None
