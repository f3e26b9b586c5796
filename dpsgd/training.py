"""The training loop every backend runs: one peer's side of an experiment.

`train(comm, cfg, out_dir)` builds the peer's parts from a resolved config (dpsgd.build), takes
`epochs` passes over the training set, logs uniform metrics every
`log_every` steps, checkpoints every `checkpoint.every` steps, and returns the summary. Rank 0
writes `metrics.jsonl` and `summary.json`. With `resume: true` it continues from the newest
complete checkpoint in `out_dir` and ends with the numbers of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

from dpsgd import checkpoint, data, metrics
from dpsgd.build import build_peer
from dpsgd.comm import Communicator


def _progress(enabled: bool, total: int):
    if not enabled:
        return nullcontext(None)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    TextColumn("{task.fields[status]}"), transient=True)


def train(comm: Communicator, cfg: dict, out_dir: str | Path | None = None) -> dict:
    if cfg["algorithm"]["name"] == "adpsgd":  # no global step: its own loop
        from dpsgd.training_async import train_async

        return train_async(comm, cfg, out_dir)
    peer = build_peer(comm, cfg)
    split, batches, model, opt = peer.split, peer.batches, peer.model, peer.optimizer
    x_test, y_test = peer.x_test, peer.y_test
    steps_per_epoch, total_steps = peer.steps_per_epoch, peer.total_steps
    log_every = int(cfg.get("log_every") or steps_per_epoch)
    ckpt_every = int((cfg.get("checkpoint") or {}).get("every") or 0)
    writer = out_dir is not None and comm.rank == 0
    out_dir = Path(out_dir) if out_dir is not None else None

    step, running, seen, elapsed, emulated = 0, 0.0, 0, 0.0, 0.0
    target = cfg.get("target_accuracy")
    reached: dict = {}  # the first record at or above the target accuracy
    if cfg.get("resume") and out_dir is not None:
        state = checkpoint.load_latest(out_dir, comm.rank, comm.size)
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            batches.load_state_dict(state["batches"])
            step, running, seen, elapsed = state["step"], state["running"], state["seen"], state["elapsed"]
            reached = state["reached"]
            emulated = state.get("emulated_time_s", 0.0)
            for key, value in state["comm_stats"].items():
                setattr(comm.stats, key, value)
    if writer:
        records = []
        if step and (out_dir / "metrics.jsonl").exists():  # keep what was logged up to the checkpoint
            records = [r for r in (out_dir / "metrics.jsonl").read_text().splitlines() if r.strip()
                       and json.loads(r)["step"] <= step]
        log_file = (out_dir / "metrics.jsonl").open("w")
        log_file.write("".join(r + "\n" for r in records))

    show = comm.rank == 0 and os.environ.get("DPSGD_PROGRESS", "1" if sys.stdout.isatty() else "0") == "1" \
        and not os.environ.get("CI")
    comm.barrier()  # start the clock together
    start = time.perf_counter() - elapsed
    peer.network.clock.reset(emulated)
    record: dict = {}
    with _progress(show, total_steps) as bar:
        task = bar.add_task("train", total=total_steps, completed=step, status="") if bar else None
        while step < total_steps:
            step += 1
            comm.context = f"step {step}"
            peer.before_step(step)
            running, seen = running + peer.train_step(), seen + 1
            if step % log_every == 0 or step == total_steps:
                comm.context = f"metrics at step {step}"
                record = {
                    "step": step,
                    "epoch": step / steps_per_epoch,
                    "samples": step * batches.batch_size * comm.size,
                    "wall_time_s": time.perf_counter() - start,
                    **metrics.snapshot_metrics(comm, model, x_test, y_test, running / seen),
                    **metrics.traffic(comm),
                }
                running, seen = 0.0, 0
                if target is not None and not reached and record["test_accuracy"] >= target:
                    reached = {"steps_to_target": step, "time_to_target_s": record["wall_time_s"],
                               "emulated_time_to_target_s": record["emulated_time_s"],
                               "samples_to_target": record["samples"], "mb_sent_to_target": record["mb_sent_per_peer"]}
                if writer:
                    log_file.write(json.dumps(record) + "\n")
                    log_file.flush()
                if bar:
                    bar.update(task, status=f"acc {record['test_accuracy']:.3f}  loss {record['train_loss']:.3f}")
            if bar:
                bar.update(task, completed=step)
            if ckpt_every and out_dir is not None and step % ckpt_every == 0 and step < total_steps:
                checkpoint.save(comm, out_dir, step, {
                    "step": step, "model": model.state_dict(), "optimizer": opt.state_dict(),
                    "batches": batches.state_dict(), "running": running, "seen": seen,
                    "elapsed": time.perf_counter() - start, "comm_stats": comm.stats.as_dict(),
                    "emulated_time_s": peer.network.clock.elapsed(),
                    "reached": reached})
    wall = time.perf_counter() - start
    summary = {
        **peer.describe(cfg, comm),
        "steps": total_steps,
        **{k: v for k, v in record.items() if k != "step"},
        "wall_time_s": wall,
        "emulated_s_per_step": record["emulated_time_s"] / total_steps if record.get("emulated_time_s") else None,
        "samples_per_s": total_steps * batches.batch_size * comm.size / wall,
        **({"target_accuracy": target, **(reached or {"steps_to_target": None, "time_to_target_s": None})}
           if target is not None else {}),
        "class_histograms": [data.class_histogram(split.y_train[s], split.num_classes) for s in peer.shares],
    }
    if writer:
        log_file.close()
        checkpoint.write_json_atomic(out_dir / "summary.json", summary)
    return summary
