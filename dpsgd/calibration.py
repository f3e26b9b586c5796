"""The compute time of a workload's step on an emulated clock, measured once and kept, so that emulated times are a
function of the config and the seed, not of how busy the machine was while the run ran.

An emulated network in model mode (`network.mode=model`) puts each step's compute on the clock. Which compute is
`network.compute` (with `network.compute_time=0`; a `compute_time` > 0 is given and used as it is):
- `calibrated` (the default): the workload's compute time per step (forward and backward of one peer's batch, one
  thread, as a peer computes), measured once on this machine and kept in a cache (`$DPSGD_CACHE`, else
  ~/.cache/dpsgd/compute_times.json) under the workload's key: model, data, batch, precision, micro-batches,
  device, torch version and machine. Every run of the workload, whatever the machine's load then, takes it.
- `measured`: each step's own measured compute (the clock then moves with the machine's load; the summary says so).
`resolved(run)` gives the run with `network.compute_time` set where it is calibrated; `compute_words(run)` says
which compute an emulated clock takes (the summary's `emulated_compute`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import platform
import time
from pathlib import Path

import torch

from dpsgd import build, metrics
from dpsgd.comm.netem import NetworkEmulator
from dpsgd.config import RunConfig

MODES = ("calibrated", "measured")
WARMUP, STEPS = 3, 30  # steps measured after the warm-up: the fastest is the workload's
# The fastest step, not the median: on a loaded machine (2 cores, load 5: the median of the CNN's step measured
# 12.5 ms and 2.3 ms a minute apart, the fastest 2.8 and 2.0) most steps are slowed by others' work, and the
# median would keep that slowdown for every later run; the fastest is what a step takes when nothing else runs.
METHOD = f"fastest of {STEPS}"


def cache_path() -> Path:
    return Path(os.environ.get("DPSGD_CACHE") or Path.home() / ".cache" / "dpsgd") / "compute_times.json"


def emulates_compute(run: RunConfig) -> bool:
    """Whether an emulated clock takes the run's compute: an active network in model mode."""
    return run.network.mode == "model" and NetworkEmulator.from_config(run.network).active


def key(run: RunConfig) -> str:
    """The workload's key: what one peer's step computes, and where."""
    parts = {
        "model": run.model.as_dict(),
        "data": dataclasses.asdict(run.data),
        "batch_size": run.batch_size,
        "precision": run.precision,
        "accumulate": run.accumulate,
        "device": run.device,
        "torch": torch.__version__,
        "machine": f"{platform.node()} {platform.machine()} {platform.processor()} {os.cpu_count()} cores",
        "method": METHOD,  # a value measured another way is measured again
    }
    return json.dumps(parts, sort_keys=True, default=str)


def measure(run: RunConfig) -> float:
    """Seconds of one peer's forward and backward pass on its batch (one thread, peer 0's share): the fastest of
    STEPS after a warm-up."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        parts = build.plan(run, run.peers)
        device = torch.device("cpu") if run.device == "cpu" else torch.device(run.device)
        model = build.build_model(run.model, parts.split, run.seed, run.data.name).to(device)
        loss_fn = metrics.loss_function(parts.split.y_train)
        options = build.step_options(run)
        batches = parts.batches(0, device)
        times = []
        for _ in range(WARMUP + STEPS):
            x, y = batches.next()
            start = time.perf_counter()
            model.zero_grad()
            for xm, ym in options.split(x, y):
                with options.autocast(device):
                    loss = loss_fn(model(xm), ym)
                loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return min(times[WARMUP:])
    finally:
        torch.set_num_threads(threads)


def calibrated(run: RunConfig) -> float:
    """The workload's compute seconds per step: from the cache, else measured now and kept (under a file lock, so
    that peers starting together measure it once)."""
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        table = _read(path)
        workload = key(run)
        if workload not in table:
            table[workload] = measure(run)
            temporary = path.with_name(f".{path.name}.tmp")
            temporary.write_text(json.dumps(table, indent=1, sort_keys=True))
            os.replace(temporary, path)
        return float(table[workload])


def _read(path: Path) -> dict:
    with contextlib.suppress(OSError, ValueError):
        table = json.loads(path.read_text())
        if isinstance(table, dict):
            return table
    return {}


def resolved(run: RunConfig) -> RunConfig:
    """`run` with its emulated clock's compute fixed: `network.compute_time` the calibrated one where the clock takes
    the compute and none is given (see the module)."""
    network = run.network
    if network.compute not in MODES:
        raise ValueError(f"network.compute must be one of {', '.join(MODES)}, got {network.compute!r}")
    if network.compute_time > 0 or network.compute != "calibrated" or network.calibrated_s is not None:
        return run  # given, measured, or calibrated already (the driver did it; a resume keeps its run's)
    if not emulates_compute(run):
        return run
    return run.replace(network=dataclasses.replace(network, calibrated_s=calibrated(run)))


def compute_words(run: RunConfig) -> str | None:
    """Which compute the run's emulated clock takes, for its summary (None: no clock takes it)."""
    network = run.network
    if not emulates_compute(run):
        return None
    if network.compute_time > 0:
        return f"{network.compute_time:.6g} s a step (given: network.compute_time)"
    if network.calibrated_s is not None:
        return f"{network.calibrated_s:.6g} s a step (calibrated once for the workload on this machine)"
    return "measured each step (network.compute=measured: moves with the machine's load)"
