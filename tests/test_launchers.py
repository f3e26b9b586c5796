"""Hydra launchers a cluster user takes: submitit (its local executor here; Slurm where present)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def sweep(app, launcher: str, sweep_dir: Path, *extra: str, timeout: int = 300):
    args = [
        "-m",
        f"hydra/launcher={launcher}",
        "algorithm=allreduce,dpsgd",
        "epochs=2",
        f"hydra.sweep.dir={sweep_dir}",
        *extra,
    ]
    return app(args, timeout=timeout)


@pytest.mark.slow  # soak: a whole sweep through submitit
def test_submitit_local_runs_a_sweep(app, tmp_path):
    proc = sweep(app, "local_submitit", tmp_path, "backend=local")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.parent.name for p in tmp_path.glob("*/summary.json")) == ["0", "1"]


def _slurm_up() -> str | None:
    if not shutil.which("sbatch") or not shutil.which("sinfo"):
        return "slurm is not installed (no sbatch/sinfo on PATH)"
    try:
        probe = subprocess.run(["sinfo", "-h", "-o", "%P %a"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer in 20 s: no Slurm controller is running"
    if probe.returncode != 0 or " up" not in probe.stdout:
        return f"no Slurm partition is up: {probe.stderr.strip() or probe.stdout.strip()}"
    return None


@pytest.mark.timeout(900)
def test_slurm_runs_a_two_run_sweep(app, tmp_path):
    reason = _slurm_up()
    if reason:
        pytest.skip(reason)
    proc = sweep(app, "slurm", tmp_path, "peers=2", timeout=880)
    assert proc.returncode == 0, proc.stderr
    assert len(list(tmp_path.glob("*/summary.json"))) == 2


@pytest.mark.timeout(300)
def test_srun_starts_the_ranks_of_one_run(app, tmp_path):
    reason = _slurm_up()
    if reason:
        pytest.skip(reason)
    srun = ["srun", "-n", "2", "--mpi=pmi2"]
    proc = app(["backend=mpi", "peers=2", "epochs=2"], tmp_path, srun, timeout=280)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "summary.json").exists()
    assert sorted(p.name for p in tmp_path.glob("*.log")) == ["train_rank0.log", "train_rank1.log"]
