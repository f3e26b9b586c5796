"""Interruption: SIGINT or SIGTERM to the app stops every peer it started within 5 s, keeps the newest
complete checkpoint and ends with one line giving the command that resumes; peers die with the driver."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpsgd import checkpoint

pytestmark = pytest.mark.processes

ARGS = ["epochs=200", "log_every=10", "checkpoint.every=10", "comm.timeout_s=20"]


def processes_of(run_dir: Path) -> list[int]:
    """Pids of live processes whose command line names the run folder (the driver and its peers)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
                state = (proc / "stat").read_text().split(") ", 1)[1][0]
            except OSError:
                continue
            if str(run_dir).encode() in cmdline and state != "Z":
                found.append(int(proc.name))
    return found


def wait_for_checkpoint(run_dir: Path, peers: int, app: subprocess.Popen, limit_s: float = 90) -> None:
    deadline = time.monotonic() + limit_s
    while not checkpoint.complete_steps(run_dir, peers, verify=False):
        assert app.poll() is None, app.communicate()[1]
        assert time.monotonic() < deadline, "no checkpoint within the time limit"
        time.sleep(0.1)


def signal_after_checkpoint(proc, run_dir, sig, timeout_s: float, before=None) -> tuple[str, float]:
    """Once `proc` (stderr piped) has a complete checkpoint in run_dir, send it `sig`: its stderr and the
    seconds it took to end. `before()` runs just before the signal; a process still there is killed."""
    try:
        wait_for_checkpoint(run_dir, 2, proc)
        if before is not None:
            before()
        sent = time.monotonic()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=timeout_s)
        return err, time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "backend, sig",
    [
        ("local", signal.SIGINT),
        pytest.param("torch", signal.SIGTERM, marks=pytest.mark.slow),  # soak: the same stop through gloo
        ("mpi", signal.SIGTERM),
        pytest.param("mpi", signal.SIGINT, marks=pytest.mark.slow),  # the same path as SIGTERM
    ],
)
def test_signal_stops_every_peer_and_says_how_to_resume(app, tmp_path, backend, sig):
    run_dir = tmp_path / "run"
    args = [f"backend={backend}", "peers=2", *ARGS]
    proc = app.start(args, run_dir, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def peers_running():
        peers = [p for p in processes_of(run_dir) if p != proc.pid]
        assert backend == "local" or peers, "no peer process found"

    err, took = signal_after_checkpoint(proc, run_dir, sig, 10, before=peers_running)
    print(f"\n{backend} {sig.name}: app ended {took:.2f} s after the signal")
    assert proc.returncode == 128 + sig, err
    assert took < 5
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: interrupted by {sig.name}; "), err
    named = int(lines[0].split("the newest complete checkpoint is step ", 1)[1].split(";")[0])
    assert named in checkpoint.complete_steps(run_dir, 2)  # the one named is intact (verified digests)
    assert f"resume=true hydra.run.dir={run_dir}" in lines[0]
    time.sleep(0.2)
    assert processes_of(run_dir) == [], "processes left behind"


@pytest.mark.timeout(120)
def test_sigterm_as_timeout_sends_it_is_one_stop_and_one_line(app, tmp_path):
    """coreutils' `timeout` sends SIGTERM to the program and then to the program's process group, which holds the
    program (timeout.c: send_sig(pid), then send_sig(0)): one request, not a second signal, so the peers get their
    grace period and the app ends with the documented line. (50 ms apart here, so that the app sees two.)"""
    run_dir = tmp_path / "run"
    proc = app.start(
        ["backend=mpi", "peers=2", *ARGS], run_dir, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        wait_for_checkpoint(run_dir, 2, proc)
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: interrupted by SIGTERM; the newest complete checkpoint"), err
    assert "second signal" not in lines[0], err
    time.sleep(0.2)
    assert processes_of(run_dir) == [], "processes left behind"


def _catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (its SigCgt mask in /proc)."""
    try:
        mask = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(mask.split()[1], 16) >> (sig - 1) & 1)


@pytest.mark.timeout(120)
def test_a_signal_while_the_app_starts_is_one_line(app, tmp_path):
    """SIGTERM in the seconds the app spends importing torch and Hydra (as `timeout 3` gives it): the app catches it
    before torch is loaded, and ends with one line, exit 143, and no run folder."""
    run_dir = tmp_path / "run"
    proc = app.start(["backend=local"], run_dir, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not _catches(proc.pid, signal.SIGTERM) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "libtorch" not in maps  # caught from the app's first lines, not only once its imports are done
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip() == "error: interrupted by SIGTERM before the run started; nothing ran", err
    assert out == "" and not run_dir.exists()


@pytest.mark.slow  # make soak: each starts a world of peers (20-40 s on 2 loaded cores)
@pytest.mark.timeout(120)
def test_peers_die_with_a_killed_driver(app, tmp_path):
    """SIGKILL leaves the driver no handler: its peers end by themselves (parent-death signal)."""
    run_dir = tmp_path / "run"
    proc = app.start(["backend=torch", "peers=2", *ARGS], run_dir, stderr=subprocess.DEVNULL)
    try:
        wait_for_checkpoint(run_dir, 2, proc)
        assert len(processes_of(run_dir)) == 3
        killed = time.monotonic()
        proc.kill()
        proc.wait(timeout=10)
        deadline = killed + 5
        while processes_of(run_dir) and time.monotonic() < deadline:
            time.sleep(0.05)
        print(f"\ndriver SIGKILLed: its peers gone {time.monotonic() - killed:.2f} s later")
        assert processes_of(run_dir) == [], "peers outlived their driver"
    finally:
        for pid in processes_of(run_dir):
            os.kill(pid, signal.SIGKILL)


def _torchrun() -> list[str]:
    from dpsgd.backends.launch import free_port

    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"] + [
        "--master-port",
        str(free_port()),
        "--no-python",
    ]


@pytest.mark.slow  # make soak: each starts a world of peers (20-40 s on 2 loaded cores)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher, sig", [("torchrun", signal.SIGTERM), ("mpiexec", signal.SIGINT)])
def test_user_launcher_forwards_the_signal_and_rank_0_says_how_to_resume(app, tmp_path, launcher, sig):
    from dpsgd.backends.mpi import mpiexec

    run_dir = tmp_path / "run"
    backend = "torch" if launcher == "torchrun" else "mpi"
    prefix = _torchrun() if launcher == "torchrun" else [mpiexec(), "-n", "2"]
    cmd = app.command([f"backend={backend}", "peers=2", *ARGS], run_dir, prefix)
    proc = subprocess.Popen(
        cmd, cwd=app.root, env=app.env(), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
    )
    try:
        err, took = signal_after_checkpoint(proc, run_dir, sig, 15)
    finally:
        for pid in processes_of(run_dir):
            os.kill(pid, signal.SIGKILL)
    print(f"\n{launcher} {sig.name}: launcher ended {took:.2f} s after the signal, code {proc.returncode}")
    assert took < 5
    assert proc.returncode != 0
    assert f"resume with your launcher command plus: resume=true hydra.run.dir={run_dir}" in err, err
    named = int(err.split("the newest complete checkpoint is step ", 1)[1].split(";")[0])  # as of the signal
    assert named in checkpoint.complete_steps(run_dir, 2)
    assert processes_of(run_dir) == [], "processes left behind"


@pytest.mark.slow  # make soak: each starts a world of peers (20-40 s on 2 loaded cores)
@pytest.mark.timeout(120)
def test_second_signal_kills_at_once(app, tmp_path):
    """A peer that ignores SIGTERM would hold the first stop for its grace period: the 2nd SIGINT does not wait."""
    run_dir = tmp_path / "run"
    proc = app.start(["backend=mpi", "peers=2", *ARGS], run_dir, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_checkpoint(run_dir, 2, proc)
        peers = [p for p in processes_of(run_dir) if p != proc.pid]
        for pid in peers:  # stopped peers ignore SIGTERM until continued: the first stop must wait
            os.kill(pid, signal.SIGSTOP)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert proc.poll() is None  # still in its grace period
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=5)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"\nsecond SIGINT: app ended {took:.2f} s after it")
    assert proc.returncode == 128 + signal.SIGINT
    lines = [line for line in proc.stderr.read().splitlines() if line.strip()]  # the documented line, still
    assert len(lines) == 1 and lines[0].startswith("error: interrupted by SIGINT; "), lines
    assert lines[0].endswith("(a second signal: every peer killed at once)"), lines
    assert took < 1
    time.sleep(0.3)
    assert processes_of(run_dir) == [], "processes left behind"
