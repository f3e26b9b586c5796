"""A peer's side of a run, whoever started it: the app's driver (`python -m experiments.peer RUN_DIR`, a process it
spawned) or a user's launcher (mpiexec, srun, torchrun: every rank runs the app and joins the launcher's world).
It reports its progress to the driver (dpsgd.supervisor), trains (dpsgd.training.train), and on failure prints one
line naming its rank, leaves it in RUN_DIR/logs for the driver and ends the whole world."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from dpsgd import runfiles, supervisor
from dpsgd.comm import Communicator, transport
from dpsgd.config import RunConfig
from dpsgd.training import train

from .driver import error_line
from .launch import ERROR_FILE


def connect(config: RunConfig) -> Communicator:
    """The communicator of one peer of the run `config` (its backend's transport, with the config's options)."""
    record = transport.get(config.backend.name)
    return record.connect(config.comm.timeout_s, **record.options(config.backend.options, config.device))


def run_peer(comm: Communicator, config: RunConfig, run_dir: Path | None) -> dict:
    """Train this peer of `config`; rank 0 writes the run's files to `run_dir`. A failure is one line (see the
    module) and ends the process, and with it the world."""
    supervisor.report_step(comm.rank, 0)  # the driver now follows this peer
    try:
        summary = train(comm, config, run_dir)
    except Exception as exc:  # noqa: BLE001 - reported in one line, then the world is stopped
        line = error_line(comm.rank, exc)
        supervisor.report_error(comm.rank, line)  # reaches the driver where no file can be written (a full disk)
        with contextlib.suppress(OSError):
            print(f"error: {line}", file=sys.stderr, flush=True)
        if run_dir is not None:
            with contextlib.suppress(OSError):  # whole or not at all: the driver has the line from the supervisor
                runfiles.make_folder(Path(run_dir) / "logs")
                runfiles.write_atomic(Path(run_dir) / "logs" / ERROR_FILE.format(rank=comm.rank), f"{line}\n".encode())
        if hasattr(comm, "abort"):
            comm.abort(1)  # MPI: other ranks may be blocked in a collective
        # no orderly shutdown: tearing down a process group whose peers are gone can block for
        # seconds (gloo), and the launcher stops the others as soon as this process has ended
        os._exit(1)
    supervisor.report_finished()
    return summary


def join(config: RunConfig, run_dir: Path, save_config: bool) -> dict | None:
    """This process as one rank of its launcher's world (or of the app's spawned peers): connect, train, close;
    returns the summary on rank 0 (None elsewhere). `save_config`: rank 0 writes run_dir/config.yaml first (the
    launched ranks' run; a spawned peer reads the one its driver wrote)."""
    comm = connect(config)
    if save_config and comm.rank == 0:
        config.save(run_dir / "config.yaml")
    summary = run_peer(comm, config, run_dir)
    comm.close()
    return summary if comm.rank == 0 else None
