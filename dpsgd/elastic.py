"""Elastic runs (`elastic=true`): when the world re-forms with another number of peers, every peer of the
new world continues from the newest complete checkpoint, whatever peer count wrote it.

How it works: docs/guide/internals.md#elastic.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from dpsgd import checkpoint
from dpsgd.config import Choice

EVENT = "membership"
"""The `event` of a metrics.jsonl record saying the world re-formed (its `old_peers`, `new_peers` and `step`)."""


def supported(algorithm_cls) -> bool:
    """Whether an optimizer class has a rule for a changing peer count."""
    return bool(getattr(algorithm_cls, "elastic", False))


def resume_state(run_dir: Path, rank: int, size: int) -> dict | None:
    """Peer `rank`'s state in a world of `size` peers from the newest complete checkpoint (any peer
    count), or None when there is none. `state["elastic_from"]` holds the count that wrote it."""
    found = checkpoint.newest(run_dir)
    if found is None:
        return None
    step, written_by = found
    survivors = min(written_by, size)
    if rank < survivors:
        state = checkpoint.load(run_dir, step, rank)
    else:
        states = [checkpoint.load(run_dir, step, r) for r in range(survivors)]
        state = dict(states[0])
        state["model"] = average_models([s["model"] for s in states])
        state["optimizer"] = {**state["optimizer"], "state": {}}  # the base's moments start at zero
        state["comm_stats"] = {}  # its traffic starts at zero
    if written_by != size:
        state.pop("batches")  # a new share: drawn afresh (SynchronousRun.begin)
    return {**state, "elastic_from": written_by}


def average_models(models: list[dict]) -> dict:
    """The mean of model state dicts (floating tensors; counters such as BatchNorm's from the first)."""
    return {
        key: torch.stack([m[key] for m in models]).mean(0) if value.is_floating_point() else value.clone()
        for key, value in models[0].items()
    }


def membership_record(run_dir: Path, step: int, size: int, written_by: int) -> dict:
    """The metrics.jsonl record of a world of `size` peers formed from the checkpoint of `step`: the
    previous world's size is the newest such record's, else the checkpoint's writers'."""
    previous = written_by
    metrics = Path(run_dir) / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            record = json.loads(line) if line.strip() else {}
            if record.get("event") == EVENT:
                previous = record["new_peers"]
    return {
        "step": step,
        "event": EVENT,
        "old_peers": previous,
        "new_peers": size,
        "checkpoint_peers": written_by,
        "unix_time": time.time(),  # when the new world began: recovery time = this - the loss
    }


def check_world(topology: Choice, size: int) -> None:
    """The config's topology for a re-formed world of `size` peers, or a one-line error."""
    from dpsgd.build import build_topology

    try:
        build_topology(topology, size)
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"elastic: the world re-formed with {size} peers, but topology {topology.name!r} "
            f"cannot be built for {size}: {exc}; choose a topology every peer count can build (ring, "
            f"exponential, complete)"
        ) from None
