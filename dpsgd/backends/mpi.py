"""The `mpi` backend's driver: it starts the peers with the MPI wheel's launcher (here, or on `launcher.hosts`); under
a user's mpiexec or srun every rank joins that world (dpsgd.comm.mpi).

On one host the launcher is MPICH's fork-based `mpiexec.gforker`: it hands each rank its PMI connection as a socket
pair and opens no TCP port. MPICH's usual mpiexec (hydra) listens for its proxies on every interface (0.0.0.0) at a
random port for the whole run, and no option binds that socket elsewhere (`-iface` only chooses the address it
advertises; hydra's listener binds INADDR_ANY): it is used only for ranks on several hosts, which need that port,
and where no gforker is installed (another MPI). How it works: docs/guide/internals.md#launch."""

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


def forker() -> str | None:
    """MPICH's mpiexec.gforker beside the mpiexec in use (see the module), or None where there is none."""
    found = Path(mpiexec()).parent / "mpiexec.gforker"
    return str(found) if found.exists() else None


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
        """One launcher process (no exit code per rank); with `log_dir`, rank r's stderr goes to log_dir/rank{r}.log
        and the launcher's own output to log_dir/launcher.log (hydra's, with the ranks' stdout; gforker passes the
        ranks' stdout through)."""
        gforker = None if launcher else forker()
        if gforker is not None:
            return self._forked(gforker, n, argv, timeout_s, env, log_dir)
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

    @staticmethod
    def _forked(gforker: str, n: int, argv: list[str], timeout_s, env, log_dir) -> int:
        """The ranks on this host under gforker (see the module). A rank's stderr goes to its log by a shell that
        then becomes the rank (exec: gforker still signals and reaps the rank itself). gforker exits 0 when ranks were
        only killed by signals: its account in launcher.log makes that a failure (exit code 1)."""
        command = [gforker, "-n", str(n)]
        if log_dir is not None:
            pattern = shlex.quote(str(Path(log_dir))) + '/rank"$PMI_RANK".log'
            command += ["/bin/sh", "-c", f'exec "$0" "$@" 2>{pattern}']
        log = Path(log_dir) / "launcher.log" if log_dir is not None else None
        code = launch.run_processes([([*command, sys.executable, *argv], env, log)], timeout_s)
        if code == 0 and log is not None and log.exists() and launch.forker_exit(log.read_text(errors="replace")):
            return 1
        return code

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
