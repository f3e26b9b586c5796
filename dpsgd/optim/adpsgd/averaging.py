"""AD-PSGD's averaging protocol: x_i, x_j <- (x_i + x_j) / 2 with one neighbour j, atomic (both sides
hold their lock across the exchange), run by one communication thread per peer on its own duplicated
communicator (`comm.duplicate()`: MPI Dup, a new gloo group, a local namespace).

How it works: docs/guide/internals.md#adpsgd-averaging.
"""

from __future__ import annotations

import queue
import random
import threading
import time

import torch

from dpsgd.comm import PeerTimeoutError
from dpsgd.comm.pending import poll_until
from dpsgd.seeds import partner_seed

TAG_REQUEST, TAG_REPLY = 11, 12
AVERAGE, DONE = 0.0, 1.0
HEADER = 3  # code, sender, averaging id


def receive_any(link, buf: torch.Tensor, tag: int, timeout_s: float, abort, listener: str, senders: str) -> bool:
    """One message of `tag` from any peer into `buf`, for a communication thread's loop: True once it came, False
    if `abort()` ended the wait; after `timeout_s` s of silence a PeerTimeoutError saying that `listener` heard
    nothing from `senders`, and what to do."""
    recv = link.start_recv(buf, None, tag)
    try:
        return poll_until(recv.test, time.monotonic() + timeout_s, abort=abort)
    except PeerTimeoutError:
        raise PeerTimeoutError(
            f"{listener} heard nothing for {timeout_s:g} s from {senders}; a peer died or hangs (raise "
            "comm.timeout_s if peers are just slow)"
        ) from None


def partner_rng(seed: int, rank: int) -> random.Random:
    """The generator an active peer draws its partners from."""
    return random.Random(partner_seed(seed, rank))


def roles(topology, rank: int, size: int) -> tuple[str, frozenset[int]]:
    """Peer `rank`'s role ("active", "passive" or "alone") and the peers it may average with."""
    if size == 1:
        return "alone", frozenset()
    active, passive = topology.bipartite()  # raises a clear ValueError for non-bipartite graphs
    me_active = rank in active
    other = passive if me_active else active
    if topology.period is None:  # random schedules: any peer of the other side may be drawn
        partners = set(other)
    else:
        partners = set()
        for t in range(topology.period):
            nb = topology.neighbors(rank, t)
            partners |= set(nb.recv) | set(nb.send)
    partners.discard(rank)
    if not partners:
        return "alone", frozenset()
    return ("active" if me_active else "passive"), frozenset(partners)


def choose_partner(topology, rank: int, partners: frozenset[int], rng: random.Random, step: int) -> int | None:
    """The partner of an active peer's `step`-th averaging (None: no neighbour at that step)."""
    if topology.period is None:
        candidates = sorted(partners)
    else:
        nb = topology.neighbors(rank, step)
        candidates = sorted((set(nb.recv) | set(nb.send)) & partners)
    return rng.choice(candidates) if candidates else None


