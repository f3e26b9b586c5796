"""Transports as records: what a backend's peers need to reach each other, asked of one `Transport` per
backend and never of a backend's name. Each communicator module registers its own (`local`, `mpi`,
`torch`); the drivers that start, supervise and relaunch peers (dpsgd.backends) build on these records.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from .base import Communicator

_REGISTRY: dict[str, Transport] = {}
R = TypeVar("R")


class Transport:
    """One backend's transport part. Subclasses set `name` and override what differs from these defaults."""

    name: str = "?"
    threads = False  # peers are threads of one process: a killed one raises, messages can be dropped (faults)
    processes = False  # peers are processes of their own (which faults can kill or hang)
    checkpoints = True  # runs keep checkpoints and resume from them
    host_staging = False  # CUDA tensors can travel through pinned host buffers (the `backend.staging` option)
    # the keys its `backend=NAME` config takes, with their defaults (conf/backend/NAME.yaml writes them out)
    config_options: dict[str, object] = {}

    @property
    def real_peers(self) -> bool:
        """Peers that faults can kill, hang or delay (a simulation has none)."""
        return self.threads or self.processes

    def connect(self, timeout_s: float, **options) -> Communicator:
        """This process's communicator (`dpsgd.comm.init`)."""
        raise NotImplementedError

    def options(self, backend: Mapping, device: str) -> dict:
        """The `connect` options of a run whose `backend=` section holds `backend` (its own keys) and whose
        peers compute on `device`."""
        return {}

    def uses_nccl(self, backend: Mapping, device: str) -> bool:
        """Such a run's peers talk over nccl, which needs a GPU of its own per peer (dpsgd.placement)."""
        return False

    def world(self) -> tuple[int, int] | None:
        """(rank, size) when a launcher made this process one rank of its world, else None."""
        return None

    def share(self, data: bytes, timeout_s: float) -> bytes:
        """Rank 0's `data` in every rank of a launched world, before any communicator exists."""
        raise NotImplementedError

    def missing(self) -> str | None:
        """Why this transport cannot run here (one line, with the fix), or None."""
        return None


def register(transport: Transport) -> Transport:
    _REGISTRY[transport.name] = transport
    return transport


def names() -> list[str]:
    return list(_REGISTRY)


def get(name: str) -> Transport:
    return lookup(_REGISTRY, name)


def lookup(registry: Mapping[str, R], name: str) -> R:
    """The record `name` of `registry` (transports here, drivers in dpsgd.backends), or the one-line refusal."""
    if name not in registry:
        raise ValueError(f"unknown backend {name!r}; valid backends: {', '.join(registry)}")
    return registry[name]


def having(capability: str) -> str:
    """'local, mpi or torch': the names of the transports whose record has `capability` (for error messages)."""
    choices = [n for n, t in _REGISTRY.items() if getattr(t, capability)]
    return " or ".join(filter(None, (", ".join(choices[:-1]), choices[-1])))
