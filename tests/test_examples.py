"""The scripts of examples/ run as their docstrings say: the own loop under mpiexec and under torchrun (2 peers,
one epoch), mixed precision with an overflow on one peer, and a resume that ends with the parameters of a run
never stopped (those two on the local backend, in this process); the trainers' examples (lightning_*, accelerate_*,
hf_trainer*): Accelerate's as one plain process here, each under torchrun on 4 peers with dpsgd and diloco in the
soak, where every peer's final parameters equal the library loop's (`--check-against-library-loop`: the batches it
trained on replayed from the same seed through a hand-written loop with the same optimizer) to 1e-6. The
integrations' own proof on 2 peers: tests/test_integrations.py."""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from dpsgd.backends import spawn
from dpsgd.backends.launch import peer_env

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, args: list[str], capsys) -> str:
    """examples/NAME.py with `args`, in this process (its local-backend peers are threads); its stdout."""
    saved = sys.argv
    sys.argv = [str(EXAMPLES / name), *args]
    try:
        runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    finally:
        sys.argv = saved
    return capsys.readouterr().out


@pytest.mark.processes
@pytest.mark.timeout(200)
def test_own_loop_under_mpiexec(tmp_path):
    code = spawn("mpi", 2, [str(EXAMPLES / "own_loop.py"), "--epochs", "1"], timeout_s=150, log_dir=tmp_path)
    assert code == 0, (tmp_path / "rank0.log").read_text()[-2000:]


@pytest.mark.processes
@pytest.mark.timeout(200)
def test_own_loop_under_torchrun():
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", str(EXAMPLES / "own_loop.py")]
    env = {**peer_env(), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*cmd, "--backend", "torch", "--epochs", "1", "--partition", "dirichlet"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stderr[:3000] + "\n...\n" + done.stderr[-1500:]  # the peer's own error first
    accuracy = float(re.search(r"accuracy ([\d.]+)", done.stdout).group(1))
    assert accuracy > 0.5  # four classes: better than chance


def test_mixed_precision_skips_an_overflow_on_one_peer_on_every_peer(capsys):
    out = run_example("mixed_precision.py", ["--backend", "local", "--peers", "4", "--overflow-at", "3"], capsys)
    assert "dpsgd in fp16 on cpu: 7 steps of 8 batches" in out and "parameters finite: True" in out
    out = run_example("mixed_precision.py", ["--backend", "local", "--peers", "2", "--precision", "bf16"], capsys)
    assert "dpsgd in bf16 on cpu: 16 steps of 16 batches" in out


def test_resume_gives_the_parameters_of_a_run_never_stopped(tmp_path, capsys):
    common = ["--backend", "local", "--peers", "4", "--epochs", "1"]
    whole = run_example("resume.py", [*common, "--dir", str(tmp_path / "whole")], capsys)
    stopped = run_example("resume.py", [*common, "--dir", str(tmp_path / "cut"), "--stop-after", "12"], capsys)
    resumed = run_example("resume.py", [*common, "--dir", str(tmp_path / "cut")], capsys)
    assert "stopped after step 12" in stopped and "resumed from step 10" in resumed
    digest = re.search(r"parameters (\w+)", whole).group(1)
    assert f"parameters {digest}" in resumed


TRAINER_EXAMPLES = {  # the script, its extra, its arguments for a short run, the line rank 0 prints
    "lightning_blobs.py": (
        "lightning",
        ["--epochs", "1"],
        r"in Lightning on (\d) peers, (\d+) steps: peer 0's accuracy ([\d.]+)",
    ),
    "accelerate_blobs.py": (
        "accelerate",
        ["--epochs", "1"],
        r"in Accelerate on (\d) peers, (\d+) steps: peer 0's accuracy ([\d.]+)",
    ),
    "hf_trainer_tiny_gpt2.py": (
        "transformers",
        ["--steps", "20"],
        r"in the Trainer on (\d) peers, (\d+) steps: peer 0's mean training loss ([\d.]+)",
    ),
}


LIBRARY_LOOP = r"peer (\d+): largest difference from the library loop (\S+) \((\d+) batches replayed\)"


def run_trainer_example(name: str, algorithm: str, peers: int, check: bool = False) -> tuple[int, int, float, dict]:
    """examples/NAME under `torchrun --nproc-per-node PEERS --algorithm ALGORITHM`: its peers, steps and figure,
    and with `check` (--check-against-library-loop) each peer's largest difference from the library loop."""
    extra, args, line = TRAINER_EXAMPLES[name]
    pytest.importorskip(extra, reason=f"the {extra} extra: pip install -e '.[{extra}]'")
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**peer_env(), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            str(torchrun),
            "--standalone",
            f"--nproc-per-node={peers}",
            str(EXAMPLES / name),
            "--algorithm",
            algorithm,
            *args,
            *(["--check-against-library-loop"] if check else []),
        ],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-1500:] + done.stderr[-3000:]
    found = re.search(line, done.stdout)
    assert found, done.stdout[-2000:]
    differences = {int(m[0]): (float(m[1]), int(m[2])) for m in re.findall(LIBRARY_LOOP, done.stdout)}
    return int(found.group(1)), int(found.group(2)), float(found.group(3)), differences


def test_accelerate_example_as_one_plain_process(capsys):
    pytest.importorskip("accelerate", reason="the accelerate extra: pip install -e '.[accelerate]'")
    out = run_example("accelerate_blobs.py", ["--algorithm", "dpsgd", "--epochs", "1"], capsys)
    # one peer (no process group: the local backend's world of one), 2048 samples in batches of 32, 2 accumulated
    found = re.search(r"dpsgd in Accelerate on 1 peers, 32 steps: peer 0's accuracy ([\d.]+)", out)
    assert found and float(found.group(1)) > 0.5, out


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.timeout(600)
@pytest.mark.parametrize("algorithm", ["dpsgd", "diloco"])
@pytest.mark.parametrize("name", list(TRAINER_EXAMPLES))
def test_trainer_examples_on_4_peers(name, algorithm):
    peers, steps, figure, differences = run_trainer_example(name, algorithm, 4, check=True)
    assert peers == 4 and steps > 0
    assert sorted(differences) == [0, 1, 2, 3], differences  # every peer compared
    for rank, (difference, batches) in differences.items():
        assert batches >= steps and difference < 1e-6, f"peer {rank}: {difference} after {batches} batches"
    assert figure > 0.5 if "accuracy" in TRAINER_EXAMPLES[name][2] else figure < 3.3  # above chance; below ln(27)
