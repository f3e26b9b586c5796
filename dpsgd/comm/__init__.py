"""Communicators: how peers exchange tensors. `init(backend)` gives one; optimizers use only
the `Communicator` protocol, so they run unchanged on every backend."""

from __future__ import annotations

from . import local, mpi, torch_dist, transport  # noqa: F401 - each communicator module registers its transport
from .base import DEFAULT_TIMEOUT_S, CommStats, Communicator, Handle
from .local import LocalCommunicator, LocalWorld, run_local
from .mpi import MPICommunicator
from .pending import CommError, PeerFailedError, PeerTimeoutError
from .torch_dist import TorchCommunicator

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "CommError",
    "CommStats",
    "Communicator",
    "Handle",
    "LocalCommunicator",
    "LocalWorld",
    "MPICommunicator",
    "PeerFailedError",
    "PeerTimeoutError",
    "TorchCommunicator",
    "init",
    "run_local",
]


def init(backend: str = "local", timeout_s: float = DEFAULT_TIMEOUT_S, **options) -> Communicator:
    """A communicator for this process, from the backend's transport (dpsgd.comm.transport).

    - `local`: inside `run_local`, this thread's peer; elsewhere a world of one peer.
    - `mpi`: this rank of the MPI world (start the processes with mpiexec/srun, or `python -m dpsgd.backends`);
      option `staging` ('auto', 'always', 'never': CUDA tensors through host buffers unless MPI is CUDA-aware;
      always: CPU tensors too).
    - `torch`: this rank of torch.distributed (torchrun, or RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT);
      options `dist_backend` ('gloo' or 'nccl'; default nccl when CUDA is present), `init_method` and `staging`.
    """
    return transport.get(backend).connect(timeout_s, **options)
