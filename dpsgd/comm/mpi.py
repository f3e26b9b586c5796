"""The `mpi` backend: mpi4py point-to-point messages and all-reduce on a duplicated communicator.

How it works: docs/guide/internals.md#mpi.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from functools import partial

import torch

from .base import DEFAULT_TIMEOUT_S, Communicator
from .pending import Exchange, PeerFailedError, Pending, Request, poll_until
from .staging import HostStaging, check_mode
from .transport import Transport, register


def load_mpi():
    """Import mpi4py.MPI, or say how to install an MPI runtime."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise RuntimeError(
            f"the mpi backend needs mpi4py and an MPI runtime ({exc}); install both from PyPI with "
            f"`pip install mpi4py mpich`, or choose backend=local or backend=torch"
        ) from exc
    return MPI


def cuda_aware(MPI) -> bool:
    """Whether the MPI library under mpi4py reads and writes GPU memory itself. Asked of the library
    (MPIX_Query_cuda_support, looked up through mpi4py's extension, which links it); False where absent."""
    try:
        query = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return False
    return bool(query())


def _ready(t: torch.Tensor) -> None:
    """A CUDA-aware MPI reads and writes device memory outside CUDA's streams: let the kernels queued on
    the device of `t` (the flattening copy, the last use of a reused receive buffer) finish first."""
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


def _as_buffer(t: torch.Tensor):
    """The memory of a contiguous tensor, typed, as something mpi4py can reduce without copying."""
    if t.is_cuda:
        return t  # __cuda_array_interface__: needs CUDA-aware MPI
    return t.view(torch.uint8).numpy() if t.dtype == torch.bfloat16 else t.numpy()


# a collective's ranks arrive about together: its first milliseconds are polled without sleeping (pending.poll_until)
SPIN_S = 2e-3


class _Requests(Exchange):
    """MPI requests, each with its peer (-1 for a collective's); an exchange's `received` buffers; `memory`, the tensors
    the requests read and write, kept alive with them (they hold only addresses)."""

    def __init__(
        self,
        MPI,
        requests: list,
        peers: list[int],
        received: dict[int, torch.Tensor] | None = None,
        memory: tuple = (),
    ):
        self._MPI, self._requests, self._peers, self._memory = MPI, requests, peers, memory
        self.received = received if received is not None else {}

    def wait(self, deadline: float) -> None:
        try:
            test = partial(self._MPI.Request.Testall, self._requests)
            poll_until(test, deadline, self.peers_outstanding, spin_s=SPIN_S)
        except self._MPI.Exception as exc:  # MPICH: a peer's process ended under a pending request
            peers = sorted({p for p in self._peers if p >= 0})
            raise PeerFailedError(
                f"peer(s) {peers or 'of a collective'} failed or cannot be reached (MPI: {exc.Get_error_string()})"
            ) from None

    def progress(self) -> None:
        try:
            self._MPI.Request.Testall(self._requests)
        except self._MPI.Exception:
            pass  # a failed peer: wait() says which

    def peers_outstanding(self) -> list[int]:
        # a collective has no single peer to blame: the caller then names all of them
        return sorted({p for p, r in zip(self._peers, self._requests) if p >= 0 and not r.Test()})


class _MPIRequest(Request):
    def __init__(self, MPI, request, peer: int | None):
        self._MPI, self._request, self._peer = MPI, request, peer
        self._status = MPI.Status()
        self._done = False
        self.source = peer

    def test(self) -> bool:
        if not self._done and self._request.Test(self._status):
            self._done = True
            if self.source is None:
                self.source = self._status.Get_source()
        return self._done

    def peers_outstanding(self) -> list[int]:
        return [] if self._done or self._peer is None else [self._peer]


