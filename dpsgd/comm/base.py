"""The Communicator protocol: what optimizers may ask of their peers, on every backend.

How it works: docs/guide/internals.md#communicator.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from topologies import Neighbors, Topology

from .netem import NetworkEmulator, ring_allreduce_bytes
from .pending import Exchange, PeerTimeoutError, Pending, Request

if TYPE_CHECKING:
    from .staging import HostStaging

DEFAULT_TIMEOUT_S = 120.0


@dataclass
class CommStats:
    """Traffic and time counters of one peer. Bytes are payload bytes of the algorithm's
    messages; an all-reduce of M bytes is counted at the bandwidth-optimal ring cost,
    2 (n-1)/n M sent and as much received, whatever the backend does underneath, so
    figures compare across backends."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    comm_time_s: float = 0.0  # time spent blocked waiting for peers
    # time between starting a non-blocking operation and waiting for it: the computation that
    # communication could hide behind (an upper bound of the communication time hidden)
    overlap_s: float = 0.0
    # with an emulated network (dpsgd.comm.netem): emulated time spent waiting for modelled messages
    emulated_wait_s: float = 0.0
    # the most bytes sent in one training step (the training loop keeps it): the peak a link must carry
    peak_step_bytes: int = 0
    calls: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


MAX_TAG = 32767  # the smallest MPI_TAG_UB the standard allows
_KEPT_BUFFERS_PER_SHAPE = 8  # receive buffers kept for reuse, per shape/dtype/device
# a public started form -> the hook that serves it and its blocking form (Communicator.__init_subclass__)
_HOOKS = {"start_neighbor_average": "_start_neighbor_average", "start_mix": "_start_mix"}


class Handle:
    """A started public operation; `wait()` returns its result as a list of tensors shaped
    like the input list."""

    def __init__(
        self,
        comm: Communicator,
        op: str,
        pending: Pending,
        finish,
        peers: Sequence[int],
        arrival=None,
        buf: torch.Tensor | None = None,
    ):
        self._comm, self._op, self._pending, self._finish = comm, op, pending, finish
        self._arrival = arrival  # emulated network: when the last message this operation needs arrives
        self._peers = peers  # named by a timeout's message only
        self._result: list[torch.Tensor] | None = None
        self._started = time.monotonic()
        self._counting = comm._counting
        # on a GPU (where `buf`, the buffer sent, lives) the host only queues work: the computation overlapped is
        # timed on the device
        self._started_on_device = None
        if buf is not None and buf.is_cuda and self._counting:
            self._started_on_device = torch.cuda.Event(enable_timing=True)
            self._started_on_device.record()

    def _count_overlap(self) -> None:
        if self._started_on_device is None:
            self._comm.stats.overlap_s += time.monotonic() - self._started
            return
        waited = torch.cuda.Event(enable_timing=True)
        waited.record()
        self._comm._device_overlap.append((self._started_on_device, waited))
        self._comm._settle_device_overlap()

    def progress(self) -> None:
        """Let the operation advance now, without waiting (a no-op where the backend needs no help)."""
        if self._result is None:
            self._pending.progress()

    def wait(self) -> list[torch.Tensor]:
        if self._result is None:
            if self._counting:
                self._count_overlap()
            self._comm._wait(self._op, self._pending, self._peers)
            arrival = self._arrival() if self._arrival is not None else None  # before finish() frees buffers
            self._result = self._finish()
            if arrival is not None:
                self._comm._wait_for_arrival(arrival)
        return self._result


def mixing_neighbors(topology: Topology, rank: int, step: int, lazy: bool = False) -> Neighbors:
    """Peer `rank`'s weights of W(step), or of (I + W(step)) / 2 when `lazy`."""
    nb = topology.neighbors(rank, step)
    if not lazy:
        return nb
    return Neighbors(
        {j: v / 2 for j, v in nb.recv.items()}, {j: v / 2 for j, v in nb.send.items()}, (1 + nb.self_weight) / 2
    )


def group_neighbors(rank: int, group_size: int) -> Neighbors:
    """Peer `rank`'s weights of the mean over its group, peers [g k, g (k + 1)) for group size g."""
    first = rank // group_size * group_size
    others = {m: 1.0 / group_size for m in range(first, first + group_size) if m != rank}
    return Neighbors(others, dict(others), 1.0 / group_size)


