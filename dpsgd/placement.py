"""Which device a peer computes on: one GPU per peer, chosen from the peer's rank on its own node.

How it works: docs/guide/internals.md#placement.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from dpsgd.comm import transport
from dpsgd.config import Choice, RunConfig

# (local rank, processes on the node), most specific launcher first
LAUNCHER_VARS = (
    ("LOCAL_RANK", "LOCAL_WORLD_SIZE"),  # torchrun, the app's torch spawner
    ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # MPICH (hydra), the app's mpi spawner
    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),  # Open MPI
    ("SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),  # srun
)
DEVICES = "cpu, cuda, auto (cuda when torch sees a GPU, else cpu) or cuda:N"


def node_rank(env: Mapping[str, str], rank: int, peers: int) -> tuple[int, int | None]:
    """(this peer's index among the peers of its node, how many peers the node runs, None where the
    launcher does not say: srun sets SLURM_NTASKS_PER_NODE only when asked for a count per node), from
    the launcher's variables; without a launcher the app starts every peer here: (rank, peers)."""
    for rank_var, size_var in LAUNCHER_VARS:
        if env.get(rank_var, "").isdigit():
            size = env.get(size_var, "")
            return int(env[rank_var]), int(size) if size.isdigit() else None
    return rank, peers


def kind(device: str) -> str:
    """'cuda' or 'cpu': what `device` (a config value) means on this machine."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" or device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit()):
        return device.split(":")[0]
    raise ValueError(f"device must be one of {DEVICES}, got {device!r}")


def peer_device(
    device: str,
    rank: int,
    peers: int,
    env: Mapping[str, str] | None = None,
    gpus: int | None = None,
    nccl: bool = False,
    share: bool = False,
) -> torch.device:
    """The device of peer `rank` of `peers` under the config's `device` (`share`: its `device_share`). `env`
    and `gpus` default to this process's environment and torch.cuda.device_count(); `nccl`: the peers
    communicate with nccl, which needs a GPU of its own per peer."""
    device = str(device)
    if kind(device) == "cpu":
        return torch.device("cpu")
    gpus = torch.cuda.device_count() if gpus is None else gpus
    if gpus == 0:
        raise _no_gpu(device)
    local, on_node = node_rank(os.environ if env is None else env, rank, peers)
    if ":" in device:  # the user chose the GPU: every peer of the node on it
        index = int(device[5:])
        if index >= gpus:
            raise ValueError(f"device={device} but this machine has {gpus} GPU(s): cuda:0 ... cuda:{gpus - 1}")
        _refuse_sharing(share, on_node, 1, nccl, f"device={device} puts them all on one GPU")
        return torch.device(device)
    _refuse_sharing(share, on_node, gpus, nccl, f"{gpus} GPU(s)")
    return torch.device("cuda", local % gpus)


def _no_gpu(device: str) -> RuntimeError:
    return RuntimeError(
        f"device={device} but torch sees no GPU (torch {torch.__version__}, CUDA "
        f"{torch.version.cuda or 'not built in'}); install a CUDA build of torch on a GPU machine, or set device=cpu"
    )


def _refuse_sharing(share: bool, on_node: int | None, gpus: int, nccl: bool, what: str) -> None:
    """More peers on this node than `gpus`: refused for nccl always, for others without device_share."""
    if on_node is not None and on_node > gpus:
        if nccl:
            raise RuntimeError(
                f"{on_node} peers on this node but {what}: nccl needs one GPU per peer; start at most "
                f"{gpus} peers per node, or use backend.dist_backend=gloo with device_share=true (testing only)"
            )
        if not share:
            raise RuntimeError(
                f"{on_node} peers on this node but {what}: peers would share GPUs; start at most {gpus} "
                f"peers per node, or set device_share=true to let them share (a testing aid: they compete)"
            )


def uses_nccl(backend: Choice, device: str) -> bool:
    """The run's peers talk over nccl, as their transport says (dpsgd.comm.transport); never for a backend
    with no transport of its own (the fleet)."""
    name = backend.name
    return name in transport.names() and transport.get(name).uses_nccl(backend.options, device)


def single_device(device: str) -> torch.device:
    """The one device of the peers of one process (local threads, the fleet): `device`, auto resolved,
    cuda the current GPU."""
    device = str(device)
    resolved = torch.device(kind(device) if device == "auto" else device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise _no_gpu(device)
    if resolved.type == "cuda" and resolved.index is None:  # an index: torch.cuda.set_device needs one
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def place(run: RunConfig, rank: int, peers: int, in_process: bool = False) -> torch.device:
    """The device of peer `rank` of the run (`in_process`: one of several peers in this process, which share its
    device), made the current CUDA device of the calling thread (where nccl and new tensors go)."""
    if in_process:
        device = single_device(run.device)
    else:
        nccl = uses_nccl(run.backend, run.device)
        device = peer_device(run.device, rank, peers, nccl=nccl, share=run.device_share)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device
