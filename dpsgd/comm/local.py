"""The `local` backend: n peers as threads of one process, exchanging tensors through queues.

How it works: docs/guide/internals.md#local.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .base import DEFAULT_TIMEOUT_S, Communicator
from .pending import CommError, Exchange, PeerFailedError, PeerTimeoutError, Request
from .transport import Transport, register

_POLL_S = 0.05  # how often a blocked receive looks whether another peer failed


class LocalWorld:
    """The shared state of n in-process peers: one FIFO queue per (sender, receiver, tag)."""

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"a local world needs at least 1 peer, got {n}")
        self.n = n
        self._queues: dict[tuple[int, int, int], queue.SimpleQueue] = {}
        self._lock = threading.Lock()
        self._barrier = threading.Barrier(n)
        self.failed_rank: int | None = None
        self.stopped: str | None = None  # why the driver stopped every peer (its watchdog), once it did
        self.waiting_until: dict[int, float] = {}  # rank -> the deadline of the exchange it waits in now

    def channel(self, src: int, dst: int, tag: int) -> queue.SimpleQueue:
        key = (src, dst, tag)
        q = self._queues.get(key)
        if q is None:
            with self._lock:
                q = self._queues.setdefault(key, queue.SimpleQueue())
        return q

    def release(self, src: int, dst: int, tag) -> None:
        """Forget a drained channel of a one-off operation tag (tags cycle through 32768 values per
        communicator: kept, their queues grew the memory of a long run by 60% in 20k steps)."""
        key = (src, dst, tag)
        with self._lock:
            q = self._queues.get(key)
            if q is not None and q.empty():
                del self._queues[key]

    def fail(self, rank: int) -> None:
        """Record that `rank` failed: every peer blocked on the world then raises at once."""
        with self._lock:
            if self.failed_rank is None:
                self.failed_rank = rank
        self._barrier.abort()

    def stop(self, reason: str) -> None:
        """The driver ends the run (every peer is stuck): `run_local` raises CommError(reason) at
        once, and peers waiting on the world are released as if a peer had failed."""
        self.stopped = reason
        self.fail(-1)

    def waits_on_earlier(self, peer: int, deadline: float, until: float) -> bool:
        """Whether a peer waited for past `deadline` is itself waiting with an earlier deadline, until `until`: that
        peer's own timeout, nearer the run's first fault, is due first, and a busy machine can run this thread past its
        deadline before that peer's. Meanwhile the waiter leaves the timeout to that peer (released when the peer fails)
        so that the run reports the first fault, not a peer downstream of it."""
        earlier = self.waiting_until.get(peer)
        return earlier is not None and earlier < deadline and time.monotonic() < until

    def check(self, rank: int, op: str) -> None:
        if self.failed_rank is not None and self.failed_rank != rank:
            raise PeerFailedError(f"rank {rank}: {op} abandoned because peer {self.failed_rank} failed")


class _LocalExchange(Exchange):
    def __init__(self, world: LocalWorld, rank: int, recv_from: Sequence[int], tag: int):
        self._world, self._rank, self._tag = world, rank, tag
        self._missing = list(recv_from)
        self.received: dict[int, torch.Tensor] = {}

    def wait(self, deadline: float) -> None:
        world = self._world
        world.waiting_until[self._rank] = deadline
        patience = deadline + max(0.0, deadline - time.monotonic())  # at most one more timeout span after it
        try:
            while self._missing:
                peer = self._missing[0]
                q = world.channel(peer, self._rank, self._tag)
                while peer not in self.received:
                    world.check(self._rank, "receive")
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 and not world.waits_on_earlier(peer, deadline, patience):
                        raise PeerTimeoutError(f"peer {peer} did not answer")
                    with contextlib.suppress(queue.Empty):
                        self.received[peer] = q.get(timeout=min(remaining, _POLL_S) if remaining > 0 else _POLL_S)
                world.release(peer, self._rank, self._tag)
                self._missing.pop(0)
        finally:
            world.waiting_until.pop(self._rank, None)

    def peers_outstanding(self) -> list[int]:
        # peers whose message has not arrived (not merely not yet taken: they are taken in order)
        queues = self._world._queues
        return [p for p in self._missing if (q := queues.get((p, self._rank, self._tag))) is None or q.empty()]


class _LocalAllreduce(_LocalExchange):
    """All-to-all of the buffer, then every peer sums all n buffers in rank order: the same
    bits on every peer, whatever the thread timing."""

    def __init__(self, world: LocalWorld, rank: int, tag, buf: torch.Tensor):
        super().__init__(world, rank, [r for r in range(world.n) if r != rank], tag)
        self._buf = buf

    def wait(self, deadline: float) -> None:
        super().wait(deadline)
        total = torch.zeros_like(self._buf)
        for r in range(self._world.n):  # rank order: the same bits on every peer (0 + x is exact)
            total.add_(self._buf if r == self._rank else self.received[r])
        self._buf.copy_(total)


class _LocalSend(Request):
    def test(self) -> bool:
        return True  # the message was copied into the receiver's queue


class _LocalRecv(Request):
    """A receive from one peer, or from any (polling every sender's queue, round robin)."""

    def __init__(self, comm: LocalCommunicator, buf: torch.Tensor, source: int | None, tag):
        self._comm, self._buf, self._tag = comm, buf, tag
        self._sources = [source] if source is not None else [r for r in range(comm.size) if r != comm.rank]
        self._next = 0
        self.source = None

    def test(self) -> bool:
        if self.source is not None:
            return True
        world, rank = self._comm.world, self._comm.rank
        world.check(rank, "receive")
        for k in range(len(self._sources)):
            peer = self._sources[(self._next + k) % len(self._sources)]
            try:
                msg = world.channel(peer, rank, self._tag).get_nowait()
            except queue.Empty:
                continue
            self._buf.copy_(msg.view_as(self._buf))
            self.source, self._next = peer, (self._next + k + 1) % len(self._sources)
            return True
        return False

    def peers_outstanding(self) -> list[int]:
        return [] if self.source is not None else list(self._sources)


class LocalCommunicator(Communicator):
    """One peer of a `LocalWorld`: peers as threads of one process, messages as tensors handed over in memory
    (`run_local` makes them). Counts bytes as a network would carry them."""

    backend = "local"
    in_process = True

    def __init__(self, world: LocalWorld, rank: int, timeout_s: float = DEFAULT_TIMEOUT_S, namespace: tuple = ()):
        super().__init__(rank, world.n, timeout_s)
        self.world = world
        self.namespace = namespace  # () for the world's own context; duplicates get their own
        self._duplicates = 0
        self.drop_message = None  # fault injection (dpsgd.faults): drop_message(peer) -> True loses the message

    def _send(self, buf: torch.Tensor, peers: Sequence[int], key) -> None:
        """Copy `buf` into each peer's queue (but for the messages `drop_message` loses)."""
        self.world.check(self.rank, "send")
        for peer in peers:
            if self.drop_message is None or not self.drop_message(peer):
                self.world.channel(self.rank, peer, key).put(buf.clone())

    def _key(self, tag: int):
        return (self.namespace, tag) if self.namespace else tag

    def duplicate(self) -> LocalCommunicator:
        # every peer duplicates in the same order, so the n copies agree on the namespace
        self._duplicates += 1
        dup = LocalCommunicator(self.world, self.rank, self.timeout_s, self.namespace + (self._duplicates,))
        dup.drop_message = self.drop_message
        return dup

    def _start_send(self, buf, peer, tag) -> Request:
        self._send(buf, [peer], self._key(tag))
        return _LocalSend()

    def _start_recv(self, buf, source, tag) -> Request:
        return _LocalRecv(self, buf, source, self._key(tag))

    def _start_exchange(self, buf, send_to, recv_from, tag, into=None) -> _LocalExchange:
        # the peers hand each other tensors: `into` is copied to (neighbor_exchange)
        self._send(buf, send_to, self._key(tag))
        return _LocalExchange(self.world, self.rank, recv_from, self._key(tag))

    def _start_allreduce_sum(self, buf) -> _LocalAllreduce:
        key = self._key(self._next_tag())
        self._send(buf, [r for r in range(self.size) if r != self.rank], key)
        return _LocalAllreduce(self.world, self.rank, key, buf)

    def barrier(self) -> None:
        start = time.monotonic()
        try:
            self.world._barrier.wait(timeout=self.timeout_s)
        except threading.BrokenBarrierError:
            self.world.check(self.rank, "barrier")
            if time.monotonic() - start >= self.timeout_s:
                raise PeerTimeoutError(
                    f"rank {self.rank}: barrier timed out after {self.timeout_s:g} s"
                    f"{' at ' + self.context if self.context else ''}; a peer died or hangs"
                ) from None
            raise


_current = threading.local()


def current_peer() -> LocalCommunicator | None:
    """The communicator of the `run_local` peer running in this thread, if any."""
    return getattr(_current, "comm", None)


def run_local(
    n: int,
    fn: Callable[..., Any],
    *args,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    world: LocalWorld | None = None,
    **kwargs,
) -> list:
    """Run `fn(comm, *args, **kwargs)` on n in-process peers and return their results in rank
    order. If any peer raises, the others are released from their waits and the first
    failing peer's exception is raised here. `world` (of n peers): one the caller can `stop`."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"run_local needs n >= 1 peers, got {n!r}")
    world = world or LocalWorld(n)
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def peer(rank: int) -> None:
        comm = LocalCommunicator(world, rank, timeout_s)
        _current.comm = comm
        try:
            results[rank] = fn(comm, *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            errors[rank] = exc
            world.fail(rank)
        finally:
            _current.comm = None

    threads = [threading.Thread(target=peer, args=(r,), name=f"dpsgd-peer-{r}", daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    failed_at = None
    for t in threads:
        # a stuck thread cannot be killed: stop waiting for it when the world is stopped, or `timeout_s` after a
        # peer failed (the others are released from their waits at once; one busy outside any wait is left)
        while t.is_alive() and world.stopped is None:
            if world.failed_rank is not None:
                failed_at = failed_at or time.monotonic()
                if time.monotonic() - failed_at > timeout_s:
                    break
            t.join(0.1)
    if world.stopped is not None:
        raise CommError(world.stopped)
    if world.failed_rank is not None:
        raise errors[world.failed_rank] or CommError(f"peer {world.failed_rank} failed")
    return results


class LocalTransport(Transport):
    """Peers as threads of this process (`run_local`), no launcher."""

    name = "local"
    threads = True

    def connect(self, timeout_s: float = DEFAULT_TIMEOUT_S, **options) -> Communicator:
        """Inside `run_local`, this thread's peer; elsewhere a world of one peer."""
        return current_peer() or LocalCommunicator(LocalWorld(1), 0, timeout_s)


register(LocalTransport())
