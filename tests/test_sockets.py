"""What a run exposes: every listening socket of a run's processes, per backend, and where it is bound
(docs/guide/robustness.md says what listens where)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sockets import everywhere, listening, loopback

pytestmark = [pytest.mark.slow, pytest.mark.processes]  # a run per backend, started and stopped: a minute or more


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


@pytest.mark.parametrize("backend", ["local", "fleet"])
def test_in_process_backends_listen_nowhere(app, tmp_path, backend):
    assert _listeners_of_a_run(app, tmp_path, backend) == []


def test_torch_listens_on_loopback_only(app, tmp_path):
    """gloo's listeners (GLOO_SOCKET_IFNAME=lo) and rank 0's c10d store (dpsgd.comm.store: bound to MASTER_ADDR)."""
    found = _listeners_of_a_run(app, tmp_path, "torch")
    assert len(found) >= 5, found  # a gloo listener per peer (4) and the store
    assert all(s["proto"] == "tcp" and loopback(s["address"]) for s in found), found


def test_mpi_listens_on_loopback_but_mpiexecs_control_port(app, tmp_path):
    """Nothing the toolkit opens listens beyond loopback (UCX on shared memory, no network transport). MPICH's
    mpiexec (hydra) listens for its proxies on every interface, on a port of MPIEXEC_PORT_RANGE, and its
    descendants inherit that socket: the one exception, which no MPICH option binds to an interface (`-iface`
    does not), said in the guide."""
    found = _listeners_of_a_run(app, tmp_path, "mpi")
    wide = {(s["address"], s["port"]) for s in found if not loopback(s["address"])}
    assert len(wide) <= 1 and all(everywhere(address) for address, _ in wide), found
    holders = [s["cmd"].split()[0] for s in found if (s["address"], s["port"]) in wide]
    assert not wide or any(h.endswith("mpiexec") for h in holders), found


sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import testhosts  # noqa: E402


@pytest.mark.skipif(testhosts.unavailable() is not None, reason=str(testhosts.unavailable()))
@pytest.mark.parametrize("backend", ["torch", "mpi"])
def test_two_hosts_listen_on_their_network_only(app, tmp_path, backend):
    """Two test hosts (network namespaces the test makes), the driver on host 1 starting 2 peers on each: every
    listener is on loopback or on a host's own address, but mpiexec's control port (see above)."""
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
