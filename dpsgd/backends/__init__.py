"""Backends as records: everything the app asks of a backend, in one record per module here (its driver:
start, spawn, supervise, relaunch) on top of its transport (dpsgd.comm.transport: connect, the launched
world, capabilities); the rest of the code asks these, never a backend's name. A new backend is a
transport beside its communicator, a driver module here listed below, and conf/backend/NAME.yaml."""

from __future__ import annotations

from pathlib import Path

from dpsgd.comm import transport

from .driver import Backend, RunFailed, error_line
from .fleet import FleetBackend
from .hosts import placement as host_placement
from .interrupt import Interrupted, exit_on_signals, stop_on_signals
from .launch import ERROR_FILE, free_port, peer_env
from .local import LocalBackend
from .mpi import MPIBackend
from .peer import connect, join, run_peer
from .torch_dist import TorchBackend

__all__ = [
    "ERROR_FILE",
    "Backend",
    "Interrupted",
    "RunFailed",
    "connect",
    "error_line",
    "exit_on_signals",
    "free_port",
    "get",
    "host_placement",
    "join",
    "launched",
    "names",
    "peer_env",
    "run_peer",
    "spawn",
    "stop_on_signals",
]

_REGISTRY: dict[str, Backend] = {b.name: b for b in (LocalBackend(), MPIBackend(), TorchBackend(), FleetBackend())}


def names() -> list[str]:
    return list(_REGISTRY)


def get(name: str) -> Backend:
    return transport.lookup(_REGISTRY, name)


def launched(prefer: str | None = None) -> Backend | None:
    """The backend whose launcher made this process one rank of its world, or None (a plain process). `prefer`: the
    backend asked for, tried first (srun's tasks are a world for mpi, through PMI, and for torch alike)."""
    first = [_REGISTRY[prefer]] if prefer in _REGISTRY else []
    return next((b for b in [*first, *_REGISTRY.values()] if b.world() is not None), None)


def spawn(
    name: str,
    n: int,
    argv: list[str],
    timeout_s: float | None = None,
    env: dict | None = None,
    log_dir: Path | None = None,
) -> int:
    """`argv` on n processes of backend `name` on this machine (see Backend.spawn)."""
    return get(name).spawn(n, argv, timeout_s, env, log_dir)
