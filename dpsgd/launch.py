"""Start peers: spawn them on this machine (mpiexec from the MPI wheel, or n torch.distributed
processes), or tell whether this process already is one rank of a launched world.

Everything a runtime needs on one machine (loopback only, one torch thread per peer, ranks
beyond the core count) is set here, so users never set it by hand.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from dpsgd.comm.mpi import in_mpi_world
from dpsgd.comm.torch_dist import in_torch_world


def launched_world() -> str | None:
    """'mpi' under mpiexec/srun, 'torch' under torchrun, None for a plain process."""
    if in_mpi_world():
        return "mpi"
    if in_torch_world():
        return "torch"
    return None


def peer_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # n peers on few cores: OpenMP spinning costs 6x
    env.setdefault("UCX_TLS", "self,sm")  # MPICH: shared memory only, no listeners on the network
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


def mpiexec() -> str:
    """The mpiexec beside this Python (the MPI wheel's), else the one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if not found:
        raise RuntimeError("no mpiexec found: install an MPI runtime wheel (`pip install mpich`) or use backend=torch")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _supervise(procs: list[subprocess.Popen], timeout_s: float | None) -> int:
    """Wait for all; the first failure (or the deadline) stops the rest. Returns the exit code."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                _stop(procs)
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                _stop(procs)
                return 124
            time.sleep(0.05)
    except BaseException:
        _stop(procs)
        raise


def spawn_mpi(n: int, argv: list[str], timeout_s: float | None = None, env: dict | None = None) -> int:
    """Run `argv` (a python command line without the interpreter) on n MPI ranks of this machine."""
    launcher = mpiexec()
    cmd = [launcher, "-n", str(n)]
    if "SLURM_JOB_ID" in os.environ and (Path(launcher).parent / "hydra_pmi_proxy").exists():
        # MPICH's mpiexec would start its proxy with srun, which waits forever for CPUs the
        # running job step already holds: start the ranks on this node directly
        cmd += ["-launcher", "fork"]
    cmd += [sys.executable, *argv]
    proc = subprocess.Popen(cmd, env=peer_env(env), start_new_session=True)
    return _supervise([proc], timeout_s)


def spawn_torch(n: int, argv: list[str], timeout_s: float | None = None, env: dict | None = None) -> int:
    """Run `argv` as n processes of one torch.distributed world on this machine."""
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(n),
            "LOCAL_WORLD_SIZE": str(n), "GLOO_SOCKET_IFNAME": "lo", **(env or {})}
    procs = [
        subprocess.Popen([sys.executable, *argv], start_new_session=True,
                         env=peer_env({**base, "RANK": str(r), "LOCAL_RANK": str(r)}))
        for r in range(n)
    ]
    return _supervise(procs, timeout_s)


def spawn(backend: str, n: int, argv: list[str], timeout_s: float | None = None, env: dict | None = None) -> int:
    if backend == "mpi":
        return spawn_mpi(n, argv, timeout_s, env)
    if backend == "torch":
        return spawn_torch(n, argv, timeout_s, env)
    raise ValueError(f"cannot spawn processes for backend {backend!r}; valid: mpi, torch")
