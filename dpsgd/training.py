"""The training loop every backend runs: one peer's side of an experiment.

`train(comm, cfg, out_dir)` builds data share, model, topology and optimizer from a resolved
config (a plain dict), takes `epochs` passes over the peer's share, logs uniform metrics every
`log_every` steps, and returns the summary. Rank 0 writes `metrics.jsonl` and `summary.json`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from torch import nn

import topologies
from dpsgd import data, metrics, models
from dpsgd.comm import Communicator
from dpsgd.optim import build, build_base

BASE_KEYS = ("name", "optimizer", "lr", "momentum", "weight_decay", "nesterov")


def topology_options(cfg_topology: dict) -> dict:
    """The options of `topologies.make` a topology config sets (unset ones are left to defaults)."""
    return {k: v for k, v in cfg_topology.items() if k != "name" and v is not None}


def build_topology(cfg: dict, n: int):
    return topologies.make(cfg["topology"]["name"], n, **topology_options(cfg["topology"]))


def write_json_atomic(path: Path, obj) -> None:
    """Write-then-rename: a reader never sees a half-written file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def train(comm: Communicator, cfg: dict, out_dir: str | Path | None = None) -> dict:
    seed, algo = int(cfg["seed"]), cfg["algorithm"]
    device = torch.device(cfg.get("device", "cpu"))
    split = data.load(cfg["data"]["name"], cfg["data"].get("test_fraction", 0.2), seed)
    share = data.partition(len(split.x_train), comm.size, seed)[comm.rank]
    x_test, y_test = split.x_test.to(device), split.y_test.to(device)
    batches = data.Batches(split.x_train[share].to(device), split.y_train[share].to(device),
                           int(cfg["batch_size"]), seed=seed * 1000 + comm.rank + 1)
    model = models.build(cfg["model"]["name"], split.input_shape, split.num_classes, seed,
                         hidden=cfg["model"].get("hidden")).to(device)
    topology = build_topology(cfg, comm.size)
    base = build_base(model.parameters(), name=algo.get("optimizer", "sgd"), lr=float(algo["lr"]),
                      momentum=float(algo.get("momentum", 0.0)), weight_decay=float(algo.get("weight_decay", 0.0)),
                      nesterov=bool(algo.get("nesterov", False)))
    options = {k: v for k, v in algo.items() if k not in BASE_KEYS}
    opt = build(algo["name"], base, comm, topology, **options)

    total_steps = int(cfg["epochs"]) * batches.steps_per_epoch
    log_every = max(1, int(cfg.get("log_every", batches.steps_per_epoch)))
    writer = out_dir is not None and comm.rank == 0
    if writer:
        out_dir = Path(out_dir)
        log_file = (out_dir / "metrics.jsonl").open("w")
    loss_fn = nn.CrossEntropyLoss()
    comm.barrier()  # start the clock together
    start = time.perf_counter()
    running, seen = 0.0, 0
    record: dict = {}
    for step in range(1, total_steps + 1):
        comm.context = f"step {step}"
        x, y = batches.next()
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        running, seen = running + loss.item(), seen + 1
        if step % log_every == 0 or step == total_steps:
            comm.context = f"metrics at step {step}"
            record = {
                "step": step,
                "epoch": step / batches.steps_per_epoch,
                "samples": step * batches.batch_size * comm.size,
                "wall_time_s": time.perf_counter() - start,
                "emulated_time_s": None,  # set once a network is emulated (dpsgd.netem)
                **metrics.snapshot_metrics(comm, model, x_test, y_test, running / seen),
                **metrics.traffic(comm),
            }
            running, seen = 0.0, 0
            if writer:
                log_file.write(json.dumps(record) + "\n")
                log_file.flush()
    wall = time.perf_counter() - start
    summary = {
        "algorithm": algo["name"],
        "topology": cfg["topology"]["name"],
        "peers": comm.size,
        "backend": comm.backend,
        "seed": seed,
        "steps": total_steps,
        "spectral_gap": float(topologies.analysis.spectral_gap(topology)),
        **{k: v for k, v in record.items() if k not in ("step", "emulated_time_s")},
        "wall_time_s": wall,
        "samples_per_s": total_steps * batches.batch_size * comm.size / wall,
    }
    if writer:
        log_file.close()
        write_json_atomic(out_dir / "summary.json", summary)
    return summary
