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

import dpsgd.comm
from dpsgd.training import train


def init_comm(cfg: dict):
    backend = cfg["backend"]
    options = {}
    if backend["name"] == "torch":
        options["dist_backend"] = backend.get("dist_backend") or ("nccl" if cfg.get("device") == "cuda" else "gloo")
    return dpsgd.comm.init(backend["name"], timeout_s=float(cfg["comm"]["timeout_s"]), **options)


def run_peer(comm, cfg: dict, run_dir: Path | None) -> dict:
    """Train; on failure print one line naming the rank and end the whole world."""
    try:
        return train(comm, cfg, run_dir)
    except Exception as exc:  # noqa: BLE001 - reported in one line, then the world is stopped
        print(f"error: rank {comm.rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        if hasattr(comm, "abort"):
            comm.abort(1)  # MPI: other ranks may be blocked in a collective
        sys.exit(1)


def main() -> None:
    run_dir = Path(sys.argv[1])
    cfg = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=True)
    torch.set_num_threads(1)
    comm = init_comm(cfg)
    run_peer(comm, cfg, run_dir)
    comm.close()
    # the results are written and the group is down: leave without the interpreter's teardown, where
    # gloo's threads aborted about one torch peer in ten at exit ("terminate called without an active exception")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
