"""gpu-check's feature checks: every feature added since the check was first written, each a named check of its own
(a part of experiments/bench/gpu_check.py: its PASS/FAIL line and time), at the same small sizes on the GPU and in
the dry run:
- algorithm:NAME, every algorithm of conf/algorithm/ on the fleet (adpsgd on the event simulator), 4 CNN peers, 8
  steps, the periods cut so that the outer steps and syncs happen in them; diloco also with outer_delay=1, without
  and with eager;
- optimizer:NAME, every base optimizer of conf/optimizer/ (muon: Muon on the CNN head's hidden matrix);
- robust:NAME, every robust rule of conf/robust/, peer 1 sending its values scaled (faults.corrupt_peer=1);
- precision:fp16 and precision:bf16, clipping, 2 micro-batches and a warm-up cosine schedule in the step;
- topology:NAME, every sparse topology of conf/topology/ at 8,192 MLP peers on the fleet, its steps alone (all but
  complete, dense, and base_k, built dense at that size: it runs on 4 CNN peers);
- fleet:channels (4 CNN peers) and the topology checks at 8,192 MLP peers step the fleet's peers as one wide network,
  in the channel and the peer-major layout (dpsgd.sim.wide): vmap's fallback fails them;
- integration:NAME, a tiny run of each trainer of dpsgd/integrations/ (experiments.bench.gpu_trainers), skipped with
  the reason when its extra is not installed.
A fleet check passes when its run ends with status ok and finite losses (the steps alone: finite losses and
parameters, on the device).
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from experiments.bench import gpu_trainers, harness

# 4 CNN peers on CIFAR-shaped images: 256 training images, 8 per step, 8 steps (one epoch)
SMALL = ["backend=fleet", "network=loopback", "data=synthetic_cifar", "data.num_samples=320", "model=cnn"]
SMALL += ["model.width=8", "peers=4", "batch_size=8", "epochs=1", "log_every=4", "comm.timeout_s=600"]
# 8,192 MLP peers, 2 steps of 2 samples each
LARGE = ["backend=fleet", "network=loopback", "data=synthetic", "data.num_samples=40960"]
LARGE += ["model=mlp", "model.hidden=[16]", "peers=8192", "batch_size=2", "epochs=1", "log_every=1000"]
LARGE += ["comm.timeout_s=600"]
CORRUPT = ["faults.corrupt_peer=1", "faults.corrupt_mode=scale"]
STEP = ["clip_grad_norm=1.0", "accumulate=2", "schedule=cosine", "schedule.warmup_steps=2"]
DIRECTED = ("directed_exponential", "one_peer_directed_exponential")  # push-sum's: SGP runs on them


@dataclass(frozen=True)
class Check:
    """A fleet run of `overrides` (composed as the app composes them, the device added), or a trainer's tiny run
    (`trainer`)."""

    overrides: tuple[str, ...] = ()
    trainer: str | None = None
    loop: bool = True  # the app's run (records, evaluations, summary); False: the fleet's steps, in the wide layout


def fleet(*overrides: str) -> Check:
    return Check(tuple(SMALL) + overrides)


def at_8192(topology: str) -> Check:
    algorithm = "sgp" if topology in DIRECTED else "dpsgd"
    return Check((*LARGE, f"topology={topology}", f"algorithm={algorithm}"), loop=False)


ALGORITHMS = {
    "adpsgd": ["topology=ring"],
    "async_local_sgd": ["algorithm.period=2"],
    "desloc": ["algorithm.param_period=2", "algorithm.momentum_period=4", "algorithm.variance_period=8"],
    "diloco": ["algorithm.period=2"],
    "noloco": ["algorithm.period=2"],
    "sparseloco": ["algorithm.period=2"],
    "streaming_diloco": ["algorithm.period=4", "algorithm.fragments=2", "algorithm.delay=1"],
}
ALGORITHM_NAMES = [
    *(
        "adpsgd",
        "async_local_sgd",
        "allreduce",
        "bmuf",
        "choco",
        "d2",
        "demo",
        "desloc",
        "diloco",
        "dpsgd",
        "gradient_tracking",
    ),
    *("local_sgd", "noloco", "qgm", "sgp", "slowmo", "sparseloco", "sparta", "streaming_diloco"),
]
# base_k is left out: it builds its 13 matrices dense at 8,192 peers (64 s and 14 GB on 2 CPU cores); 4 peers run it
TOPOLOGIES = [
    *("directed_exponential", "erdos_renyi", "exponential", "hierarchical", "hypercube"),
    *("one_peer_directed_exponential", "one_peer_exponential", "random_matching", "random_regular", "ring", "star"),
    "torus",
]
CHECKS: dict[str, Check] = {
    **{f"algorithm:{a}": fleet(f"algorithm={a}", *ALGORITHMS.get(a, [])) for a in ALGORITHM_NAMES},
    "diloco:outer_delay": fleet("algorithm=diloco", "algorithm.period=2", "algorithm.outer_delay=1"),
    "diloco:eager": fleet("algorithm=diloco", "algorithm.period=2", "algorithm.outer_delay=1", "algorithm.eager=true"),
    **{f"optimizer:{o}": fleet("algorithm=dpsgd", f"optimizer={o}") for o in ("adam", "adamw", "plain_sgd", "sgd")},
    "optimizer:sign_sgd": fleet("algorithm=dpsgd", "optimizer=sign_sgd"),
    "optimizer:muon": fleet("algorithm=diloco", "algorithm.period=2", "optimizer=muon", "model.hidden=[32]"),
    "robust:clipped_gossip": fleet("algorithm=dpsgd", "robust=clipped_gossip", *CORRUPT),
    "robust:centered_clip": fleet("algorithm=local_sgd", "algorithm.period=2", "robust=centered_clip", *CORRUPT),
    "robust:trimmed_mean": fleet("algorithm=allreduce", "robust=trimmed_mean", *CORRUPT),
    "precision:fp16": fleet("algorithm=dpsgd", "precision=fp16", *STEP),
    "precision:bf16": fleet("algorithm=allreduce", "precision=bf16", *STEP),
    **{f"topology:{t}": at_8192(t) for t in TOPOLOGIES},
    "topology:base_k": fleet("algorithm=dpsgd", "topology=base_k"),
    "fleet:channels": Check((*SMALL, "algorithm=dpsgd"), loop=False),  # the CNN's wide layout (the MLP's: topology:*)
    **{f"integration:{t}": Check(trainer=t) for t in gpu_trainers.TRAINERS},
}
TIMEOUT_S = {"integration": 150, "topology": 90}  # each check's own limit (s) by kind; the others' below
DEFAULT_TIMEOUT_S = 60


def timeout_s(name: str) -> int:
    return TIMEOUT_S.get(name.split(":")[0], DEFAULT_TIMEOUT_S)


def run_check(check: Check, device: str, work: Path) -> dict:
    """One check on `device`: its outcome (passed, and what it measured), or {"skipped": why}."""
    if check.trainer is not None:
        return run_trainer(check.trainer, device)
    if not check.loop:
        return step_fleet(check.overrides, device)
    return run_fleet(check.overrides, device, work)


def step_fleet(overrides: tuple[str, ...], device: str) -> dict:
    """The fleet's steps alone, its peers computed as one wide network (dpsgd.sim.wide; vmap's fallback fails it),
    without the loop's summary and last record: at 8,192 peers these take the topology's spectral gap (ARPACK:
    about 40 s for the ring on 2 CPU cores) and score every peer's own model."""
    from dpsgd.sim import Fleet

    fleet = Fleet(harness.run_config(*overrides, f"device={device}"))
    losses = [fleet.step() for _ in range(fleet.plan.total_steps)]
    finite = all(bool(loss.isfinite().all()) for loss in losses) and bool(fleet.flat().isfinite().all())
    layout, on = ("wide" if fleet._wide is not None else "vmap"), fleet.params[0].device
    return {"passed": finite and on.type == device and layout == "wide", "steps": len(losses), "layout": layout,
            "device": str(on), "train_loss": float(losses[-1].double().mean())}  # fmt: skip


