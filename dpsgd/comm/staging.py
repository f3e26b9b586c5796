"""Host staging: CUDA tensors carried by transports that read host memory only (gloo's point-to-point
operations, an MPI library that is not CUDA-aware) through page-locked host buffers, reused.

How it works: docs/guide/internals.md#staging.
"""

from __future__ import annotations

import torch

from .pending import Exchange, Pending, Request

MODES = ("auto", "always", "never")
_KEPT_PER_SHAPE = 8


def check_mode(mode: str, name: str = "staging") -> str:
    """`mode` if it is one of MODES (auto, always, never); a ValueError naming them (and `name`, the option as the
    caller gave it: a communicator's `staging`, a config's `backend.staging`) otherwise."""
    if mode not in MODES:
        raise ValueError(f"{name} must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


class HostStaging:
    """The host buffers of one communicator (one thread uses a communicator at a time)."""

    def __init__(self, always: bool = False):
        self.always = always
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._stream: torch.cuda.Stream | None = None

    def applies(self, buf: torch.Tensor) -> bool:
        return buf.is_cuda or self.always

    def host_like(self, buf: torch.Tensor) -> torch.Tensor:
        """A host buffer shaped like `buf`: a kept one, else a new one, page-locked where CUDA is."""
        free = self._free.get((buf.shape, buf.dtype))
        if free:
            return free.pop()
        return torch.empty(buf.shape, dtype=buf.dtype, pin_memory=torch.cuda.is_available())

    def give_back(self, host: torch.Tensor) -> None:
        free = self._free.setdefault((host.shape, host.dtype), [])
        if len(free) < _KEPT_PER_SHAPE:
            free.append(host)

    def to_host(self, buf: torch.Tensor) -> torch.Tensor:
        """`buf` in a host buffer, its copy complete."""
        host = self.host_like(buf)
        if not buf.is_cuda:
            return host.copy_(buf)
        if self._stream is None:
            self._stream = torch.cuda.Stream(buf.device)
        self._stream.wait_stream(torch.cuda.current_stream(buf.device))  # the values are final there
        with torch.cuda.stream(self._stream):
            host.copy_(buf, non_blocking=True)
            buf.record_stream(self._stream)  # the allocator keeps buf until this copy is done
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()  # this copy only: the computing stream runs on
        return host

    # --- the backend primitives, staged ------------------------------------------------------------
    def exchange(self, start, comm, buf: torch.Tensor, send_to, recv_from, tag: int, into=None) -> Exchange:
        """`into`: the caller's tensors by peer (`neighbor_exchange`'s out=): each host buffer received is copied
        straight there, with no device buffer between."""
        host = self.to_host(buf)
        return _StagedExchange(self, comm, buf, host, start(host, send_to, recv_from, tag), into)

    def allreduce_sum(self, start, buf: torch.Tensor) -> Pending:
        host = self.to_host(buf)
        return _CopyBack(self, start(host), host, buf)

    def send(self, start, buf: torch.Tensor, peer: int, tag: int) -> Request:
        host = self.to_host(buf)
        return _StagedRequest(self, start(host, peer, tag), host, None, peer)

    def recv(self, start, buf: torch.Tensor, source: int | None, tag: int) -> Request:
        host = self.host_like(buf)
        return _StagedRequest(self, start(host, source, tag), host, buf, source)


class _StagedExchange(Exchange):
    def __init__(self, staging: HostStaging, comm, buf: torch.Tensor, host: torch.Tensor, inner: Exchange, into=None):
        self._staging, self._comm, self._buf, self._host, self._inner = staging, comm, buf, host, inner
        self._into = into
        self.received = {}

    def wait(self, deadline: float) -> None:
        self._inner.wait(deadline)
        hosts = self._inner.received
        if self._into is not None:
            targets = [self._into[peer] for peer in hosts]
        else:
            targets = self._comm._receive_buffers(self._buf, len(hosts))
        for (peer, host), target in zip(hosts.items(), targets):
            self.received[peer] = target.copy_(host)
        self._comm._release_buffers(hosts.values())
        self._staging.give_back(self._host)

    def peers_outstanding(self) -> list[int]:
        return self._inner.peers_outstanding()


class _CopyBack(Pending):
    def __init__(self, staging: HostStaging, inner: Pending, host: torch.Tensor, out: torch.Tensor):
        self._staging, self._inner, self._host, self._out = staging, inner, host, out

    def wait(self, deadline: float) -> None:
        self._inner.wait(deadline)
        self._out.copy_(self._host)
        self._staging.give_back(self._host)

    def peers_outstanding(self) -> list[int]:
        return self._inner.peers_outstanding()

    def progress(self) -> None:
        self._inner.progress()


class _StagedRequest(Request):
    """A send from, or a receive into, a host buffer; a receive's values reach `out` once it completes."""

    def __init__(self, staging, inner: Request, host: torch.Tensor, out: torch.Tensor | None, peer: int | None):
        self._staging, self._inner, self._host, self._out = staging, inner, host, out
        self._done = False
        self.source = peer

    def test(self) -> bool:
        if not self._done and self._inner.test():
            self._done = True
            self.source = self._inner.source
            if self._out is not None:
                self._out.copy_(self._host)
            self._staging.give_back(self._host)
        return self._done

    def peers_outstanding(self) -> list[int]:
        return self._inner.peers_outstanding()
