"""One spawned peer: `python -m experiments.peer RUN_DIR` trains with RUN_DIR/config.yaml.

experiments.train starts these (through mpiexec or as torch.distributed processes) after it
has validated and written the resolved config; users do not call it directly.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from dpsgd import backends, supervisor
from dpsgd.backends import ERROR_FILE, error_line
from dpsgd.config import RunConfig, parse
from dpsgd.training import train


def run_peer(comm, config: RunConfig, run_dir: Path | None) -> dict:
    """Train; on failure print one line naming the rank (and leave it in RUN_DIR/logs for the driver)
    and end the whole world."""
    supervisor.report_step(comm.rank, 0)  # the driver now follows this peer
    try:
        summary = train(comm, config, run_dir)
    except Exception as exc:  # noqa: BLE001 - reported in one line, then the world is stopped
        line = error_line(comm.rank, exc)
        print(f"error: {line}", file=sys.stderr, flush=True)
        if run_dir is not None:
            (Path(run_dir) / "logs").mkdir(exist_ok=True)
            (Path(run_dir) / "logs" / ERROR_FILE.format(rank=comm.rank)).write_text(line + "\n")
        if hasattr(comm, "abort"):
            comm.abort(1)  # MPI: other ranks may be blocked in a collective
        # no orderly shutdown: tearing down a process group whose peers are gone can block for
        # seconds (gloo), and the launcher stops the others as soon as this process has ended
        os._exit(1)
    supervisor.report_finished()
    return summary


def main() -> None:
    run_dir = Path(sys.argv[1])
    config = parse(OmegaConf.load(run_dir / "config.yaml"))
    torch.set_num_threads(1)
    comm = backends.connect(config)
    run_peer(comm, config, run_dir)
    comm.close()
    # the results are written and the group is down: leave without the interpreter's teardown, where
    # gloo's threads aborted about one torch peer in ten at exit ("terminate called without an active exception")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
