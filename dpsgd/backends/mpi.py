"""The `mpi` backend: mpi4py (dpsgd.comm.mpi). The driver starts `mpiexec -n peers` from the MPI wheel;
under a user's mpiexec or srun every rank joins that world."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from dpsgd import hosts, launch, netif
from dpsgd.comm import DEFAULT_TIMEOUT_S

from . import Backend, register


def mpi_import_error() -> str | None:
    """Why mpi4py cannot load an MPI library here, or None. Tried in a child process: loading MPI
    into the driver would initialize it there."""
    probe = "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    if proc.returncode == 0:
        return None
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    return f"`from mpi4py import MPI` fails ({lines[-1] if lines else f'exit code {proc.returncode}'})"


class MPIBackend(Backend):
    name = "mpi"
    processes = True

    def connect(self, timeout_s: float = DEFAULT_TIMEOUT_S, **options):
        """This rank of the MPI world (start the processes with mpiexec/srun)."""
        from dpsgd.comm.mpi import MPICommunicator

        return MPICommunicator(timeout_s=timeout_s, **options)

    def options(self, cfg: dict) -> dict:
        return {"staging": cfg["backend"].get("staging", "auto")}

    def world(self) -> tuple[int, int] | None:
        sizes = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")  # set by mpiexec/srun
        if all(int(os.environ.get(var, "1") or 1) <= 1 for var in sizes):
            return None
        from dpsgd.comm.mpi import load_mpi

        world = load_mpi().COMM_WORLD
        return world.Get_rank(), world.Get_size()

    def share(self, data: bytes, timeout_s: float) -> bytes:
        """As fixed-size bytes (nothing received is unpickled), waiting by polling: PeerTimeoutError
        when a rank never arrives."""
        from mpi4py import MPI

        from dpsgd.comm.base import poll_until

        buf = bytearray(data)
        request = MPI.COMM_WORLD.Ibcast(buf, root=0)
        poll_until(request.Test, time.monotonic() + timeout_s)
        return bytes(buf)

    def missing(self) -> str | None:
        problem = mpi_import_error()
        if problem:
            return (
                f"backend=mpi needs mpi4py and an MPI runtime, but {problem}; install both with "
                f"`pip install mpi4py mpich` (or load your cluster's MPI and `pip install mpi4py`), "
                f"or choose backend=local or backend=torch"
            )
        try:
            launch.mpiexec()
        except RuntimeError as exc:
            return str(exc)
        return None

    def spawn(self, n: int, argv: list[str], *args, codes_out: list | None = None, **kwargs) -> int:
        return launch.spawn_mpi(n, argv, *args, **kwargs)  # one mpiexec process: no exit code per rank

    def spawn_on_hosts(self, launcher, n, argv, timeout_s=None, env=None, log_dir=None, codes_out=None) -> int:
        """mpiexec from here, its proxies started on the hosts by the runner instead of plain ssh; UCX over
        tcp on the interface to the first host (shared memory would join the ranks of one machine directly,
        which on test hosts, namespaces of one machine, bypasses their links)."""
        where = hosts.placement(list(launcher["hosts"]), n)
        iface = netif.interface_to(where[0])
        if iface == "lo":
            raise ValueError(
                f"launcher.hosts: the first host {where[0]!r} is this machine's loopback; give the hosts' network "
                "addresses (or no launcher.hosts for a run on this machine)"
            )
        runner = hosts.runner(launcher)
        counts = {h: where.count(h) for h in dict.fromkeys(where)}
        cmd = [launch.mpiexec(), "-launcher", "ssh"]
        if runner != ["ssh"]:
            cmd += ["-launcher-exec", shlex.join(runner)]
        cmd += ["-iface", iface, "-hosts", ",".join(f"{h}:{k}" for h, k in counts.items()), "-n", str(n)]
        forwarded = hosts.forwarded(launch.peer_env(env))
        for k, v in {**forwarded, "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": iface}.items():
            cmd += ["-genv", k, v]
        if log_dir is not None:
            cmd += ["-errfile-pattern", str(Path(log_dir) / "rank%r.log")]
        # the driver's own UCX_TLS=self,sm must not reach mpiexec's environment: None removes it (peer_env)
        local = {**(env or {}), "UCX_TLS": None, "UCX_NET_DEVICES": None}
        log = Path(log_dir) / "launcher.log" if log_dir is not None else None
        return launch.run_processes([([*cmd, sys.executable, *argv], local, log)], timeout_s, stdout_to_log=True)


register(MPIBackend())
