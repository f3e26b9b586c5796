"""Hydra sweeps run from Python (tuning, reproductions): each sweep is one `experiments.train -m` process whose
output goes to a log beside its folder; a folder that already holds its runs is read instead of rerun."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def run_sweep(args: list[str], sweep_dir: Path) -> None:
    """`python -m experiments.train -m ARGS` into `sweep_dir`; its output in SWEEP_DIR.log; exits with the log's tail
    on failure."""
    log = sweep_dir.with_suffix(".log")
    sweep_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "experiments.train", "-m", *args, f"hydra.sweep.dir={sweep_dir}"]
    with log.open("w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise SystemExit(f"error: a sweep failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}\n(all of it: {log})")


def finished(sweep_dir: Path, runs: int) -> bool:
    """The sweep already holds its runs (the same command run again, e.g. after an interruption): read, not rerun."""
    return len(list(sweep_dir.rglob("summary.json"))) >= runs
