"""The `torch` backend's driver: it spawns `peers` torch.distributed processes (here, meeting through a rendezvous file
in a private folder with no TCP store, or on `launcher.hosts`, through a store bound to the first host's address);
under torchrun (RANK, WORLD_SIZE) every rank joins that world (dpsgd.comm.torch_dist), and under a plain srun
each task is a rank (dpsgd.backends.slurm)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from dpsgd import netif
from dpsgd.comm.torch_dist import INIT_ENV, TorchTransport

from . import hosts, launch, slurm
from .driver import Backend


class TorchBackend(TorchTransport, Backend):
    def world(self) -> tuple[int, int] | None:
        found = super().world()
        if found is None:
            srun = slurm.torch_env()
            if srun is not None:  # torch.distributed's env:// and dpsgd.placement read these
                os.environ.update(srun)
                found = super().world()
        return found

    def exit(self) -> None:
        # results written, group down: skip the interpreter's teardown, where gloo's threads can abort
        # the process ("terminate called without an active exception"), as in experiments.peer
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def elastic_problem(self) -> str | None:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torch 2.13's agents keep the first round's worker store address: after a node is lost the
            # re-formed world's ranks connect to stale addresses and fail (measured)
            return (
                "elastic=true under torchrun needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment "
                "(a new worker store each time the world re-forms); set it and start torchrun again"
            )
        return None

    def spawn(self, n, argv, timeout_s=None, env=None, log_dir=None, codes_out=None, launcher=None) -> int:
        logs = [None if log_dir is None else Path(log_dir) / f"rank{r}.log" for r in range(n)]
        commands: list[tuple[list[str], dict | None, Path | None]]
        if launcher:  # each rank through the runner on its host; the first host's address is the master's
            where = hosts.placement(list(launcher["hosts"]), n)
            port = int(launcher.get("port") or 0) or launch.free_port()
            base, runner = hosts.forwarded(launch.peer_env(env)), hosts.runner(launcher)
            ranks = _rank_envs(netif.resolve(where[0]), port, where)
            commands = [
                (hosts.remote(runner, host, {**base, **rank}, argv), env, log)
                for host, rank, log in zip(where, ranks, logs)
            ]
        else:  # one host: gloo on loopback, and a rendezvous file only this user can reach instead of a TCP store
            folder = tempfile.mkdtemp(prefix="dpsgd-rendezvous-")  # mode 0700
            local = {"GLOO_SOCKET_IFNAME": "lo", INIT_ENV: f"file://{folder}/store", **(env or {})}
            ranks = _rank_envs("127.0.0.1", None, ["localhost"] * n)
            commands = [([sys.executable, *argv], {**local, **rank}, log) for rank, log in zip(ranks, logs)]
            try:
                return launch.run_processes(commands, timeout_s, codes_out)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        return launch.run_processes(commands, timeout_s, codes_out)


def _rank_envs(master: str, port: int | None, where: list[str]) -> list[dict]:
    """torch.distributed's variables of each rank, `where[r]` the host of rank r (its local rank counted there);
    no MASTER_PORT where `port` is None (a rendezvous of another kind)."""
    return [
        {
            "MASTER_ADDR": master,
            **({"MASTER_PORT": str(port)} if port is not None else {}),
            "WORLD_SIZE": str(len(where)),
            "RANK": str(r),
            "LOCAL_RANK": str(r - where.index(host)),
            "LOCAL_WORLD_SIZE": str(where.count(host)),
        }
        for r, host in enumerate(where)
    ]
