"""Checkpoints of a whole world: every peer's file for one step, and a marker that all are complete.

Layout: RUN_DIR/checkpoints/step_00000120/rank{r}.pt for each peer, then COMPLETE (written by
rank 0 after a barrier, so it exists only once every peer's file does). Files are written to a
temporary name, fsynced and renamed: a peer killed while writing leaves no torn file under the
real name, and a step without COMPLETE is never resumed from. Loading uses
torch.load(weights_only=True): a checkpoint cannot run code.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

KEEP = 2  # complete checkpoints kept; older ones are deleted once a newer one is complete


def _step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: Path, obj) -> None:
    """A JSON file written to a temporary name and renamed: a reader never sees half of it."""
    data = (json.dumps(obj, indent=2) + "\n").encode()
    _write_atomic(Path(path), lambda fh: fh.write(data))


def save(comm, run_dir: Path, step: int, state: dict) -> None:
    """Every peer calls this at the same step with its own state."""
    folder = _step_dir(run_dir, step)
    folder.mkdir(parents=True, exist_ok=True)
    _write_atomic(folder / f"rank{comm.rank}.pt", lambda fh: torch.save(state, fh))
    comm.barrier()
    if comm.rank == 0:
        marker = json.dumps({"step": step, "peers": comm.size}).encode()
        _write_atomic(folder / "COMPLETE", lambda fh: fh.write(marker))
        for old in complete_steps(run_dir, comm.size)[:-KEEP]:
            shutil.rmtree(_step_dir(run_dir, old), ignore_errors=True)


def complete_steps(run_dir: Path, peers: int) -> list[int]:
    """Steps with a complete checkpoint of all `peers`, oldest first."""
    root = Path(run_dir) / "checkpoints"
    steps = []
    for folder in sorted(root.glob("step_*")) if root.is_dir() else []:
        marker = folder / "COMPLETE"
        if not marker.exists():
            continue  # torn: a peer died before every file was written
        info = json.loads(marker.read_text())
        if info.get("peers") == peers and all((folder / f"rank{r}.pt").exists() for r in range(peers)):
            steps.append(int(info["step"]))
    return steps


def load_latest(run_dir: Path, rank: int, peers: int) -> dict | None:
    """This peer's state at the newest complete checkpoint, or None when there is none."""
    steps = complete_steps(run_dir, peers)
    if not steps:
        return None
    return torch.load(_step_dir(run_dir, steps[-1]) / f"rank{rank}.pt", weights_only=True)