def run_fleet(overrides: tuple[str, ...], device: str, work: Path) -> dict:
    """The app's run on the fleet (the fleet backend's start: its records, evaluations and summary on the device)."""
    from dpsgd import backends

    work.mkdir(parents=True, exist_ok=True)
    summary = backends.get("fleet").start(harness.run_config(*overrides, f"device={device}"), work, [])
    losses = [summary.get("train_loss"), summary.get("test_loss")]
    finite = all(isinstance(v, float) and math.isfinite(v) for v in losses)
    return {"passed": summary.get("status") == "ok" and finite, "status": summary.get("status"),
            "steps": summary.get("steps"), "train_loss": losses[0], "test_loss": losses[1]}  # fmt: skip


def run_trainer(trainer: str, device: str) -> dict:
    """The trainer's tiny run in a process of its own (each trainer keeps global state), or why it is skipped."""
    extra = gpu_trainers.EXTRAS[trainer]
    if importlib.util.find_spec(extra) is None:
        return {"skipped": f"the {extra} extra is not installed (pip install -e '.[{trainer}]')"}
    cmd = [sys.executable, "-m", "experiments.bench.gpu_trainers", trainer, "--device", device]
    proc = subprocess.run(cmd, cwd=harness.ROOT, capture_output=True, text=True, timeout=timeout_s(trainer) - 10)
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()] or ["(no output)"]
        return {"passed": False, "error": f"exited {proc.returncode}: {lines[-1]}"}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"passed": gpu_trainers.passed(result, device), **result}