class MPICommunicator(Communicator):
    """One rank of an MPI world (mpi4py): CPU tensors travel as zero-copy buffers, CUDA tensors directly on a
    CUDA-aware MPI or through page-locked host buffers otherwise. Start the ranks with mpiexec or srun."""

    backend = "mpi"

    def __init__(self, comm=None, timeout_s: float = DEFAULT_TIMEOUT_S, staging: str = "auto"):
        """`staging` (auto, always, never): CUDA tensors through host buffers; auto does it unless the
        MPI library is CUDA-aware, always also stages CPU tensors (the staged path without a GPU)."""
        MPI = load_mpi()
        self._staging_mode = check_mode(staging)
        # our own context: user code using COMM_WORLD can never match our messages. Duplicating is
        # collective: non-blocking, so that a peer that never arrives is a timeout, not a hang
        parent = comm or MPI.COMM_WORLD
        self._MPI, (self._comm, request) = MPI, parent.Idup()
        super().__init__(parent.Get_rank(), parent.Get_size(), timeout_s)
        self._wait("start-up (MPI communicator duplication)", _Requests(MPI, [request], [-1]), range(self.size))
        self.cuda_aware = cuda_aware(MPI)
        if staging == "always" or (staging == "auto" and not self.cuda_aware):
            self.staging = HostStaging(always=staging == "always")

    def _start_exchange(self, buf, send_to, recv_from, tag, into=None) -> Exchange:
        # `buf` and every target: flat, contiguous, of one size and device (see Communicator._start_exchange). On the
        # CPU a message is a view of the tensor's address (a third of numpy()'s cost), which does not keep the tensor
        # alive: the requests' holder keeps them all, `targets` included (a peer named twice in recv_from has two
        # targets, of which `received` keeps only the last). Each tensor call on this path counts under contention
        # (docs/results/benchmarks.md), hence one device test and one size per exchange.
        MPI, comm, received, reqs = self._MPI, self._comm, {}, []
        targets = self._receive_buffers(buf, len(recv_from)) if into is None else [into[p] for p in recv_from]
        if buf.is_cuda:  # __cuda_array_interface__: needs CUDA-aware MPI
            _ready(buf)  # also covers the last use of a kept receive buffer: it was queued on the same stream
            sent, messages = buf, targets
        else:
            address, nbytes = MPI.buffer.fromaddress, buf.nbytes
            sent, messages = address(buf.data_ptr(), nbytes), [address(t.data_ptr(), nbytes) for t in targets]
        for p, target, message in zip(recv_from, targets, messages):
            received[p] = target
            reqs.append(comm.Irecv(message, source=p, tag=tag))
        reqs += [comm.Isend(sent, dest=p, tag=tag) for p in send_to]
        return _Requests(MPI, reqs, [*recv_from, *send_to], received, (buf, targets))

    def duplicate(self) -> MPICommunicator:
        return MPICommunicator(self._comm, self.timeout_s, self._staging_mode)  # __init__ Dup()s it: a new context

    def require_thread_multiple(self, why: str) -> None:
        """Raise unless MPI runs with MPI_THREAD_MULTIPLE (several threads calling MPI at once)."""
        level = self._MPI.Query_thread()
        if level != self._MPI.THREAD_MULTIPLE:
            names = {getattr(self._MPI, n): n for n in ("THREAD_SINGLE", "THREAD_FUNNELED", "THREAD_SERIALIZED")}
            raise RuntimeError(
                f"{why} needs MPI_THREAD_MULTIPLE, but MPI was initialized with {names.get(level, level)}; "
                f"let mpi4py initialize MPI (its default asks for THREAD_MULTIPLE, `mpi4py.rc.thread_level`), "
                f"use an MPI library built with thread support, or choose backend=torch or backend=local"
            )

    def _start_send(self, buf, peer, tag) -> Request:
        _ready(buf)
        return _MPIRequest(self._MPI, self._comm.Isend(_as_buffer(buf), dest=peer, tag=tag), peer)

    def _start_recv(self, buf, source, tag) -> Request:
        src = self._MPI.ANY_SOURCE if source is None else source
        _ready(buf)
        return _MPIRequest(self._MPI, self._comm.Irecv(_as_buffer(buf), source=src, tag=tag), source)

    def _start_allreduce_sum(self, buf) -> Pending:
        if buf.dtype in (torch.bfloat16, torch.float16) and not buf.is_cuda:
            raise TypeError(f"the mpi backend reduces float32/float64 on the CPU, got {buf.dtype}; cast first")
        _ready(buf)
        req = self._comm.Iallreduce(self._MPI.IN_PLACE, _as_buffer(buf), op=self._MPI.SUM)
        return _Requests(self._MPI, [req], [-1])

    def barrier(self) -> None:
        req = self._comm.Ibarrier()
        self._wait("barrier", _Requests(self._MPI, [req], [-1]), range(self.size))

    def close(self) -> None:
        if self._comm != self._MPI.COMM_NULL:
            self._comm.Free()

    def abort(self, code: int = 1) -> None:
        """End every rank of the world (a failed peer must not leave the others waiting)."""
        self._MPI.COMM_WORLD.Abort(code)


def mpi_import_error() -> str | None:
    """Why mpi4py cannot load an MPI library here, or None. Tried in a child process: loading MPI
    into this one would initialize it here."""
    probe = "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    if proc.returncode == 0:
        return None
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    return f"`from mpi4py import MPI` fails ({lines[-1] if lines else f'exit code {proc.returncode}'})"


class MPITransport(Transport):
    """This rank of the MPI world that mpiexec or srun started."""

    name = "mpi"
    processes = True
    host_staging = True

    def connect(self, timeout_s: float = DEFAULT_TIMEOUT_S, **options) -> Communicator:
        return MPICommunicator(timeout_s=timeout_s, **options)

    config_options = {"staging": "auto"}

    def options(self, backend: Mapping, device: str) -> dict:
        return {"staging": check_mode(backend.get("staging", "auto"), "backend.staging")}

    def world(self) -> tuple[int, int] | None:
        sizes = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")  # set by mpiexec/srun
        if all(int(os.environ.get(var, "1") or 1) <= 1 for var in sizes):
            return None
        world = load_mpi().COMM_WORLD
        return world.Get_rank(), world.Get_size()

    def share(self, data: bytes, timeout_s: float) -> bytes:
        """As fixed-size bytes (nothing received is unpickled), waiting by polling: PeerTimeoutError
        when a rank never arrives."""
        buf = bytearray(data)
        request = load_mpi().COMM_WORLD.Ibcast(buf, root=0)
        poll_until(request.Test, time.monotonic() + timeout_s)
        return bytes(buf)

    def missing(self) -> str | None:
        problem = mpi_import_error()
        if problem:
            return (
                f"backend=mpi needs mpi4py and an MPI runtime, but {problem}; install both with "
                f"`pip install mpi4py mpich` (or load your cluster's MPI and `pip install mpi4py`), "
                f"or choose backend=local or backend=torch"
            )
        return None


register(MPITransport())
