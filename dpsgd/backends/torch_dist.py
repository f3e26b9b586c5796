"""The `torch` backend: torch.distributed (dpsgd.comm.torch_dist), gloo on CPU, nccl on GPU. The driver
spawns `peers` processes; under torchrun (RANK, WORLD_SIZE) every rank joins that world."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

from dpsgd import hosts, launch, netif, placement
from dpsgd.comm import DEFAULT_TIMEOUT_S

from . import Backend, register


class TorchBackend(Backend):
    name = "torch"
    processes = True

    def connect(self, timeout_s: float = DEFAULT_TIMEOUT_S, **options):
        """This rank of torch.distributed (torchrun, or RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT); options
        `dist_backend` ('gloo' or 'nccl'; default nccl when CUDA is present) and `init_method`."""
        from dpsgd.comm.torch_dist import TorchCommunicator

        return TorchCommunicator(timeout_s=timeout_s, **options)

    def options(self, cfg: dict) -> dict:
        return {
            "dist_backend": "nccl" if placement.uses_nccl(cfg) else "gloo",
            "staging": cfg["backend"].get("staging", "auto"),
        }

    def world(self) -> tuple[int, int] | None:
        size = int(os.environ.get("WORLD_SIZE", "1") or 1)
        return (int(os.environ["RANK"]), size) if size > 1 and "RANK" in os.environ else None

    def share(self, data: bytes, timeout_s: float) -> bytes:
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            if "MASTER_ADDR" in os.environ:  # the interface on the route to the master; `lo` on one host
                os.environ.setdefault("GLOO_SOCKET_IFNAME", netif.interface_to(os.environ["MASTER_ADDR"]))
            dist.init_process_group(
                "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo", timeout=timedelta(seconds=timeout_s)
            )
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()
        dist.broadcast(t, src=0)
        return bytes(t.tolist())

    def exit(self) -> None:
        # results written, group down: skip the interpreter's teardown, where gloo's threads can abort
        # the process ("terminate called without an active exception"), as in experiments.peer
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def missing(self) -> str | None:
        import torch.distributed as dist

        if not dist.is_available():
            return (
                "backend=torch needs torch.distributed, which this torch build lacks; install a torch "
                "wheel from pytorch.org, or choose backend=local or backend=mpi"
            )
        return None

    def spawn(self, n: int, argv: list[str], timeout_s=None, env=None, log_dir=None, codes_out=None) -> int:
        ranks = _rank_envs("127.0.0.1", launch.free_port(), ["localhost"] * n)
        local = {"GLOO_SOCKET_IFNAME": "lo", **(env or {})}
        commands: list[tuple[list[str], dict | None, Path | None]] = [
            ([sys.executable, *argv], {**local, **rank}, log) for rank, log in zip(ranks, _logs(log_dir, n))
        ]
        return launch.run_processes(commands, timeout_s, codes_out)

    def spawn_on_hosts(self, launcher, n, argv, timeout_s=None, env=None, log_dir=None, codes_out=None) -> int:
        where = hosts.placement(list(launcher["hosts"]), n)
        port = int(launcher.get("port") or 0) or launch.free_port()
        base, runner = hosts.forwarded(launch.peer_env(env)), hosts.runner(launcher)
        ranks = _rank_envs(netif.resolve(where[0]), port, where)
        commands = [
            (hosts.remote(runner, host, {**base, **rank}, argv), env, log)
            for host, rank, log in zip(where, ranks, _logs(log_dir, n))
        ]
        return launch.run_processes(commands, timeout_s, codes_out)


def _rank_envs(master: str, port: int, where: list[str]) -> list[dict]:
    """torch.distributed's variables of each rank, `where[r]` the host of rank r (its local rank counted there)."""
    return [
        {
            "MASTER_ADDR": master,
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(len(where)),
            "RANK": str(r),
            "LOCAL_RANK": str(r - where.index(host)),
            "LOCAL_WORLD_SIZE": str(where.count(host)),
        }
        for r, host in enumerate(where)
    ]


def _logs(log_dir, n: int) -> list[Path | None]:
    return [None if log_dir is None else Path(log_dir) / f"rank{r}.log" for r in range(n)]


register(TorchBackend())