class Averaging:
    """One peer's side of the protocol for the optimizer `opt`: its role and partners, the communicator
    its thread talks on (`link`), and its counters. The thread averages `live` (x_i, the optimizer's) under
    `lock`; `version` counts the averagings applied to it."""

    def __init__(self, opt, seed: int):  # opt: the ADPSGD (whose module imports this one)
        self.opt, self.comm, self.topology, self.live, self.lock = opt, opt.comm, opt.topology, opt.live, opt.lock
        self.role, self.partners = roles(opt.topology, opt.comm.rank, opt.comm.size)
        self.rng = partner_rng(seed, opt.comm.rank)
        self.link = opt.comm.duplicate() if opt.comm.size > 1 else None  # collective: every peer makes it
        self.version = 0  # averagings applied to x_i so far (changed under the lock)
        self.initiated = 0  # averagings this peer started (active)
        self.served = 0  # averagings this peer answered (passive)
        self.orders: queue.SimpleQueue = queue.SimpleQueue()  # "average" or "done", from the main thread
        self.idle = threading.Event()  # no averaging in flight
        self.idle.set()
        # emulated network (dpsgd.comm.netem): an averaging ordered at t completes at t + request + reply
        self.network = getattr(opt.comm, "network", None)
        self.done_at: float | None = None
        self.threaded = True  # a thread performs the averagings (start(threads=False): the caller does)

    # --- the main thread ---------------------------------------------------------------------
    def order(self) -> None:
        """One averaging, performed while the next gradient is computed (call it once `idle` is set)."""
        net = self.network
        if net is not None and net.active and self.partners:
            message = net.link.message_time(self.live.nbytes)
            self.done_at = net.clock.now() + 2 * message + net.jitter()
        self.idle.clear()
        if self.threaded:  # else the event simulator takes the order (request, serve, complete)
            self.orders.put("average")

    def stop(self) -> None:
        """The active thread ends after the averaging in flight (and says DONE unless aborted)."""
        self.orders.put("done")

    def wait_emulated(self) -> None:
        """Emulated network in model mode: wait on the emulated clock until the averaging in flight
        completes, x_i being locked until then (in sleep mode the active thread really waits)."""
        net = self.network
        if net is not None and net.active and net.clock.mode == "model" and self.done_at is not None:
            self.comm.stats.emulated_wait_s += net.clock.wait_until(self.done_at)

    # --- one averaging, in three parts: the thread's and the event simulator's (dpsgd.sim.events) -----
    @property
    def message_numel(self) -> int:
        """Entries of a request (and of DONE): the header and x_i."""
        return HEADER + self.live.numel()

    def request(self, buf: torch.Tensor | None = None) -> tuple[int, torch.Tensor] | None:
        """Active: begin the averaging ordered, with the partner of this averaging: take the lock (held until
        `complete`, so x_i cannot change until both sides averaged) and return (partner, request), the request
        [AVERAGE, rank, averaging id, x_i] written into `buf` (or a new tensor). None: no neighbour now."""
        partner = choose_partner(self.topology, self.comm.rank, self.partners, self.rng, self.initiated)
        if partner is None:
            self.idle.set()
            return None
        self.lock.acquire()
        self.opt._jitter()
        request = buf if buf is not None else torch.empty(self.message_numel, dtype=self.live.dtype)
        request[0], request[1], request[2] = AVERAGE, float(self.comm.rank), float(self.initiated)
        request[HEADER:].copy_(self.live)
        return partner, request

    def serve(self, request: torch.Tensor) -> torch.Tensor:
        """Passive: answer a request atomically, returning the reply x_j (taken before x_j averages in x_i)."""
        sender, avg_id = int(request[1].item()), int(request[2].item())
        with self.lock:
            self.opt._jitter()
            answer = self.live.to("cpu", copy=True)
            self._average_in(request[HEADER:], (sender, avg_id, self.comm.rank))
        self.served += 1
        return answer

    def tick(self) -> float | None:
        """Nothing of AD-PSGD's acts on its own between messages."""
        return None

    def closing(self) -> torch.Tensor | None:
        """A passive partner needs no closing message in virtual time (the threads send DONE)."""
        return None

    def complete(self, partner: int, reply: torch.Tensor) -> None:
        """Active: average the partner's reply in and release the lock."""
        try:
            self._average_in(reply, (self.comm.rank, self.initiated, partner))
        finally:
            self.lock.release()
        self.initiated += 1
        self.idle.set()

    def _average_in(self, other: torch.Tensor, event: tuple) -> None:
        """x_i <- mix(x_i, x_j), with the lock held."""
        self.opt.mix(self.live, other.to(self.live.device))
        self.version += 1
        if self.opt.record_events:
            self.opt.events.append(("avg", *event))

    # --- the communication thread -----------------------------------------------------------------
    def _host(self, numel: int) -> torch.Tensor:
        """A message buffer in host memory, page-locked when x_i is on a GPU (fast copies both ways)."""
        return torch.empty(numel, dtype=self.live.dtype, pin_memory=self.live.is_cuda)

    def run_active(self) -> None:
        """Active peer: one averaging per order of the main thread; DONE to every partner at the end."""
        link, network = self.link, self.network
        assert link is not None  # a thread runs only with partners
        request = self._host(self.message_numel)
        reply = self._host(self.live.numel())
        while True:
            try:
                order = self.orders.get(timeout=0.05)
            except queue.Empty:
                if self.opt._abort.is_set():
                    return
                continue
            if order == "done" or self.opt._abort.is_set():
                break
            begun = self.request(request)
            if begun is None:
                continue
            partner = begun[0]
            try:
                recv = link.start_recv(reply, partner, TAG_REPLY)
                send = link.start_send(request, partner, TAG_REQUEST)
                link.wait_request("AD-PSGD averaging (request sent)", send, [partner])
                link.wait_request("AD-PSGD averaging (awaiting the reply)", recv, [partner])
                if self.done_at is not None and network is not None and network.clock.mode == "sleep":
                    network.clock.wait_until(self.done_at)
            except BaseException:
                self.lock.release()
                raise
            self.complete(partner, reply)
        if self.opt._abort.is_set():
            return
        done = self._host(self.message_numel).zero_()
        done[0], done[1] = DONE, float(self.comm.rank)
        sends = [(p, link.start_send(done, p, TAG_REQUEST)) for p in sorted(self.partners)]
        for p, send in sends:
            link.wait_request("AD-PSGD closing handshake (DONE)", send, [p])

    def run_passive(self) -> None:
        """Passive peer: answer averaging requests from any active neighbour until all said DONE."""
        link, rank = self.link, self.comm.rank
        assert link is not None  # a thread runs only with partners
        waiting_for = set(self.partners)
        incoming = self._host(self.message_numel)
        while waiting_for:
            listener = f"rank {rank}: AD-PSGD's communication thread"
            senders = f"active neighbour(s) {sorted(waiting_for)}, which have not said DONE"
            if not receive_any(
                link, incoming, TAG_REQUEST, self.comm.timeout_s, self.opt._abort.is_set, listener, senders
            ):
                return
            sender = int(incoming[1].item())
            if incoming[0].item() == DONE:
                waiting_for.discard(sender)
                continue
            answer = self.serve(incoming)
            send = link.start_send(answer, sender, TAG_REPLY)
            link.wait_request("AD-PSGD averaging (sending the reply)", send, [sender])
