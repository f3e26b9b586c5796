"""The `torch` backend: torch.distributed point-to-point ops and all_reduce (gloo on CPU, nccl on GPU).

How it works: docs/guide/internals.md#torch.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from dpsgd import netif

from .base import DEFAULT_TIMEOUT_S, Communicator
from .pending import Exchange, PeerTimeoutError, Pending, Request, communication_thread
from .staging import HostStaging, check_mode
from .store import master_store
from .transport import Transport, register

# a rendezvous the app's driver hands the peers it starts on one host: `file://` a file in a folder only this user can
# read (dpsgd.backends.torch_dist), so no TCP store listens for the run (any local user could reach one)
INIT_ENV = "DPSGD_TORCH_INIT"


def _init_group(dist_backend: str, timeout_s: float, init_method: str | None = None) -> None:
    """The default process group, gloo and nccl bound to the interface on the route to the master (`lo` on one host)."""
    if "MASTER_ADDR" in os.environ:
        netif.set_torch_interface(os.environ["MASTER_ADDR"])
    init_method = init_method or os.environ.get(INIT_ENV) or None
    store = None if init_method else master_store(timeout_s)  # bound to MASTER_ADDR, not every interface
    timeout = timedelta(seconds=timeout_s)
    if store is not None:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(dist_backend, store=store, rank=rank, world_size=world, timeout=timeout)
        return
    if init_method and "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # a file:// rendezvous reads no env
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(dist_backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout)
        return
    dist.init_process_group(dist_backend, init_method=init_method or "env://", timeout=timeout)


class _Works(Exchange):
    """torch.distributed works, each with its peer (-1 for a collective's); an exchange's `received` buffers."""

    def __init__(self, works: list, peers: list[int], received: dict[int, torch.Tensor] | None = None):
        self._works, self._peers = works, peers
        self._done = [False] * len(works)
        self.received = received if received is not None else {}

    def wait(self, deadline: float) -> None:
        for i, work in enumerate(self._works):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PeerTimeoutError("deadline passed")
            try:
                work.wait(timeout=timedelta(seconds=remaining))
            except RuntimeError as exc:  # gloo reports a timeout (or a dead peer) this way
                raise PeerTimeoutError(str(exc)) from exc
            self._done[i] = True

    def peers_outstanding(self) -> list[int]:
        return sorted({p for p, done in zip(self._peers, self._done) if p >= 0 and not done})


class _TorchRequest(Request):
    """gloo's point-to-point works report completion only through `wait()` (and a `wait` that
    times out breaks the connection), so `test()` hands the wait to a helper thread that sleeps
    in the library; the request is done when that thread returns."""

    def __init__(self, work, peer: int | None, timeout_s: float):
        self._work, self._peer, self._timeout_s = work, peer, timeout_s
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._waiter: threading.Thread | None = None
        self.source = peer

    def _wait_in_library(self) -> None:
        try:
            self._work.wait(timeout=timedelta(seconds=self._timeout_s))
            if self.source is None:
                self.source = int(self._work._source_rank())
        except BaseException as exc:  # noqa: BLE001 - re-raised by test() in the caller's thread
            self._error = exc
        finally:
            self._done.set()

    def test(self) -> bool:
        if self._waiter is None:
            self._waiter = communication_thread(
                threading.Thread(target=self._wait_in_library, name="dpsgd-torch-wait", daemon=True)
            )
            self._waiter.start()
        if not self._done.is_set():
            return False
        if self._error is not None:
            raise PeerTimeoutError(str(self._error)) from self._error
        return True

    def wait(self, deadline: float) -> None:
        if self._waiter is None:  # nobody tested it yet: wait here, in the library
            self._waiter = threading.current_thread()
            self._wait_in_library()
        elif not self._done.wait(timeout=max(0.0, deadline - time.monotonic())):
            raise PeerTimeoutError("deadline passed")
        self.test()  # done: raises the library's error, if any

    def peers_outstanding(self) -> list[int]:
        return [] if self._done.is_set() or self._peer is None else [self._peer]


class TorchCommunicator(Communicator):
    """One rank of torch.distributed: gloo on CPU (CUDA tensors through page-locked host buffers), nccl on
    GPU. Start the ranks with torchrun, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT."""

    backend = "torch"

    def __init__(
        self,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        dist_backend: str | None = None,
        init_method: str | None = None,
        group=None,
        staging: str = "auto",
    ):
        """`staging` (auto, always, never): CUDA tensors through host buffers; auto does it for gloo,
        which carries CUDA tensors in no point-to-point operation; always also stages CPU tensors."""
        self._staging_mode = check_mode(staging)
        self._group = group  # None: the default group; duplicate() makes others (of an initialized world)
        self._is_duplicate = group is not None
        if not dist.is_available():
            raise RuntimeError("this torch build has no torch.distributed; choose backend=local or backend=mpi")
        if not dist.is_initialized():
            init_method = init_method or os.environ.get(INIT_ENV) or None
            needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if init_method is None else ()
            for var in needed:
                if var not in os.environ:
                    raise RuntimeError(
                        f"backend=torch needs a launcher: {var} is not set. Start the peers with "
                        f"`torchrun --nproc-per-node N your_script.py` (the app: `torchrun --nproc-per-node N "
                        f"-m experiments.train backend=torch peers=N`), let experiments.train spawn them, or call "
                        f"torch.distributed.init_process_group first"
                    )
            _init_group(dist_backend or ("nccl" if torch.cuda.is_available() else "gloo"), timeout_s, init_method)
            # a group left alive at interpreter exit aborts the process (SIGABRT in gloo)
            atexit.register(self.close)
        super().__init__(dist.get_rank(), dist.get_world_size(), timeout_s)
        self.dist_backend = dist.get_backend(group)
        if self.dist_backend == "nccl" and staging == "always":
            raise ValueError("backend.staging=always hands nccl host buffers, which it cannot carry; use auto or never")
        if staging == "always" or (staging == "auto" and self.dist_backend != "nccl"):
            self.staging = HostStaging(always=staging == "always")

    def _start_exchange(self, buf, send_to, recv_from, tag, into=None) -> Exchange:
        received = dict(zip(recv_from, self._receive_buffers(buf, len(recv_from)))) if into is None else into
        ops = [dist.P2POp(dist.irecv, received[p], p, group=self._group, tag=tag) for p in recv_from]
        ops += [dist.P2POp(dist.isend, buf, p, group=self._group, tag=tag) for p in send_to]
        works = dist.batch_isend_irecv(ops) if ops else []
        return _Works(works, [*recv_from, *send_to], received)

    def duplicate(self) -> TorchCommunicator:
        # a new group of all ranks (gloo: the CPU tensors of asynchronous protocols) is its own context
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
        return TorchCommunicator(self.timeout_s, group=group, staging=self._staging_mode)

    def _start_send(self, buf, peer, tag) -> Request:
        return _TorchRequest(dist.isend(buf, peer, group=self._group, tag=tag), peer, self.timeout_s)

    def _start_recv(self, buf, source, tag) -> Request:
        return _TorchRequest(dist.irecv(buf, source, group=self._group, tag=tag), source, self.timeout_s)

    def _start_allreduce_sum(self, buf) -> Pending:
        return _Works([dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self._group, async_op=True)], [-1])

    def barrier(self) -> None:
        buf = torch.zeros(1, device="cuda" if self.dist_backend == "nccl" else "cpu")
        self._wait("barrier", _Works([dist.all_reduce(buf, group=self._group, async_op=True)], [-1]), range(self.size))

    def close(self) -> None:
        if self._is_duplicate:
            if self._group is not None and dist.is_initialized():
                # every peer is done with the group when it is released. Its gloo connections are torn
                # down with the default group (close() of the main communicator): destroying the
                # subgroup here aborted a peer at exit about once in 30 runs (std::terminate in gloo)
                self.barrier()
            self._group = None
        elif dist.is_initialized():
            dist.destroy_process_group()


class TorchTransport(Transport):
    """This rank of torch.distributed (torchrun, or RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT); options
    `dist_backend` ('gloo' or 'nccl'; default nccl when CUDA is present) and `init_method`."""

    name = "torch"
    processes = True
    host_staging = True

    def connect(self, timeout_s: float = DEFAULT_TIMEOUT_S, **options) -> Communicator:
        return TorchCommunicator(timeout_s=timeout_s, **options)

    config_options = {"dist_backend": None, "staging": "auto"}

    def options(self, backend: Mapping, device: str) -> dict:
        return {
            "dist_backend": self.dist_backend(backend, device),
            "staging": check_mode(backend.get("staging", "auto"), "backend.staging"),
        }

    @staticmethod
    def dist_backend(backend: Mapping, device: str) -> str:
        """`backend.dist_backend`, else nccl for peers on GPUs and gloo for peers on CPUs."""
        on_gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        return backend.get("dist_backend") or ("nccl" if on_gpu else "gloo")

    def uses_nccl(self, backend: Mapping, device: str) -> bool:
        return self.dist_backend(backend, device) == "nccl"

    def world(self) -> tuple[int, int] | None:
        size = int(os.environ.get("WORLD_SIZE", "1") or 1)
        return (int(os.environ["RANK"]), size) if size > 1 and "RANK" in os.environ else None

    def share(self, data: bytes, timeout_s: float) -> bytes:
        if not dist.is_initialized():
            _init_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo", timeout_s)
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()
        dist.broadcast(t, src=0)
        return bytes(t.tolist())

    def missing(self) -> str | None:
        if not dist.is_available():
            return (
                "backend=torch needs torch.distributed, which this torch build lacks; install a torch "
                "wheel from pytorch.org, or choose backend=local or backend=mpi"
            )
        return None


register(TorchTransport())
