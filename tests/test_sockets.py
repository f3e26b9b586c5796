"""What a run exposes: every listening socket of a run's processes (from the system socket tables, /proc/PID/net),
per backend, and where it is bound (docs/guide/robustness.md says what listens where). On one host nothing listens
beyond loopback: the mpi runs start under mpiexec.gforker (no TCP listener), the torch runs meet through a rendezvous
file (no TCP store)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sockets import everywhere, listening, loopback

pytestmark = pytest.mark.processes  # a run per backend, started and stopped


def _listeners_of_a_run(app, tmp_path, backend: str) -> list[dict]:
    """Start a long run, list its listeners once its peers train, stop it (SIGINT, as a user would)."""
    run_dir = tmp_path / "run"
    proc = app.start([f"backend={backend}", "epochs=500"], run_dir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return _listening_while_training(proc, run_dir)


def _listening_while_training(proc: subprocess.Popen, run_dir: Path) -> list[dict]:
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        found = listening(proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return found


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "fleet"])
def test_in_process_backends_listen_nowhere(app, tmp_path, backend):
    assert _listeners_of_a_run(app, tmp_path, backend) == []


@pytest.mark.slow  # soak: a socket audit of a whole run
@pytest.mark.timeout(200)
def test_torch_listens_on_loopback_only_and_has_no_store(app, tmp_path):
    """4 peers: one gloo listener each (GLOO_SOCKET_IFNAME=lo) and nothing else: they meet through a rendezvous file
    in a private folder (dpsgd.backends.torch_dist), so no c10d store listens for another user to reach."""
    found = _listeners_of_a_run(app, tmp_path, "torch")
    assert all(s["proto"] == "tcp" and loopback(s["address"]) for s in found), found
    assert len({s["port"] for s in found}) == 4, found  # a gloo listener per peer, no store


@pytest.mark.slow  # soak: a socket audit of a whole run
@pytest.mark.timeout(200)
def test_mpi_listens_nowhere_on_one_host(app, tmp_path):
    """4 peers under mpiexec.gforker: its PMI runs over socket pairs and UCX over shared memory, so no process of the
    run listens on any address (hydra's mpiexec, used before, listened on 0.0.0.0 for its proxies)."""
    found = _listeners_of_a_run(app, tmp_path, "mpi")
    assert not [s for s in found if not loopback(s["address"])], found
    assert found == [], found


sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import testhosts  # noqa: E402


@pytest.mark.slow
@pytest.mark.skipif(testhosts.unavailable() is not None, reason=str(testhosts.unavailable()))
@pytest.mark.parametrize("backend", ["torch", "mpi"])
def test_two_hosts_listen_on_their_network_only(app, tmp_path, backend):
    """Two test hosts (network namespaces the test makes), the driver on host 1 starting 2 peers on each: every
    listener is on loopback or on a host's own address, but the control port of hydra's mpiexec, which ranks on several
    hosts need and which MPICH binds to every interface (docs/guide/robustness.md)."""
    run_dir = tmp_path / "run"
    with testhosts.TestHosts(2) as hosts:
        addresses = {hosts.address(1), hosts.address(2)}
        args = [
            f"backend={backend}", "epochs=500",
            f"launcher.hosts=[{hosts.address(1)},{hosts.address(2)}]",
            f"launcher.runner={app.root / 'tools' / 'netns_exec.sh'}",
        ]  # fmt: skip
        proc = hosts.popen(
            1,
            app.command(args, run_dir),
            cwd=app.root,
            env=app.env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        found = _listening_while_training(proc, run_dir)
    wide = {(s["address"], s["port"]) for s in found if everywhere(s["address"])}
    assert all(loopback(s["address"]) or s["address"] in addresses or everywhere(s["address"]) for s in found), found
    assert any(s["address"] in addresses for s in found), found  # the peers' own listeners, on the hosts' network
    if backend == "torch":
        assert not wide, found
    else:
        assert len(wide) <= 1 and any(
            s["cmd"].split()[0].endswith("mpiexec") for s in found if everywhere(s["address"])
        )
