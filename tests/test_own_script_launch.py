"""`python -m dpsgd.backends -n N SCRIPT`: a user's own script on N peers of one world, started as the app starts its
peers (the runtime's settings made for them: shared memory only for MPI, gloo on loopback, one OpenMP thread, freed
memory kept); the first failing peer's exit code, 124 past the deadline, one line for a wrong command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from peers import exchange_out_peer as peer

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, os, sys
import dpsgd.comm
comm = dpsgd.comm.init(sys.argv[1])
keys = ("UCX_TLS", "OMP_NUM_THREADS", "MALLOC_TRIM_THRESHOLD_", "GLOO_SOCKET_IFNAME")
seen = {"rank": comm.rank, "size": comm.size, **{k: os.environ.get(k) for k in keys}}
(__import__("pathlib").Path(sys.argv[2]) / f"rank{comm.rank}.json").write_text(json.dumps(seen))
comm.barrier()
sys.exit(int(sys.argv[3]) if comm.rank == comm.size - 1 else 0)
"""


def launch(*args: str, timeout: int = 100) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "dpsgd.backends", *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_own_script_gets_its_world_and_the_runtime_settings(backend, tmp_path):
    script = tmp_path / "mine.py"
    script.write_text(SCRIPT)
    proc = launch("-n", "3", "--backend", backend, str(script), backend, str(tmp_path), "0")
    assert proc.returncode == 0, proc.stderr
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [(s["rank"], s["size"]) for s in seen] == [(0, 3), (1, 3), (2, 3)]
    for s in seen:
        assert s["OMP_NUM_THREADS"] == "1" and s["MALLOC_TRIM_THRESHOLD_"] is not None
        assert s["UCX_TLS" if backend == "mpi" else "GLOO_SOCKET_IFNAME"] == ("self,sm" if backend == "mpi" else "lo")


@pytest.mark.timeout(120)
def test_own_script_exchanges_and_its_failure_is_the_exit_code(tmp_path):
    proc = launch("-n", "3", str(REPO / "tests" / "peers" / "exchange_out_peer.py"), "mpi", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    for rank in range(3):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        left, right = (rank - 1) % 3, (rank + 1) % 3
        assert got["out"] == [peer.values(left).tolist(), peer.values(right).tolist()]
    script = tmp_path / "mine.py"
    script.write_text(SCRIPT)
    failed = launch("-n", "2", "--backend", "torch", str(script), "torch", str(tmp_path), "3")
    assert failed.returncode == 3, failed.stderr


def test_a_wrong_command_is_one_line():
    for args, words in [
        (["-n", "0", "x.py"], "-n takes at least 1 peer, got 0"),
        (["-n", "2", "no_such_script.py"], "no script 'no_such_script.py' here"),
        (["-n", "2", "--backend", "local", "x.py"], "invalid choice: 'local'"),
    ]:
        proc = launch(*args, timeout=60)
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr
