"""Checkpoints of a whole world: every peer's file for one step, and a marker that all are complete.

Layout: RUN_DIR/checkpoints/step_00000120/rank{r}.pt for each peer, its rank{r}.sha256 (size and
digest of the .pt, written after it), then COMPLETE (written by rank 0 after a barrier, so it exists
only once every peer's files do). Files are written to a temporary name, fsynced and renamed: a peer
killed while writing leaves no torn file under the real name. A step is resumed from only if it is
complete: COMPLETE is there, and every peer's file is there with the size and digest it was written
with (a truncated or altered file makes the step torn, and the previous complete step is used).
Every peer checks every file, so all peers choose the same step. A run resumes only from a checkpoint
of its own peer count, except an elastic run (dpsgd.elastic), which resumes from the newest complete
checkpoint of any count. Loading uses torch.load(weights_only=True): a checkpoint cannot run code.

In a user's own loop: `save(comm, folder, step, state)` on every peer at the same step, and at the start
`restore(comm, folder)`, the newest step every peer completed and this peer's state, or None.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from pathlib import Path

import torch

from dpsgd import runfiles

KEEP = 2  # complete checkpoints kept; older ones are deleted once a newer one is complete


def _step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


def save(comm, run_dir: Path, step: int, state: dict) -> None:
    """Every peer calls this at the same step with its own state (tensors, numbers, strings, lists and dicts
    of them: what `model.state_dict()`, an optimizer's and a scheduler's `state_dict()` hold); it returns
    once every peer's file is written and rank 0 has marked the step complete."""
    folder = _step_dir(run_dir, step)
    runfiles.make_folder(folder)
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    runfiles.write_atomic(folder / f"rank{comm.rank}.pt", data)
    digest = f"{len(data)} {hashlib.sha256(data).hexdigest()}\n".encode()
    runfiles.write_atomic(folder / f"rank{comm.rank}.sha256", digest)
    comm.barrier()
    if comm.rank == 0:
        runfiles.write_atomic(folder / "COMPLETE", json.dumps({"step": step, "peers": comm.size}).encode())
        for old in complete_steps(run_dir, verify=False)[:-KEEP]:  # of any peer count (elastic runs)
            shutil.rmtree(_step_dir(run_dir, old), ignore_errors=True)


def complete_steps(run_dir: Path, peers: int | None = None, verify: bool = True) -> list[int]:
    """Steps with a complete checkpoint of all `peers` (None: of as many peers as wrote it), oldest first
    (`verify`: every file's size and digest checked too, which reads every file)."""
    return [step for step, why in survey(run_dir, peers, verify) if step is not None and why is None][::-1]


def survey(run_dir: Path, peers: int | None = None, verify: bool = True) -> list[tuple[int | None, str | None]]:
    """Every checkpoint folder of the run, newest first: (its step, None when it is complete, else why it cannot be
    resumed by `peers` peers: `torn`'s reason). The step is the folder's (None for a folder whose name is not a
    step's)."""
    found: list[tuple[int | None, str | None]] = []
    folders = []
    for f in (Path(run_dir) / "checkpoints").glob("step_*"):  # none without that folder
        name = f.name.removeprefix("step_")
        if name.isdigit():
            folders.append((int(name), f))
        else:
            found.append((None, f"{f.name} is not a checkpoint folder"))
    for step, f in sorted(folders, reverse=True):
        try:
            why = torn(f, peers, verify)
        except OSError:  # removed while read: rank 0 prunes old steps while others (a signal's handler) list them
            continue
        found.append((step, why))
    return found


def torn(folder: Path, peers: int | None = None, verify: bool = True) -> str | None:
    """Why the checkpoint in `folder` cannot be resumed by `peers` peers (None: by as many as wrote it),
    or None when it is complete."""
    marker = folder / "COMPLETE"
    if not marker.exists():
        return "no COMPLETE marker (a peer died before every peer had written its file)"
    try:
        info = json.loads(marker.read_text())
        written, step = int(info["peers"]), int(info["step"])
    except (OSError, ValueError, TypeError, KeyError):
        return "COMPLETE marker unreadable"
    if folder.name.removeprefix("step_").lstrip("0") != str(step).lstrip("0"):
        return f"COMPLETE marker names step {step}, not the folder's"
    if peers is not None and written != peers:
        return f"written by {written} peers, not {peers}"
    for r in range(written):
        pt, sidecar = folder / f"rank{r}.pt", folder / f"rank{r}.sha256"
        if not pt.exists() or not sidecar.exists():
            return f"rank{r}.pt or its digest is missing"
        try:
            size, digest = sidecar.read_text().split()
            int(size)
        except (ValueError, UnicodeDecodeError):
            return f"rank{r}.sha256 unreadable (altered)"
        if pt.stat().st_size != int(size):
            return f"rank{r}.pt has {pt.stat().st_size} bytes, {size} were written (truncated)"
        if verify and hashlib.sha256(pt.read_bytes()).hexdigest() != digest:
            return f"rank{r}.pt does not match its digest (altered)"
    return None


def load_latest(run_dir: Path, rank: int, peers: int) -> dict | None:
    """This peer's state at the newest complete checkpoint, or None when there is none. Every peer
    reaches the same answer (each checks all files); newer torn steps are skipped, never mixed in."""
    steps = complete_steps(run_dir, peers)
    return load(run_dir, steps[-1], rank) if steps else None


def newest(run_dir: Path) -> tuple[int, int] | None:
    """(step, peers) of the newest complete checkpoint of any peer count, or None (elastic runs)."""
    steps = complete_steps(run_dir)
    if not steps:
        return None
    return steps[-1], int(json.loads((_step_dir(run_dir, steps[-1]) / "COMPLETE").read_text())["peers"])


def restore(comm, run_dir: Path) -> tuple[int, dict] | None:
    """(step, this peer's state) of the newest checkpoint that every peer of this world completed, or None
    for a fresh start. Every peer calls it and reaches the same step; a torn newer one is skipped."""
    steps = complete_steps(run_dir, comm.size)
    return (steps[-1], load(run_dir, steps[-1], comm.rank)) if steps else None


def load(run_dir: Path, step: int, rank: int) -> dict:
    """Peer `rank`'s state in the checkpoint of `step` (one that `complete_steps` lists)."""
    return torch.load(_step_dir(run_dir, step) / f"rank{rank}.pt", weights_only=True)