def _is_message(t: torch.Tensor) -> bool:
    """Whether a tensor's memory already is a message's flat buffer: contiguous, no lazy conjugate or negation bit
    (the transports send and receive memory as it is)."""
    return t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _lone(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The one tensor of `tensors` if its memory already is a message's flat buffer (`_is_message`), else None: such
    a tensor is copied once (`flatten`) or, lent, read in place."""
    return tensors[0] if len(tensors) == 1 and _is_message(tensors[0]) else None


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a 1-D tensor outside autograd, with no new view where it already is one: on the
    path of every small message, where each torch call counts (4 ranks on 2 cores, benchmarks.md)."""
    if t.requires_grad:
        t = t.detach()
    return t if t.dim() == 1 else t.view(-1)


def _unfit(t: torch.Tensor, numel: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why `t` cannot take a message of `numel` elements of `dtype` on `device` (an out= tensor), or None where it can:
    it must be outside autograd and a message's flat buffer as it lies (`_is_message`). The common case, None, builds
    no string."""
    if t.requires_grad:
        return "requires grad"
    if not _is_message(t):
        return "is not contiguous" if not t.is_contiguous() else "is a lazy conjugate or negative view"
    if t.dtype != dtype or t.numel() != numel or t.device != device:
        return f"is {tuple(t.shape)} {t.dtype} on {t.device}"
    return None


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous buffer holding all tensors (one message per peer instead of many): new memory."""
    if not tensors:
        raise ValueError("expected a non-empty list of tensors to communicate, got an empty one")
    lone = _lone(tensors)
    if lone is not None:  # one copy, without the checks and the concatenation
        return _flat(lone).clone()
    dtypes = {t.dtype for t in tensors}
    devices = {t.device for t in tensors}
    if len(dtypes) > 1 or len(devices) > 1:
        raise TypeError(
            f"tensors communicated together must share one dtype and device, got dtypes "
            f"{sorted(map(str, dtypes))} on {sorted(map(str, devices))}; call once per dtype/device"
        )
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `flat` shaped like the tensors of `like`, in order (the inverse of `flatten`); `flat` itself for one
    tensor of its shape."""
    if len(like) == 1 and flat.numel() == like[0].numel():
        return [flat if flat.shape == like[0].shape else flat.view_as(like[0])]
    out, offset = [], 0
    for t in like:
        n = t.numel()
        out.append(flat[offset : offset + n].view_as(t))
        offset += n
    return out


def _start_exchange_of(comm: Communicator, buf, send_to, recv_from, tag: int, into) -> Exchange:
    """`comm._start_exchange`, given `into` only where there is one: a backend written before `into` (without the
    parameter) keeps working wherever out= is not used."""
    if into is None:
        return comm._start_exchange(buf, send_to, recv_from, tag)
    return comm._start_exchange(buf, send_to, recv_from, tag, into=into)


class Communicator(ABC):
    """One peer's view of a world of `size` peers. Every blocking wait has a deadline of
    `timeout_s` seconds; past it, a PeerTimeoutError names the operation and the peers.

    A subclass changes an average or a mix through `_start_neighbor_average(tensors, weights, lent)` and
    `_start_mix(tensors, topology, step, lazy, lent)`, which serve the started and the blocking forms alike."""

    backend: str = "?"
    in_process = False  # its peers are threads of one process (they share its device)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # the blocking forms call the hooks, not the public started forms: an override of those alone would be
        # bypassed by neighbor_average and mix without a word
        for public, hook in _HOOKS.items():
            if public in vars(cls):
                raise TypeError(
                    f"{cls.__name__} overrides {public}, which neighbor_average and mix do not call; override "
                    f"{hook}(..., lent) instead, which serves both forms (lent: the caller's tensors may be read in "
                    f"place until the blocking form returns)"
                )

    def __init__(self, rank: int, size: int, timeout_s: float = DEFAULT_TIMEOUT_S):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
        self.rank, self.size, self.timeout_s = rank, size, float(timeout_s)
        self.stats = CommStats()
        self.context = ""  # e.g. "step 12": the training loop sets it so errors say when
        self._counting = True
        self._tag = 0
        self._free_buffers: dict[tuple, list[torch.Tensor]] = {}
        # operations whose wait timed out, kept for good: a transfer still posted may yet read or write the memory
        # they hold (an MPI request holds only its address), which must not be freed and reused under it
        self._timed_out: list[Pending] = []
        self.network: NetworkEmulator | None = None  # see attach_network
        # CUDA tensors through host buffers, for transports that read host memory only (dpsgd.comm.staging)
        self.staging: HostStaging | None = None
        self._device_overlap: list = []  # (start, wait) CUDA event pairs not yet reached by the device
        # while a mix starts: every peer's destinations in it (how many messages share a host's emulated link)
        self._senders: Callable[[int], Sequence[int]] | None = None

    def _settle_device_overlap(self) -> None:
        """Add the device time of the overlaps the GPU has got past (events complete in order); never
        waits for the device, so the host keeps queuing work ahead of it."""
        while self._device_overlap and self._device_overlap[0][1].query():
            start, waited = self._device_overlap.pop(0)
            self.stats.overlap_s += start.elapsed_time(waited) / 1000

    @property
    def exact(self) -> Communicator:
        """This communicator with exact messages: itself, or the one a compressing wrapper wears."""
        return self

    def attach_network(self, network: NetworkEmulator) -> None:
        """Emulate `network` (a `dpsgd.comm.netem.NetworkEmulator`) in every counted operation: messages carry
        their emulated arrival time and waits advance (or, in sleep mode, really wait for) the clock."""
        self.network = network

    # --- backend primitives -------------------------------------------------------------
    @abstractmethod
    def _start_exchange(
        self,
        buf: torch.Tensor,
        send_to: Sequence[int],
        recv_from: Sequence[int],
        tag: int,
        into: dict[int, torch.Tensor] | None = None,
    ) -> Exchange:
        """Send `buf` to every peer of `send_to` and receive a buffer shaped like `buf` from every
        peer of `recv_from`, without blocking. `buf` is flat and contiguous (the public operations flatten or check it),
        as is every tensor of `into`: a transport may send and receive their memory as it lies. `into`: where to receive
        each peer's buffer (the caller's `out=`), for a backend that receives into memory it is given; one that ignores
        it is copied from (`neighbor_exchange`)."""

    @abstractmethod
    def _start_allreduce_sum(self, buf: torch.Tensor) -> Pending:
        """Sum `buf` over all peers, in place, without blocking."""

    @abstractmethod
    def barrier(self) -> None:
        """Return once every peer has called `barrier()` (within the deadline)."""

    def any_peer(self, flag: bool, device: torch.device | str | None = None) -> bool:
        """Whether `flag` is set on any peer: a collective of one number (on `device`, where the transport needs
        it), control traffic left out of `stats`. A wrapper passes it to the communicator it wears, so a robust
        rule or a codec never turns the sum into something else."""
        with self.uncounted():
            total = self.allreduce_sum([torch.tensor([float(flag)], device=device)])[0]
        return bool(total.item() > 0)

    def close(self) -> None:  # noqa: B027 - most backends hold nothing to release
        """Release backend resources; the communicator cannot be used afterwards."""

    # --- for asynchronous protocols (AD-PSGD): optional per backend ---------------------
    def duplicate(self) -> Communicator:
        """A communicator over the same peers with its own message context (MPI `Dup`, a new
        gloo group, a separate local namespace), so that a second thread (a communication
        thread) can use it and its messages never match this one's. Collective: every peer calls
        it, in the same order. Close it when done."""
        raise NotImplementedError(f"the {self.backend} backend has no duplicate()")

    def _start_send(self, buf: torch.Tensor, peer: int, tag: int) -> Request:
        raise NotImplementedError(f"the {self.backend} backend has no point-to-point send")

    def _start_recv(self, buf: torch.Tensor, source: int | None, tag: int) -> Request:
        raise NotImplementedError(f"the {self.backend} backend has no point-to-point receive")

    # --- public operations --------------------------------------------------------------
    def start_allreduce_mean(self, tensors: Sequence[torch.Tensor], stream: str = "") -> Handle:
        """Start averaging `tensors` over all peers; `.wait()` returns the averages. `stream` names the
        series of means this one belongs to (gradients, outer deltas): a compressing wrapper keeps one error
        memory per stream (dpsgd.comm.codecs); exact communicators ignore it."""
        return self._start_allreduce_flat(flatten(tensors), tensors, "allreduce_mean", mean=True)

    def allreduce_mean(self, tensors: Sequence[torch.Tensor], stream: str = "") -> list[torch.Tensor]:
        """The mean of `tensors` over all peers, (1/n) sum_j x_j, as new tensors (a ring all-reduce's bytes)."""
        return self.start_allreduce_mean(tensors, stream).wait()

    def start_allreduce_sum(self, tensors: Sequence[torch.Tensor]) -> Handle:
        """Start summing `tensors` over all peers; `.wait()` returns the sums."""
        return self._start_allreduce_flat(flatten(tensors), tensors, "allreduce_sum", mean=False)

    def allreduce_sum(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The sum of `tensors` over all peers, sum_j x_j, as new tensors."""
        return self.start_allreduce_sum(tensors).wait()

    def start_allreduce_sum_(self, buf: torch.Tensor) -> Handle:
        """In place: sum the flat, contiguous `buf` over all peers into `buf` itself, with no copy (for buffers
        the caller keeps, such as gradient buckets whose gradients are views of them); `.wait()` returns [buf].
        `buf` must not be touched until then."""
        if buf.dim() != 1 or not buf.is_contiguous():
            raise ValueError(
                f"start_allreduce_sum_ reduces one flat contiguous buffer in place, got shape {tuple(buf.shape)} "
                f"(contiguous: {buf.is_contiguous()}); pass a 1-D tensor, or use start_allreduce_sum for a list"
            )
        return self._start_allreduce_flat(buf, [buf], "allreduce_sum", mean=False)

    def _start_allreduce_flat(self, buf: torch.Tensor, like: Sequence[torch.Tensor], op: str, mean: bool) -> Handle:
        """Sum (or average) `buf` in place and return it shaped like `like`; the public operations pass a fresh
        copy (`flatten`), so the reduction never touches the caller's tensors."""
        ring = ring_allreduce_bytes(buf.nbytes, self.size)
        self._count(op, sent=ring, received=ring, messages=2 * (self.size - 1))
        pending = self._allreduce_sum(buf) if self.size > 1 else _Done()
        arrival = None
        net = self._emulation()
        if net is not None and self.size > 1:
            # every peer's start time, summed into its own slot: the reduction completes at the latest
            started = torch.zeros(self.size, dtype=torch.float64, device=buf.device)
            started[self.rank] = net.clock.now() + net.jitter()
            pending = _All([pending, self._allreduce_sum(started)])

            def arrival(net=net):
                return float(started.max()) + net.allreduce_time(buf.nbytes)

        def finish():
            return unflatten(buf.div_(self.size) if mean else buf, like)

        return Handle(self, op, pending, finish, range(self.size), arrival, buf)

    def start_neighbor_average(self, tensors: Sequence[torch.Tensor], weights: Neighbors) -> Handle:
        """Send `tensors` to `weights.send`'s peers, receive from `weights.recv`'s, and (at
        `.wait()`) return self_weight * x_i + sum_j recv[j] * x_j. The weights are applied on
        the receiving side, so one buffer goes to every out-neighbour. A copy of `tensors` is sent: the caller may
        change them before `.wait()`."""
        return self._start_neighbor_average(tensors, weights, lent=False)

    def neighbor_average(self, tensors: Sequence[torch.Tensor], weights: Neighbors) -> list[torch.Tensor]:
        """Send `tensors` to the peers of `weights.send`, receive from those of `weights.recv`, and return
        self_weight x_i + sum_j recv[j] x_j: row i of a mixing matrix applied to the peers' tensors."""
        return self._start_neighbor_average(tensors, weights, lent=True).wait()

    def _start_neighbor_average(self, tensors: Sequence[torch.Tensor], weights: Neighbors, lent: bool) -> Handle:
        """`start_neighbor_average`; `lent`: the caller cannot touch `tensors` before the result (the blocking
        forms), so a list of one contiguous tensor is sent from the tensor's own memory and read once more by the
        sum, instead of copied first (the 11 MiB average on mpi: 1.11-1.17x raw -> 0.96-0.98x, benchmarks.md). After
        a timeout a send may still read it. The override point of both forms (and of `_start_mix`'s)."""
        lone = _lone(tensors) if lent else None
        buf = flatten(tensors) if lone is None else _flat(lone)
        recv_from = sorted(weights.recv)
        ex, received, arrival = self._start_counted_exchange("neighbor_average", buf, sorted(weights.send), recv_from)

        def finish():
            # the sends are complete: the sum is built in our own copy, or beside the caller's tensor in a new one of
            # its dtype (as mul_ writes: an integer tensor is refused by both forms alike); the receive buffers
            # (never seen by the caller) are kept for the next exchange
            w = weights.self_weight
            out = buf.mul_(w) if lone is None else torch.mul(buf, w, out=torch.empty_like(buf))
            for peer in recv_from:  # rank order: the same sum on every backend
                out.add_(received(peer), alpha=weights.recv[peer])
            self._release_buffers(ex.received.values())
            return unflatten(out, tensors)

        return Handle(self, "neighbor_average", ex, finish, recv_from, arrival, buf)

    def start_neighbor_exchange(
        self,
        buf: torch.Tensor,
        send_to: Sequence[int],
        recv_from: Sequence[int],
        out: Sequence[torch.Tensor] | None = None,
    ) -> Handle:
        """Send one flat buffer (any dtype, e.g. a compressed message packed as bytes) to
        `send_to` and receive a buffer of the same shape and dtype from each of `recv_from`;
        `.wait()` returns them as a list in the order of `recv_from`. Bytes are counted as sent.
        `out`: one contiguous tensor per peer of `recv_from` (as many elements as `buf`, its dtype and device) that the
        received buffers are written to and returned, instead of new ones; the caller must not touch them before
        `.wait()`, and after a timeout a late message may still be written to them. On mpi and torch they are received
        into directly, which spares the receive buffers' first touch each call (what new buffers cost:
        docs/results/benchmarks.md); elsewhere (staged, emulated network, local) copied to."""
        buf = _flat(buf) if _is_message(buf) else flatten([buf])  # (a lazy conjugate resolved in a copy)
        recv_from = list(recv_from)
        if out is not None:
            into, written = self._receive_into(buf, recv_from, out), list(out)
        else:
            into = None
        ex, received, arrival = self._start_counted_exchange("neighbor_exchange", buf, list(send_to), recv_from, into)
        if into is None:
            return Handle(
                self, "neighbor_exchange", ex, lambda: [received(p) for p in recv_from], recv_from, arrival, buf
            )

        def finish():
            for p, target in into.items():
                got = received(p)
                if got is not target:  # a backend or path that received elsewhere
                    target.copy_(got)
            return written

        return Handle(self, "neighbor_exchange", ex, finish, recv_from, arrival, buf)

    def neighbor_exchange(
        self,
        buf: torch.Tensor,
        send_to: Sequence[int],
        recv_from: Sequence[int],
        out: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """The blocking form of `start_neighbor_exchange`: the buffers received, in the order of `recv_from` (with
        `out`: its tensors, written)."""
        return self.start_neighbor_exchange(buf, send_to, recv_from, out).wait()

    def start_exchange(self, tensors: Sequence[torch.Tensor], peer: int) -> Handle:
        """Pairwise exchange (AD-PSGD's primitive): send `tensors` to `peer` and return the
        peer's tensors, shaped like ours."""
        buf = flatten(tensors)
        ex, received, arrival = self._start_counted_exchange("exchange", buf, [peer], [peer])
        return Handle(self, "exchange", ex, lambda: unflatten(received(peer), tensors), [peer], arrival, buf)

    def exchange(self, tensors: Sequence[torch.Tensor], peer: int) -> list[torch.Tensor]:
        """Pairwise exchange (AD-PSGD's primitive): send `tensors` to `peer`, return its tensors, shaped like ours."""
        return self.start_exchange(tensors, peer).wait()

    # --- the operations update rules are made of (dpsgd.optim) ----------------------------
    # A fleet (dpsgd.sim) overrides these on tensors with a leading peer axis, so one statement of
    # each rule runs on real peers and on the fleet alike.
    peer_shape: tuple[int, ...] = ()  # the leading axes of a peer's tensors: () here, (n,) on a fleet

    def start_mix(self, tensors: Sequence[torch.Tensor], topology: Topology, step: int, lazy: bool = False) -> Handle:
        """Start sum_j W(step)[i, j] x_j with the topology's mixing matrix (lazy: with (I + W) / 2); a copy of
        `tensors` is sent, so the caller may change them before `.wait()`."""
        return self._start_mix(tensors, topology, step, lazy, lent=False)

    def mix(
        self, tensors: Sequence[torch.Tensor], topology: Topology, step: int, lazy: bool = False
    ) -> list[torch.Tensor]:
        """sum_j W(step)[i, j] x_j with the topology's mixing matrix (`lazy`: with (I + W) / 2): one gossip step."""
        return self._start_mix(tensors, topology, step, lazy, lent=True).wait()

    def _start_mix(
        self, tensors: Sequence[torch.Tensor], topology: Topology, step: int, lazy: bool, lent: bool
    ) -> Handle:
        """`start_mix`; `lent` as in `_start_neighbor_average` (the blocking form)."""
        self._senders = lambda j: sorted(topology.neighbors(j, step).send)
        try:
            return self._start_neighbor_average(tensors, mixing_neighbors(topology, self.rank, step, lazy), lent)
        finally:
            self._senders = None

    def group_mean(self, tensors: Sequence[torch.Tensor], group_size: int) -> list[torch.Tensor]:
        """The mean over this peer's group: peers [g k, g (k + 1)) for group size g."""
        if group_size == 1:
            return list(tensors)
        return self.neighbor_average(tensors, group_neighbors(self.rank, group_size))

    def broadcast_(self, tensors: Sequence[torch.Tensor], root: int = 0) -> None:
        """Every peer's `tensors` become `root`'s, in place (a set-up step: not counted as traffic).
        A sum in which only the root contributes: exact, and no primitive beyond the all-reduce."""
        if self.size == 1:
            return
        groups: dict[tuple, list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        with self.uncounted(), torch.no_grad():
            for group in groups.values():
                buf = (
                    flatten(group)
                    if self.rank == root
                    else torch.zeros(sum(t.numel() for t in group), dtype=group[0].dtype, device=group[0].device)
                )
                self._wait("broadcast", self._allreduce_sum(buf), range(self.size))
                for t, value in zip(group, unflatten(buf, group)):
                    t.copy_(value)

    def flatten(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """One peer's tensors as one flat vector (a fleet: one row per peer)."""
        return flatten(tensors)

    def unflatten(self, flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The inverse of `flatten`: views of `flat` shaped like `like`."""
        return unflatten(flat, like)

    def start_send(self, buf: torch.Tensor, peer: int, tag: int) -> Request:
        """Send one contiguous buffer to `peer` with `tag` (0..32767) without blocking. Unlike the
        operations above, the caller chooses the tag: asynchronous protocols match messages by
        tag, not by a common sequence of operations. Keep `buf` unchanged until the request is done."""
        self._check_peers("send", [peer])
        self._check_tag(tag)
        self._count("send", sent=buf.nbytes, received=0, messages=1)
        buf = buf.contiguous()
        if self.staging is not None and self.staging.applies(buf):
            return self.staging.send(self._start_send, buf, peer, tag)
        return self._start_send(buf, peer, tag)

    def start_recv(self, buf: torch.Tensor, source: int | None = None, tag: int = 0) -> Request:
        """Receive into the contiguous `buf` from `source` (None: any peer; the request's
        `source` then names the sender) with `tag`, without blocking."""
        if not buf.is_contiguous():
            raise ValueError("start_recv needs a contiguous buffer to receive into")
        if source is not None:
            self._check_peers("recv", [source])
        self._check_tag(tag)
        self._count("recv", sent=0, received=buf.nbytes, messages=0)
        if self.staging is not None and self.staging.applies(buf):
            return self.staging.recv(self._start_recv, buf, source, tag)
        return self._start_recv(buf, source, tag)

    def wait_request(self, op: str, request: Request, peers: Sequence[int]) -> None:
        """Wait for `request` with the communicator's deadline; a timeout names `op` and `peers`."""
        self._wait(op, request, peers)

    def _check_tag(self, tag: int) -> None:
        if not 0 <= tag <= MAX_TAG:
            raise ValueError(f"rank {self.rank}: message tags must be in [0, {MAX_TAG}], got {tag}")

    @contextlib.contextmanager
    def uncounted(self):
        """Traffic inside this block (metrics, evaluation) is left out of `stats`, so the
        reported bytes are the algorithm's alone."""
        saved, self._counting = self._counting, False
        try:
            yield
        finally:
            self._counting = saved

    # --- shared machinery ---------------------------------------------------------------
    def _start_counted_exchange(
        self,
        op: str,
        buf: torch.Tensor,
        send_to: list[int],
        recv_from: list[int],
        into: dict[int, torch.Tensor] | None = None,
    ):
        """Start an exchange of `buf` after checking the peers and counting one `buf` to each of `send_to` and from
        each of `recv_from` (`into`: see `_start_exchange`; not on an emulated network, whose messages are longer);
        returns (pending, received(peer) -> tensor, arrival or None: see `_start_stamped_exchange`). The common path
        (no emulated network) is kept short: at 1 MiB on 4 ranks of 2 cores the Python run before and after the MPI
        calls is a measurable share of the exchange."""
        self._check_peers(op, send_to + recv_from)
        n_sent, nbytes = len(send_to), buf.nbytes
        self._count(op, sent=nbytes * n_sent, received=nbytes * len(recv_from), messages=n_sent)
        net = self._emulation()
        if net is None:
            ex = self._exchange(buf, send_to, recv_from, self._next_tag(), into)
            return ex, lambda peer: ex.received[peer], None
        return self._start_stamped_exchange(net, buf, send_to, recv_from)

    def _emulation(self) -> NetworkEmulator | None:
        return self.network if self.network is not None and self._counting and self.network.active else None

    def _start_stamped_exchange(
        self, net: NetworkEmulator, buf: torch.Tensor, send_to: list[int], recv_from: list[int]
    ):
        """Start an exchange of `buf` on the emulated network `net`; returns (pending, received(peer) -> tensor,
        arrival). Each message carries 8 more bytes: when, on the sender's clock, it arrives."""
        sent_at = net.send_stamp(buf.nbytes, send_to, self._senders)
        stamp = torch.tensor([sent_at], dtype=torch.float64, device=buf.device).view(torch.uint8)
        ex = self._exchange(torch.cat([buf.view(torch.uint8), stamp]), send_to, recv_from, self._next_tag())

        def received(peer):
            return ex.received[peer][:-8].view(buf.dtype)

        def arrival():
            return max([sent_at] + [float(ex.received[p][-8:].clone().view(torch.float64)) for p in recv_from])

        return ex, received, arrival

    def _exchange(
        self,
        buf: torch.Tensor,
        send_to: Sequence[int],
        recv_from: Sequence[int],
        tag: int,
        into: dict[int, torch.Tensor] | None = None,
    ) -> Exchange:
        if self.staging is not None and self.staging.applies(buf):  # received on the host, copied to `into`
            return self.staging.exchange(self._start_exchange, self, buf, send_to, recv_from, tag, into)
        return _start_exchange_of(self, buf, send_to, recv_from, tag, into)

    def _allreduce_sum(self, buf: torch.Tensor) -> Pending:
        if self.staging is not None and self.staging.applies(buf):
            return self.staging.allreduce_sum(self._start_allreduce_sum, buf)
        return self._start_allreduce_sum(buf)

    def _wait_for_arrival(self, t: float) -> None:
        start = time.monotonic()
        assert self.network is not None  # an arrival is known only with an emulated network
        waited = self.network.clock.wait_until(t)
        if self._counting:
            self.stats.emulated_wait_s += waited
            self.stats.comm_time_s += time.monotonic() - start  # sleep mode: really blocked

    def _wait(self, op: str, pending: Pending, peers: Sequence[int]) -> None:
        start = time.monotonic()
        try:
            pending.wait(start + self.timeout_s)
        except PeerTimeoutError:
            self._timed_out.append(pending)
            waiting_for = pending.peers_outstanding() or [p for p in peers if p != self.rank]  # not itself
            raise PeerTimeoutError(
                f"rank {self.rank}: {op} timed out after {self.timeout_s:g} s waiting for peer(s) "
                f"{waiting_for}{' at ' + self.context if self.context else ''}; a peer died or hangs "
                f"(raise comm.timeout_s if peers are just slow)"
            ) from None
        finally:
            if self._counting:
                self.stats.comm_time_s += time.monotonic() - start

    def _count(self, op: str, sent: float, received: float, messages: int) -> None:
        if not self._counting:
            return
        s = self.stats
        s.bytes_sent += int(sent)
        s.bytes_received += int(received)
        s.messages_sent += messages
        s.calls[op] = s.calls.get(op, 0) + 1

    def _check_peers(self, op: str, peers: Sequence[int]) -> None:
        for p in peers:
            if not 0 <= p < self.size or p == self.rank:
                raise ValueError(
                    f"rank {self.rank}: {op} got peer {p}; peers must be other ranks in [0, {self.size}) "
                    f"- is the topology built for {self.size} peers?"
                )

    def _receive_into(
        self, buf: torch.Tensor, recv_from: list[int], out: Sequence[torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        """`neighbor_exchange`'s `out`, checked, by peer: one tensor per distinct peer, each taking one message like
        `buf` in memory of its own (a receive into the buffer being sent, or two receives into one tensor, would mix
        messages) and outside autograd (a transport writes its memory without autograd seeing it). On the path of
        every such exchange: no message is built unless a check fails, and memory shared is found by sorting where
        each tensor starts, not by comparing every pair (docs/results/benchmarks.md). The tensors' own checks come
        before memory shared: of several faults, that order decides which one the error names."""
        where = "neighbor_exchange's out="  # (the rank is put in front only when an error is raised)
        if len(set(recv_from)) != len(recv_from):
            raise ValueError(
                f"rank {self.rank}: {where} cannot be used where recv_from names a peer twice (recv_from={recv_from}): "
                f"two messages would be received into one tensor; leave out= out (the default form returns one buffer "
                f"per entry)"
            )
        if len(out) != len(recv_from):
            raise ValueError(
                f"rank {self.rank}: {where} takes one tensor per peer of recv_from, got {len(out)} tensor(s) for "
                f"recv_from={recv_from}; pass one per peer, in its order"
            )
        numel, dtype, device, nbytes = buf.numel(), buf.dtype, buf.device, buf.nbytes
        into, starts = {}, [(buf.data_ptr(), -1)]  # where each message's memory starts (the buffer sent: -1)
        for k, (p, o) in enumerate(zip(recv_from, out)):
            if not isinstance(o, torch.Tensor):
                raise TypeError(
                    f"rank {self.rank}: {where} tensor {k} (peer {p}) is a {type(o).__name__}; pass tensors"
                )
            why = _unfit(o, numel, dtype, device)
            if why is not None:
                raise ValueError(
                    f"rank {self.rank}: {where} tensor {k} (peer {p}) {why}; each must be a contiguous tensor outside "
                    f"autograd with the message's {numel} elements of {dtype} on {device}, e.g. torch.empty_like(buf)"
                )
            into[p] = _flat(o)
            starts.append((o.data_ptr(), k))
        starts.sort()  # all of one size: memory is shared where one starts before the one before it ends
        for (before, k), (start, j) in zip(starts, starts[1:]):
            if start < before + nbytes:
                k, j = sorted((k, j))  # j names an out= tensor, k the other one or the buffer sent (-1)
                other = "the buffer sent" if k < 0 else f"out= tensor {k}"
                raise ValueError(
                    f"rank {self.rank}: {where} tensor {j} (peer {recv_from[j]}) shares memory with {other}; give "
                    f"each peer a tensor of its own"
                )
        return into

    def _receive_buffers(self, like: torch.Tensor, count: int) -> list[torch.Tensor]:
        """`count` buffers shaped like `like` for a backend to receive into: ones kept from an earlier operation if
        there are, new otherwise. A fresh large buffer costs page faults on first write, which on small or virtual
        machines cost several times the message itself."""
        free = self._free_buffers.get((like.shape, like.dtype, like.device))  # (one key a call, not one a buffer)
        return [free.pop() if free else torch.empty_like(like) for _ in range(count)]

    def _release_buffers(self, buffers) -> None:
        """Keep receive buffers that no caller holds (a few per shape) for `_receive_buffers`."""
        for b in buffers:
            free = self._free_buffers.setdefault((b.shape, b.dtype, b.device), [])
            if len(free) < _KEPT_BUFFERS_PER_SHAPE:
                free.append(b)

    def _next_tag(self) -> int:
        # a fresh tag per operation keeps consecutive exchanges from matching each other's
        # messages; every peer issues the same sequence of operations, so tags agree
        self._tag = (self._tag + 1) % 32768
        return self._tag

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"


class MessagelessCommunicator(Communicator):
    """The communicator of simulated peers that act on their tensors directly (the fleet's stacked operations, the
    event simulator's scheduled exchanges): no message to start, no one to wait for at a barrier."""

    instead = "its operations act on the peers' tensors directly"  # what it does instead, for the error

    def _start_exchange(self, buf, send_to, recv_from, tag, into=None) -> Exchange:
        raise NotImplementedError(f"{type(self).__name__} sends no point-to-point messages: {self.instead}")

    def _start_allreduce_sum(self, buf) -> Pending:
        raise NotImplementedError(f"{type(self).__name__} runs no collectives: {self.instead}")

    def barrier(self) -> None:
        return None


class _Done(Pending):
    def wait(self, deadline: float) -> None:
        return None


class _All(Pending):
    def __init__(self, parts: list[Pending]):
        self._parts = parts

    def wait(self, deadline: float) -> None:
        for part in self._parts:
            part.wait(deadline)

    def peers_outstanding(self) -> list[int]:
        return sorted({p for part in self._parts for p in part.peers_outstanding()})

    def progress(self) -> None:
        for part in self._parts:
            part.progress()


@runtime_checkable
class PerPeerCounts(Protocol):
    """A fleet's byte counters, one per peer (dpsgd.sim.fleet)."""

    def count_per_peer(self, sent, received) -> None: ...


class Wrapped(Communicator):
    """A communicator worn over another (`inner`): a codec's (dpsgd.comm.codecs) or a robust rule's
    (dpsgd.comm.robust), which change means and mixes. It takes the inner's identity, counters and network, and
    passes through the rest: the transport's primitives, point-to-point operations (they carry what their
    caller encoded, and the inner counts them), the barrier, broadcasts and flattening (a fleet's: with the
    peer axis).

    What both wrappers do alike is here: a wrapper writes its means (`start_allreduce_mean`; a sum is n times
    the mean) and one mix by per-peer weights, `_start_weighted_mix(tensors, weights, kind)` (weights(i): peer
    i's `Neighbors`), which serves a mix by W(k), a neighbour average and a group mean."""

    def __init__(self, comm: Communicator):
        super().__init__(comm.rank, comm.size, comm.timeout_s)
        self.inner = comm
        self.stats, self.network, self.staging = comm.stats, comm.network, comm.staging
        self.peer_shape, self.backend, self.in_process = comm.peer_shape, comm.backend, comm.in_process
        self._counting = False  # the inner communicator's operations count the traffic
        self.calls = 0  # the wrapper's operations so far: the key of what it draws (a codec's, a corrupt peer's)

    def _call(self) -> int:
        self.calls += 1
        return self.calls

    def _done(self, op: str, result) -> Handle:
        """A handle of an operation the wrapper finishes itself: `result` a value, or a function giving it."""
        return Handle(self, op, _Done(), result if callable(result) else lambda: result, [])

    def _count_fleet(self, sent: torch.Tensor, received: torch.Tensor, started: float) -> None:
        """A fleet's bytes per peer and the time spent, counted where the inner fleet's operations would."""
        if isinstance(self.inner, PerPeerCounts):
            self.inner.count_per_peer(sent, received)
        if self.inner._counting:
            self.inner.stats.comm_time_s += time.perf_counter() - started

    def _start_weighted_mix(
        self, tensors: Sequence[torch.Tensor], weights: Callable[[int], Neighbors], kind: str = "mix"
    ) -> Handle:
        """sum_j weights(i).recv[j] x_j + weights(i).self_weight x_i for this peer i (a fleet: every peer), as
        the wrapper sends and combines; `kind` names the operation (mix, group, mean)."""
        raise NotImplementedError(f"{type(self).__name__} must define _start_weighted_mix")

    # a wrapper encodes its own copies: what the caller lends changes nothing
    def _start_neighbor_average(self, tensors: Sequence[torch.Tensor], weights: Neighbors, lent: bool) -> Handle:
        return self._start_weighted_mix(tensors, lambda i: weights)

    def _start_mix(
        self, tensors: Sequence[torch.Tensor], topology: Topology, step: int, lazy: bool, lent: bool
    ) -> Handle:
        return self._start_weighted_mix(tensors, lambda i: mixing_neighbors(topology, i, step, lazy))

    def group_mean(self, tensors: Sequence[torch.Tensor], group_size: int) -> list[torch.Tensor]:
        if group_size == 1:
            return list(tensors)
        return self._start_weighted_mix(tensors, lambda i: group_neighbors(i, group_size), "group").wait()

    def start_allreduce_sum(self, tensors: Sequence[torch.Tensor]) -> Handle:
        mean = self.start_allreduce_mean(tensors)
        return self._done("allreduce_sum", lambda: [t * self.size for t in mean.wait()])

    def start_allreduce_sum_(self, buf: torch.Tensor) -> Handle:
        mean = self.start_allreduce_mean([buf])
        return self._done("allreduce_sum", lambda: [buf.copy_(mean.wait()[0]).mul_(self.size)])

    def _start_exchange(self, buf, send_to, recv_from, tag, into=None) -> Exchange:
        return _start_exchange_of(self.inner, buf, send_to, recv_from, tag, into)

    def _start_allreduce_sum(self, buf) -> Pending:
        return self.inner._start_allreduce_sum(buf)

    def barrier(self) -> None:
        self.inner.barrier()


def _passed_through(name: str):
    def method(self: Wrapped, *args, **kwargs):
        return getattr(self.inner, name)(*args, **kwargs)

    method.__name__, method.__qualname__ = name, f"Wrapped.{name}"
    return method


for _name in ("duplicate", "start_neighbor_exchange", "start_exchange", "start_send", "start_recv", "wait_request"):
    setattr(Wrapped, _name, _passed_through(_name))
for _name in ("broadcast_", "flatten", "unflatten", "uncounted", "any_peer"):
    setattr(Wrapped, _name, _passed_through(_name))
