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
from .local import LocalCommunicator, LocalWorld, current_peer, run_local

BACKENDS = ("local", "mpi", "torch")

__all__ = [
    "BACKENDS", "DEFAULT_TIMEOUT_S", "CommError", "CommStats", "Communicator", "Handle",
    "LocalCommunicator", "LocalWorld", "PeerFailedError", "PeerTimeoutError", "init", "run_local",
]


def init(backend: str = "local", timeout_s: float = DEFAULT_TIMEOUT_S, **options) -> Communicator:
    """A communicator for this process.

    - `local`: inside `run_local`, this thread's peer; elsewhere a world of one peer.
    - `mpi`: this rank of the MPI world (start the processes with mpiexec/srun).
    - `torch`: this rank of torch.distributed (torchrun, or RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT);
      options `dist_backend` ('gloo' or 'nccl'; default nccl when CUDA is present) and `init_method`.
    """
    if backend == "local":
        return current_peer() or LocalCommunicator(LocalWorld(1), 0, timeout_s)
    if backend == "mpi":
        from .mpi import MPICommunicator

        return MPICommunicator(timeout_s=timeout_s, **options)
    if backend == "torch":
        from .torch_dist import TorchCommunicator

        return TorchCommunicator(timeout_s=timeout_s, **options)
    raise ValueError(f"unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
