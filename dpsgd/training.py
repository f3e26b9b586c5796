"""The training loop every backend runs: one peer's side of an experiment.

`train(comm, cfg, out_dir)` builds data share, model, topology and optimizer from a resolved
config (a plain dict), takes `epochs` passes over the training set, logs uniform metrics every
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

import torch

import topologies
from dpsgd import checkpoint, data, metrics, models, netem
from dpsgd.comm import Communicator
from dpsgd.optim import build, build_base

BASE_KEYS = ("name", "optimizer", "lr", "momentum", "weight_decay", "nesterov")


def topology_options(cfg_topology: dict) -> dict:
    """The options of `topologies.make` a topology config sets (unset ones are left to defaults)."""
    return {k: v for k, v in cfg_topology.items() if k != "name" and v is not None}


def build_topology(cfg: dict, n: int):
    return topologies.make(cfg["topology"]["name"], n, **topology_options(cfg["topology"]))


def load_data(cfg: dict) -> data.Split:
    d = cfg["data"]
    options = {k: d[k] for k in ("root", "num_samples", "num_features", "num_classes", "seq_len")
               if d.get(k) is not None}
    return data.load(d["name"], d.get("test_fraction", 0.2), int(cfg["seed"]), **options)


def partition(cfg: dict, split: data.Split, peers: int) -> list:
    d = cfg["data"]
    return data.partition(split.y_train.numpy(), peers, int(cfg["seed"]), d.get("partition", "iid"),
                          alpha=float(d.get("alpha", 0.5)), shards_per_peer=int(d.get("shards_per_peer", 2)),
                          min_size=int(cfg["batch_size"]))


def write_json_atomic(path: Path, obj) -> None:
    """Write-then-rename: a reader never sees a half-written file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


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
    seed, algo = int(cfg["seed"]), cfg["algorithm"]
    device = torch.device(cfg.get("device", "cpu"))
    split = load_data(cfg)
    shares = partition(cfg, split, comm.size)
    share = shares[comm.rank]
    x_test, y_test = split.x_test.to(device), split.y_test.to(device)
    batches = data.Batches(split.x_train[share].to(device), split.y_train[share].to(device),
                           int(cfg["batch_size"]), seed=seed * 1000 + comm.rank + 1)
    model_cfg = {k: v for k, v in cfg["model"].items() if k != "name" and v is not None}
    model = models.build(cfg["model"]["name"], split.input_shape, split.num_classes or 1, seed, **model_cfg).to(device)
    topology = build_topology(cfg, comm.size)
    base = build_base(model.parameters(), name=algo.get("optimizer", "sgd"), lr=float(algo["lr"]),
                      momentum=float(algo.get("momentum", 0.0)), weight_decay=float(algo.get("weight_decay", 0.0)),
                      nesterov=bool(algo.get("nesterov", False)))
    options = {k: v for k, v in algo.items() if k not in BASE_KEYS}
    opt = build(algo["name"], base, comm, topology, **options)
    loss_fn = metrics.loss_function(split.y_train)
    slowdown = netem.ComputeSlowdown.from_config(cfg.get("network"), comm.rank, comm.size)  # stragglers

    # every peer takes the same number of steps; an epoch is one pass over the whole training set
    steps_per_epoch = max(1, len(split.x_train) // (comm.size * batches.batch_size))
    total_steps = int(cfg["epochs"]) * steps_per_epoch
    log_every = int(cfg.get("log_every") or steps_per_epoch)
    ckpt_every = int((cfg.get("checkpoint") or {}).get("every") or 0)
    writer = out_dir is not None and comm.rank == 0
    out_dir = Path(out_dir) if out_dir is not None else None

    step, running, seen, elapsed = 0, 0.0, 0, 0.0
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
    record: dict = {}
    with _progress(show, total_steps) as bar:
        task = bar.add_task("train", total=total_steps, completed=step, status="") if bar else None
        while step < total_steps:
            step += 1
            comm.context = f"step {step}"
            x, y = batches.next()
            slowdown.start()
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            slowdown.finish()
            opt.step()
            running, seen = running + loss.item(), seen + 1
            if step % log_every == 0 or step == total_steps:
                comm.context = f"metrics at step {step}"
                record = {
                    "step": step,
                    "epoch": step / steps_per_epoch,
                    "samples": step * batches.batch_size * comm.size,
                    "wall_time_s": time.perf_counter() - start,
                    "emulated_time_s": None,  # set once a network is emulated (dpsgd.netem)
                    **metrics.snapshot_metrics(comm, model, x_test, y_test, running / seen),
                    **metrics.traffic(comm),
                }
                running, seen = 0.0, 0
                if target is not None and not reached and record["test_accuracy"] >= target:
                    reached = {"steps_to_target": step, "time_to_target_s": record["wall_time_s"],
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
                    "reached": reached})
    wall = time.perf_counter() - start
    summary = {
        "algorithm": algo["name"],
        "topology": cfg["topology"]["name"],
        "peers": comm.size,
        "backend": comm.backend,
        "dataset": cfg["data"]["name"],
        "partition": cfg["data"].get("partition", "iid"),
        "model": cfg["model"]["name"],
        "seed": seed,
        "steps": total_steps,
        "spectral_gap": float(topologies.analysis.spectral_gap(topology)),
        **{k: v for k, v in record.items() if k not in ("step", "emulated_time_s")},
        "wall_time_s": wall,
        "samples_per_s": total_steps * batches.batch_size * comm.size / wall,
        **({"target_accuracy": target, **(reached or {"steps_to_target": None, "time_to_target_s": None})}
           if target is not None else {}),
        "class_histograms": [data.class_histogram(split.y_train[s], split.num_classes) for s in shares],
    }
    if writer:
        log_file.close()
        write_json_atomic(out_dir / "summary.json", summary)
    return summary
