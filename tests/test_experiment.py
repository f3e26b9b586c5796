"""The Hydra app end to end: outputs, the same numbers on every backend and launcher, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from runs import assert_same_numbers, summary

from dpsgd.backends.launch import free_port
from dpsgd.backends.mpi import mpiexec

SHORT = ["epochs=3", "log_every=5"]


def test_default_experiment_local_writes_outputs(app, tmp_path):
    run_dir = tmp_path / "run"
    proc = app(["backend=local"], run_dir)
    assert proc.returncode == 0, proc.stderr
    s = summary(run_dir)
    assert s["algorithm"] == "dpsgd" and s["topology"] == "ring" and s["peers"] == 4
    assert s["test_accuracy"] >= 0.90, s
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == s["steps"] and len(records) >= 10
    for key in (
        "step",
        "epoch",
        "wall_time_s",
        "emulated_time_s",
        "train_loss",
        "test_accuracy",
        "consensus_distance",
        "mb_sent_per_peer",
        "comm_time_s",
    ):
        assert key in records[0]
    assert records[-1]["mb_sent_per_peer"] > records[0]["mb_sent_per_peer"] > 0
    assert (run_dir / "config.yaml").exists() and (run_dir / ".hydra" / "config.yaml").exists()
    assert "test acc (avg model)" in proc.stdout and "dpsgd" in proc.stdout


LAUNCHES = {
    "mpi-self": (["backend=mpi"], None),
    "mpi-user": (["backend=mpi"], lambda: [mpiexec(), "-n", "4"]),
    "torch-self": (["backend=torch"], None),
    "torch-user": (
        ["backend=torch"],
        lambda: [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "4",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),  # not a fixed one: tests run in parallel (make test)
            "--no-python",
        ],
    ),
}


@pytest.fixture(scope="module")
def local_reference(app, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("local") / "run"
    proc = app(["backend=local", *SHORT], run_dir)
    assert proc.returncode == 0, proc.stderr
    return summary(run_dir)


# soak (`make soak`): mpiexec by hand and torch's self-spawn; make test keeps the app's own mpiexec and torchrun by hand
SOAK_LAUNCHES = ("mpi-user", "torch-self")


@pytest.mark.parametrize(
    "launch", [pytest.param(k, marks=pytest.mark.slow) if k in SOAK_LAUNCHES else k for k in LAUNCHES]
)
def test_same_numbers_on_every_backend(app, launch, local_reference, tmp_path):
    args, launcher = LAUNCHES[launch]
    run_dir = tmp_path / "run"
    proc = app(args + SHORT, run_dir, launcher() if launcher else None)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = summary(run_dir)
    assert s["steps"] == local_reference["steps"]
    for key in (
        "test_accuracy",
        "peer_test_accuracy_mean",
        "train_loss",
        "test_loss",
        "consensus_distance",
        "mb_sent_per_peer",
    ):
        assert s[key] == pytest.approx(local_reference[key], rel=1e-4, abs=1e-6), key
    logs = sorted(p.name for p in run_dir.glob("*.log"))
    if launcher:  # every rank wrote into the same folder, each its own log
        assert logs == ["train_rank0.log", "train_rank1.log", "train_rank2.log", "train_rank3.log"], logs


def test_single_peer_runs(app, tmp_path):
    proc = app(["peers=1", "backend=mpi", *SHORT], tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    s = summary(tmp_path / "run")
    assert s["peers"] == 1 and s["consensus_distance"] == 0 and s["mb_sent_per_peer"] == 0


@pytest.mark.parametrize(
    "args, words",
    [
        (["algorithm=nope"], ["unknown algorithm 'nope'", "allreduce", "dpsgd"]),
        (["topology=nope"], ["unknown topology 'nope'", "ring"]),
        (["backend=nope"], ["unknown backend 'nope'", "local", "mpi", "torch"]),
        (["peers=0"], ["peers must be an integer >= 1"]),
        (["algorithm._target_=nope.Foo"], ["algorithm._target_='nope.Foo' cannot be imported"]),
        (["topology.name=nope", "backend=local"], ["topology 'nope'", "ring"]),
        (["topology=one_peer_exponential", "peers=6", "topology.name=hypercube"], ["hypercube", "power of 2"]),
        (["algorithm=allreduce,dpsgd", "backend=fleet"], ["algorithm=allreduce,dpsgd describes 2 runs", "add -m"]),
    ],
)
def test_bad_input_one_line_and_no_outputs(app, args, words, tmp_path):
    run_dir = tmp_path / "run"
    proc = app(args, run_dir, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert not run_dir.exists()


def test_world_size_must_match_peers(app, tmp_path):
    run_dir = tmp_path / "run"
    proc = app(["backend=mpi", "peers=4"], run_dir, [mpiexec(), "-n", "2"], timeout=60)
    assert proc.returncode != 0
    assert "started 2 processes but peers=4" in proc.stderr
    assert not (run_dir / "summary.json").exists()


def test_killed_run_resumes_to_the_same_numbers(app, tmp_path):
    # 8 epochs (88 steps): the kill comes at the first checkpoint (step 20); the rest is the resume's
    args = ["backend=local", "epochs=8", "log_every=10", "checkpoint.every=20"]
    full = tmp_path / "full"
    assert app(args, full).returncode == 0
    run_dir = tmp_path / "killed"
    # peer 0 sleeps 0.2 s before each step from step 20 on (numbers unchanged): the run is still going
    # when its first checkpoint is seen, however fast the machine
    slowed = ["faults.delay_peer=0", "faults.delay_s=0.2", "faults.at_step=20"]
    proc = app.start(args + slowed, run_dir, start_new_session=True, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 120
    while not list(run_dir.glob("checkpoints/*/COMPLETE")) and time.monotonic() < deadline:
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "summary.json").exists(), "the run ended before it could be killed"

    again = app(args, run_dir)  # the folder holds a run: refused without resume=true
    assert again.returncode == 2 and "resume=true" in again.stderr and (run_dir / "checkpoints").exists()
    resumed = app(args + ["resume=true"], run_dir)
    assert resumed.returncode == 0, resumed.stderr
    assert_same_numbers(full, run_dir)
