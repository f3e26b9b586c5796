"""Communicators: how peers exchange tensors. `init(backend)` gives one; optimizers use only
the `Communicator` protocol, so they run unchanged on every backend."""

from __future__ import annotations

from .base import (
    DEFAULT_TIMEOUT_S,
    CommError,
    CommStats,
    Communicator,
    Handle,
    PeerFailedError,
    PeerTimeoutError,
)
from .local import LocalCommunicator, LocalWorld, run_local

__all__ = [
    "BACKENDS",
    "DEFAULT_TIMEOUT_S",
    "CommError",
    "CommStats",
    "Communicator",
    "Handle",
    "LocalCommunicator",
    "LocalWorld",
    "PeerFailedError",
    "PeerTimeoutError",
    "init",
    "run_local",
]


def init(backend: str = "local", timeout_s: float = DEFAULT_TIMEOUT_S, **options) -> Communicator:
    """A communicator for this process, from the backend's record (dpsgd.backends).

    - `local`: inside `run_local`, this thread's peer; elsewhere a world of one peer.
    - `mpi`: this rank of the MPI world (start the processes with mpiexec/srun).
    - `torch`: this rank of torch.distributed (torchrun, or RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT);
      options `dist_backend` ('gloo' or 'nccl'; default nccl when CUDA is present) and `init_method`.
    """
    from dpsgd import backends

    return backends.get(backend).connect(timeout_s, **options)


def __getattr__(name: str):
    if name == "BACKENDS":  # the registered backends' names (dpsgd.backends, which imports this package)
        from dpsgd import backends

        return tuple(backends.names())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
