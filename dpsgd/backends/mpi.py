"""The `mpi` backend's driver: it starts `mpiexec -n peers` from the MPI wheel (here, or on `launcher.hosts`);
under a user's mpiexec or srun every rank joins that world (dpsgd.comm.mpi)."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

from dpsgd import netif
from dpsgd.comm.mpi import MPITransport

from . import hosts, launch
from .driver import Backend


def mpiexec() -> str:
    """The mpiexec named by DPSGD_MPIEXEC, else the one beside this Python (the MPI wheel's), else the one on
    PATH. (DPSGD_MPIEXEC: where the MPI wheel lives elsewhere, as in `make gpu-check`'s offline install.)"""
    here = Path(sys.executable).parent / "mpiexec"
    found = os.environ.get("DPSGD_MPIEXEC") or (str(here) if here.exists() else shutil.which("mpiexec"))
    if not found:
        raise RuntimeError("no mpiexec found: install an MPI runtime wheel (`pip install mpich`) or use backend=torch")
    return found


class MPIBackend(MPITransport, Backend):
    def missing(self) -> str | None:
        problem = super().missing()
        if problem:
            return problem
        try:
            mpiexec()
        except RuntimeError as exc:
            return str(exc)
        return None

    def spawn(self, n, argv, timeout_s=None, env=None, log_dir=None, codes_out=None, launcher=None) -> int:
        """One mpiexec process (no exit code per rank); with `log_dir`, rank r's stderr goes to
        log_dir/rank{r}.log and mpiexec's own output (and the ranks' stdout) to log_dir/launcher.log."""
        if launcher:
            cmd, env = self._on_hosts(launcher, n, env)
        else:
            cmd = [mpiexec(), "-n", str(n)]
            if "SLURM_JOB_ID" in os.environ and (Path(cmd[0]).parent / "hydra_pmi_proxy").exists():
                # MPICH's mpiexec would start its proxy with srun, which waits forever for CPUs the
                # running job step already holds: start the ranks on this node directly
                cmd += ["-launcher", "fork"]
        if log_dir is not None:
            cmd += ["-errfile-pattern", str(Path(log_dir) / "rank%r.log")]
        log = Path(log_dir) / "launcher.log" if log_dir is not None else None
        return launch.run_processes([([*cmd, sys.executable, *argv], env, log)], timeout_s, stdout_to_log=True)

    def _on_hosts(self, launcher: dict, n: int, env: dict | None) -> tuple[list[str], dict]:
        """mpiexec's command line and environment for ranks on `launcher["hosts"]`: its proxies started on the
        hosts by the runner instead of plain ssh; UCX over tcp on the interface to the first host (shared memory
        would join the ranks of one machine directly, which on test hosts, namespaces of one machine, bypasses
        their links)."""
        where = hosts.placement(list(launcher["hosts"]), n)
        iface = netif.interface_to(where[0])
        if iface == "lo":
            raise ValueError(
                f"launcher.hosts: the first host {where[0]!r} is this machine's loopback; give the hosts' network "
                "addresses (or no launcher.hosts for a run on this machine)"
            )
        runner = hosts.runner(launcher)
        counts = {h: where.count(h) for h in dict.fromkeys(where)}
        cmd = [mpiexec(), "-launcher", "ssh"]
        if runner != ["ssh"]:
            cmd += ["-launcher-exec", shlex.join(runner)]
        cmd += ["-iface", iface, "-hosts", ",".join(f"{h}:{k}" for h, k in counts.items()), "-n", str(n)]
        forwarded = hosts.forwarded(launch.peer_env(env))
        for k, v in {**forwarded, "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": iface}.items():
            cmd += ["-genv", k, v]
        # the driver's own UCX_TLS=self,sm must not reach mpiexec's environment: None removes it (peer_env)
        return cmd, {**(env or {}), "UCX_TLS": None, "UCX_NET_DEVICES": None}
