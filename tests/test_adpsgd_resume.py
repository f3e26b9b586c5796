"""AD-PSGD resumes from checkpoints (budget=steps: every peer reaches each checkpoint step). One peer
has a deterministic schedule: the resumed run ends with the uninterrupted run's numbers. Several real
peers average in an order that timing decides: the resumed run is statistically equivalent (same
steps, accuracy within a few points). A partner killed mid-run is named as on the synchronous path."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from runs import summary

from dpsgd import checkpoint
from dpsgd.optim.base import STATE_KEY

ADPSGD = ["algorithm=adpsgd", "algorithm.budget=steps", "log_every=5", "checkpoint.every=10"]
TIMINGS = {"wall_time_s", "comm_time_s", "comm_overlap_s", "wait_s_mean", "samples_per_s"}


def records(run_dir: Path) -> list[str]:
    """metrics.jsonl without its timings (also those in the final record's `adpsgd` block), as JSON text
    (NaN equal to NaN)."""

    def timeless(d: dict) -> dict:
        return {k: timeless(v) if isinstance(v, dict) else v for k, v in d.items() if k not in TIMINGS}

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.dumps(timeless(json.loads(line))) for line in lines]


def run(app, args: list[str], run_dir: Path) -> subprocess.CompletedProcess:
    return app(args, run_dir, timeout=150)


@pytest.mark.processes
@pytest.mark.timeout(200)
def test_one_peer_resumes_to_the_numbers_of_an_uninterrupted_run(app, tmp_path):
    args = [*ADPSGD, "backend=local", "peers=1", "epochs=1"]
    full, killed = tmp_path / "full", tmp_path / "killed"
    assert run(app, args, full).returncode == 0
    proc = run(app, [*args, "faults.kill_peer=0", "faults.at_step=25"], killed)
    assert proc.returncode == 1 and "peer 0 exited at step 25" in proc.stderr, proc.stderr
    assert checkpoint.complete_steps(killed, 1) == [10, 20]
    proc = run(app, [*args, "resume=true"], killed)
    assert proc.returncode == 0, proc.stderr
    a, b = summary(full), summary(killed)
    for key in ("steps", "samples", "test_accuracy", "test_loss", "train_loss"):
        assert json.dumps(a[key]) == json.dumps(b[key]), key  # NaN == NaN too
    assert a["adpsgd"]["steps_per_peer"] == b["adpsgd"]["steps_per_peer"]
    assert a["adpsgd"]["staleness_histogram"] == b["adpsgd"]["staleness_histogram"]
    assert records(full) == records(killed)


@pytest.mark.slow  # make soak: three runs of two MPI peers (about 45 s)
@pytest.mark.processes
@pytest.mark.timeout(300)
def test_mpi_partner_killed_is_named_and_the_run_resumes(app, tmp_path):
    args = [*ADPSGD, "backend=mpi", "peers=2", "epochs=3", "comm.timeout_s=10"]
    full, killed = tmp_path / "full", tmp_path / "killed"
    proc = run(app, args, full)
    assert proc.returncode == 0, proc.stderr
    proc = run(app, [*args, "faults.kill_peer=1", "faults.at_step=35"], killed)
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "peer 1 died at step 35 without an error message (Killed (signal 9))" in lines[0], lines[0]
    assert checkpoint.complete_steps(killed, 2) == [20, 30]
    algo = [checkpoint.load_latest(killed, r, 2)["optimizer"][STATE_KEY] for r in range(2)]
    for s in algo:  # each peer's x, counters and generators are in its checkpoint (the base's state beside)
        assert s["step_count"] == 30 and s["samples"] == 30 * 32 and len(s["partner_rng"]) == 625
        assert s["live"].shape == algo[0]["live"].shape
    # no averaging half done: the active peer's initiated ones are the passive one's served ones
    assert sum(s["initiated"] for s in algo) == sum(s["served"] for s in algo) > 0
    proc = run(app, [*args, "resume=true"], killed)
    assert proc.returncode == 0, proc.stderr
    a, b = summary(full), summary(killed)
    print(f"\nAD-PSGD mpi x2: test accuracy {a['test_accuracy']:.4f} uninterrupted, {b['test_accuracy']:.4f} resumed")
    assert a["steps"] == b["steps"] and a["adpsgd"]["steps_per_peer"] == b["adpsgd"]["steps_per_peer"]
    assert a["samples"] == b["samples"]
    assert abs(a["test_accuracy"] - b["test_accuracy"]) < 0.05
    assert sum(b["adpsgd"]["staleness_histogram"]) == sum(b["adpsgd"]["steps_per_peer"])
    assert b["adpsgd"]["averagings"] == sum(b["adpsgd"]["averagings_served_per_peer"])
    steps = [json.loads(r)["step"] for r in records(killed)]
    assert steps == sorted(steps) and steps.count(30) == 1  # the records before the checkpoint kept once


def test_checkpoints_of_an_asynchronous_run_need_a_steps_budget(hydra_config):
    from experiments.validate import ConfigError, validate

    validate(hydra_config("algorithm=adpsgd", "algorithm.budget=steps", "checkpoint.every=10"))
    with pytest.raises(ConfigError, match="checkpoint.every needs algorithm.budget=steps .* got budget='samples'"):
        validate(hydra_config("algorithm=adpsgd", "algorithm.budget=samples", "checkpoint.every=10"))
