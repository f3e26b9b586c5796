"""AD-PSGD (Lian, Zhang, Zhang, Liu, ICML 2018): asynchronous decentralized SGD, no global step.

Each peer keeps its *live* parameters x_i (a flat buffer guarded by a lock) apart from the model's
parameters, which hold the *snapshot* x_hat_i the gradient is computed at. A step of peer i:

1. forward/backward on the snapshot x_hat_i, while x_i may change underneath (averagings);
2. `step()`: d_i = base(x_hat_i, g_i) - x_hat_i, then under the lock x_i <- x_i + d_i and the new
   snapshot x_hat_i <- x_i. The increment goes to the live copy exactly once, whatever averagings
   happened meanwhile; their number is the step's *staleness*;
3. an averaging x_i, x_j <- (x_i + x_j) / 2 with one neighbour j, atomic: both sides hold their
   lock across the exchange.

Peers split into active and passive sets (`topology.bipartite()`); only active peers start an
averaging, and only with passive neighbours. Each peer runs one communication thread on its own
duplicated communicator (`comm.duplicate()`: MPI Dup, a new gloo group, a local namespace):
- active: after each step the main thread hands it one averaging, which it performs while the main
  thread computes the next gradient (lock i held: send x_i, receive x_j, x_i <- (x_i + x_j) / 2);
- passive: it serves requests from any active neighbour (lock j held: reply x_j, x_j <- (x_j + x_i) / 2).
A passive thread never waits for anybody while holding its lock, and active peers wait only for
passive ones, so no cycle of waits can form. Both sides compute (x_i + x_j) * 0.5 with the same
operands, so they hold bit-identical values afterwards and the sum of all parameters is conserved.

Budgets (`set_budget`): per-peer `steps`, total `samples` across peers (rank 0 runs a coordinator
thread on a second duplicated communicator; every peer reports its samples after each step and
reads the answer, "go on" or "stop", at its next step) or wall-clock `seconds`. `finish()` stops
cleanly: an active peer's thread ends its averaging in flight and sends DONE to each passive
neighbour; a passive peer's thread serves until every active neighbour said DONE; every thread is
joined and every message received, so collectives may follow. Every wait has the communicator's
deadline (`comm.timeout_s`); past it, the error names the peer and what was awaited.

Messages on the averaging communicator (dtype of the parameters): a request is [code, sender,
averaging id, x_i...] with code AVERAGE or DONE, tag TAG_REQUEST; the reply is x_j, tag TAG_REPLY.
On the control communicator (float64): [sender, samples, final] to rank 0 with TAG_PROGRESS, and its
answer [stop] with TAG_ANSWER. All waits poll with short sleeps (MPI's blocking waits spin).
"""

from __future__ import annotations

import queue
import random
import threading
import time

import torch

from dpsgd.comm import CommError, PeerTimeoutError
from dpsgd.comm.base import flatten

from .base import DistributedOptimizer
from .dpsgd import check_topology

TAG_REQUEST, TAG_REPLY, TAG_PROGRESS, TAG_ANSWER = 11, 12, 13, 14
AVERAGE, DONE = 0.0, 1.0
HEADER = 3  # code, sender, averaging id
BUDGETS = ("steps", "samples", "seconds")
_POLL_MAX_S = 0.001


def _poll(test, deadline: float, abort: threading.Event | None = None) -> bool:
    """Wait for test() with short sleeps (never spinning a core); False past the deadline or on abort."""
    delay = 0.0
    while not test():
        if time.monotonic() > deadline or (abort is not None and abort.is_set()):
            return False
        if delay:
            time.sleep(delay)
        delay = min(_POLL_MAX_S, delay * 2 if delay else 2e-5)
    return True


def partner_rng(seed: int, rank: int) -> random.Random:
    """The generator an active peer draws its partners from."""
    return random.Random(seed * 7919 + rank)


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


class ADPSGD(DistributedOptimizer):
    """AD-PSGD. `budget` names what ends the run ('steps' per peer, total 'samples' across peers, or
    wall-clock 'seconds'); the training loop fills in the amounts with `set_budget`. `seed` drives
    the choice of neighbours; `jitter_s` adds random delays (up to that many seconds) inside the
    protocol, for tests; `record_events` logs every change to the live parameters, in order."""

    asynchronous = True

    def __init__(self, base: torch.optim.Optimizer, comm, topology=None, budget: str = "steps",
                 seconds: float | None = None, seed: int = 0, jitter_s: float = 0.0, record_events: bool = False):
        super().__init__(base, comm)
        if comm.size > 1:
            check_topology(topology, comm, "ADPSGD")
        if budget not in BUDGETS:
            raise ValueError(f"ADPSGD budget must be one of {BUDGETS}, got {budget!r}")
        self.topology, self.budget = topology, budget
        self.budget_steps: int | None = None
        self.budget_samples: int | None = None
        self.budget_seconds: float | None = None if seconds is None else float(seconds)
        self.samples_per_step = 1
        self.jitter_s = float(jitter_s)
        self.record_events = bool(record_events)
        self.events: list[tuple] = []  # ("step", k), ("avg", active, averaging id, passive): in order

        params = self.params()
        with torch.no_grad():
            self.live = flatten(params).clone()  # x_i: changed only under self.lock
        self.lock = threading.Lock()
        self.version = 0  # averagings applied to x_i so far
        self._snap_version = 0

        self.role, self.partners = self._roles(topology, comm)
        self._rng = partner_rng(seed, comm.rank)
        self._jitter_rng = random.Random(seed * 104729 + comm.rank + 1)
        # collective and in the same order on every peer: every peer makes the same duplicates
        self.link = comm.duplicate() if comm.size > 1 else None
        self.control = comm.duplicate() if comm.size > 1 and budget == "samples" else None
        if comm.size > 1 and comm.backend == "mpi":
            comm.require_thread_multiple("ADPSGD (a communication thread beside the computing one)")

        # counters
        self.samples = 0
        self.initiated = 0  # averagings this peer started (active)
        self.served = 0  # averagings this peer answered (passive)
        self.staleness_histogram: list[int] = []
        self.wait_s = 0.0  # main thread blocked: lock, previous averaging, coordinator answer
        self.started_at: float | None = None
        self.finished_at: float | None = None

        self._threads: list[threading.Thread] = []
        self._errors: list[BaseException] = []
        self._abort = threading.Event()
        self._go: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._stop = threading.Event()  # set when the samples budget is spent (rank 0: by its coordinator)
        self._answer = None  # (request, buffer) of the coordinator's answer to our last report
        self._finished = False
        self._link_stats_merged = False
        # emulated network (dpsgd.netem): an averaging started at t completes at t + request + reply
        self.network = getattr(comm, "network", None)
        self._averaging_done_at: float | None = None

    # --- set-up -----------------------------------------------------------------------------
    @staticmethod
    def _roles(topology, comm) -> tuple[str, frozenset[int]]:
        return roles(topology, comm.rank, comm.size)

    def set_budget(self, steps: int | None = None, samples: int | None = None, seconds: float | None = None,
                   samples_per_step: int | None = None) -> None:
        """The amounts of the budgets (only the one named by `budget` ends the run)."""
        if steps is not None:
            self.budget_steps = int(steps)
        if samples is not None:
            self.budget_samples = int(samples)
        if seconds is not None:
            self.budget_seconds = float(seconds)
        if samples_per_step is not None:
            self.samples_per_step = int(samples_per_step)

    def start(self) -> None:
        """Start the communication threads and the clock (call it after a barrier, on every peer)."""
        if self.started_at is not None:
            return
        if self.control is not None and self.comm.rank == 0 and self.budget_samples is None:
            raise ValueError("ADPSGD(budget='samples') needs set_budget(samples=...) before training")
        self.started_at = time.monotonic()
        if self.role == "active":
            self._spawn(self._averager, "averager")
        elif self.role == "passive":
            self._spawn(self._server, "server")
        if self.control is not None and self.comm.rank == 0:
            self._spawn(self._coordinator, "coordinator")

    def _spawn(self, target, what: str) -> None:
        def run():
            try:
                target()
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                self._errors.append(exc)
                self._abort.set()

        t = threading.Thread(target=run, name=f"adpsgd-{what}-{self.comm.rank}", daemon=True)
        self._threads.append(t)
        t.start()

    # --- the main thread --------------------------------------------------------------------
    def should_stop(self) -> bool:
        """True once this peer's share of the budget is spent (never blocks)."""
        self.start()
        self._raise_thread_error()
        amount = {"steps": self.budget_steps, "samples": self.budget_samples, "seconds": self.budget_seconds}
        if amount[self.budget] is None:
            raise ValueError(f"ADPSGD(budget={self.budget!r}) needs set_budget({self.budget}=...) before training")
        if self.budget == "steps":
            return self.step_count >= self.budget_steps
        if self.budget == "seconds":
            return time.monotonic() - self.started_at >= self.budget_seconds
        if self.comm.size == 1:
            return self.samples >= self.budget_samples
        return self._stop.is_set()

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._closure_loss(closure)
        self.start()
        self._raise_thread_error()
        params = self.params()
        before = flatten(params)  # the snapshot x_hat the gradient was taken at
        self.base.step()
        after = flatten(params)
        self._jitter()
        net = self.network
        if net is not None and net.active and net.clock.mode == "model" and self._averaging_done_at is not None:
            # x_i is locked until the averaging in flight completes (in sleep mode the averager really waits)
            self.comm.stats.emulated_wait_s += net.clock.wait_until(self._averaging_done_at)
        t0 = time.monotonic()
        with self.lock:
            self.wait_s += time.monotonic() - t0
            stale = self.version - self._snap_version
            if stale == 0:
                self.live.copy_(after)  # nothing changed x_i meanwhile: x_i + d_i is exactly `after`
            else:
                self.live.add_(after.sub_(before))
            self._snap_version = self.version
            if self.record_events:
                self.events.append(("step", self.step_count))
            snapshot = self.live.clone()
        offset = 0
        for p in params:  # the new snapshot, outside the lock: only this thread touches the model
            p.copy_(snapshot[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        if stale >= len(self.staleness_histogram):
            self.staleness_histogram.extend([0] * (stale + 1 - len(self.staleness_histogram)))
        self.staleness_histogram[stale] += 1
        self.step_count += 1
        self.samples += self.samples_per_step
        if self.role == "active":
            self._request_averaging()
        if self.control is not None:
            self._report_progress(final=False)
        return loss

    def _request_averaging(self) -> None:
        """One averaging per step, overlapping the next gradient; at most one in flight."""
        t0 = time.monotonic()
        if not _poll(self._idle.is_set, t0 + self.comm.timeout_s, self._abort):
            self._raise_thread_error()
            raise PeerTimeoutError(f"rank {self.comm.rank}: AD-PSGD's averaging did not finish within "
                                   f"{self.comm.timeout_s:g} s (neighbours {sorted(self.partners)})")
        self.wait_s += time.monotonic() - t0
        net = self.network
        if net is not None and net.active and self.partners:
            message = net.link.message_time(self.live.nbytes)
            self._averaging_done_at = net.clock.now() + 2 * message + net.jitter()
        self._idle.clear()
        self._go.put("average")

    def _report_progress(self, final: bool) -> None:
        """Rank 0 counts in-process; the others send [rank, samples, final] and read the answer of the
        previous report first (it has long arrived: the answer is awaited one step late)."""
        if self.comm.rank == 0:
            if final:
                self._stop.set()
            return
        self._await_answer()
        msg = torch.tensor([float(self.comm.rank), float(self.samples), 1.0 if final else 0.0], dtype=torch.float64)
        send = self.control.start_send(msg, 0, TAG_PROGRESS)
        answer = torch.zeros(1, dtype=torch.float64)
        self._answer = (self.control.start_recv(answer, 0, TAG_ANSWER), answer, send)
        if final:
            self._await_answer()

    def _await_answer(self) -> None:
        if self._answer is None:
            return
        request, answer, send = self._answer
        t0 = time.monotonic()
        deadline = t0 + self.comm.timeout_s
        if not (_poll(send.test, deadline, self._abort) and _poll(request.test, deadline, self._abort)):
            self._raise_thread_error()
            raise PeerTimeoutError(f"rank {self.comm.rank}: AD-PSGD's coordinator (rank 0) did not answer within "
                                   f"{self.comm.timeout_s:g} s; it died or hangs (raise comm.timeout_s if it is slow)")
        self.wait_s += time.monotonic() - t0
        self._answer = None
        if answer.item() > 0:
            self._stop.set()

    def finish(self) -> None:
        """End this peer's part: finish the averaging in flight, tell passive neighbours we are done,
        serve until our active neighbours are done, join every thread; then copy x_i into the model.
        After it, every peer may run collectives on `comm` again."""
        if self._finished:
            return
        self.start()
        self.finished_at = time.monotonic()
        try:
            if self.control is not None:
                self._report_progress(final=True)
            if self.role == "active":
                self._go.put("done")
            deadline = time.monotonic() + 2 * self.comm.timeout_s
            for t in self._threads:
                while t.is_alive():
                    t.join(timeout=0.05)
                    self._raise_thread_error()
                    if time.monotonic() > deadline:
                        raise PeerTimeoutError(f"rank {self.comm.rank}: AD-PSGD's {t.name} thread did not end within "
                                               f"{2 * self.comm.timeout_s:g} s")
            self._raise_thread_error()
        except BaseException:
            self.abort()
            raise
        self._finished = True
        net = self.network
        if net is not None and net.active and net.clock.mode == "model" and self._averaging_done_at is not None:
            # the run ends when its last averaging does (in sleep mode the averager really waited for it)
            self.comm.stats.emulated_wait_s += net.clock.wait_until(self._averaging_done_at)
        with torch.no_grad(), self.lock:
            offset = 0
            for p in self.params():
                p.copy_(self.live[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        self._merge_link_stats()
        for link in (self.link, self.control):
            if link is not None:
                link.close()

    def abort(self) -> None:
        """Stop the communication threads without the closing handshake (after an error)."""
        self._abort.set()
        self._go.put("done")

    def _raise_thread_error(self) -> None:
        if self._errors:
            exc = self._errors[0]
            if isinstance(exc, CommError):
                raise exc
            raise CommError(f"rank {self.comm.rank}: AD-PSGD's communication thread failed: "
                            f"{type(exc).__name__}: {exc}") from exc

    def _jitter(self) -> None:
        if self.jitter_s > 0:
            time.sleep(self._jitter_rng.uniform(0, self.jitter_s))

    # --- communication threads ----------------------------------------------------------------
    def _choose_partner(self, step: int) -> int | None:
        return choose_partner(self.topology, self.comm.rank, self.partners, self._rng, step)

    def _averager(self) -> None:
        """Active peer: one averaging per request of the main thread; DONE to every partner at the end."""
        link, rank = self.link, self.comm.rank
        request = torch.empty(HEADER + self.live.numel(), dtype=self.live.dtype)
        reply = torch.empty_like(self.live)
        while True:
            try:
                order = self._go.get(timeout=0.05)
            except queue.Empty:
                if self._abort.is_set():
                    return
                continue
            if order == "done" or self._abort.is_set():
                break
            partner = self._choose_partner(self.initiated)
            if partner is not None:
                with self.lock:  # held across the exchange: x_i cannot change until both sides averaged
                    self._jitter()
                    request[0], request[1], request[2] = AVERAGE, float(rank), float(self.initiated)
                    request[HEADER:].copy_(self.live)
                    recv = link.start_recv(reply, partner, TAG_REPLY)
                    send = link.start_send(request, partner, TAG_REQUEST)
                    link.wait_request("AD-PSGD averaging (request sent)", send, [partner])
                    link.wait_request("AD-PSGD averaging (awaiting the reply)", recv, [partner])
                    if self._averaging_done_at is not None and self.network.clock.mode == "sleep":
                        self.network.clock.wait_until(self._averaging_done_at)
                    self.live.add_(reply).mul_(0.5)
                    self.version += 1
                    if self.record_events:
                        self.events.append(("avg", rank, self.initiated, partner))
                self.initiated += 1
            self._idle.set()
        if self._abort.is_set():
            return
        done = torch.zeros(HEADER + self.live.numel(), dtype=self.live.dtype)
        done[0], done[1] = DONE, float(rank)
        sends = [(p, link.start_send(done, p, TAG_REQUEST)) for p in sorted(self.partners)]
        for p, send in sends:
            link.wait_request("AD-PSGD closing handshake (DONE)", send, [p])

    def _server(self) -> None:
        """Passive peer: answer averaging requests from any active neighbour until all said DONE."""
        link, rank = self.link, self.comm.rank
        waiting_for = set(self.partners)
        incoming = torch.empty(HEADER + self.live.numel(), dtype=self.live.dtype)
        while waiting_for:
            recv = link.start_recv(incoming, None, TAG_REQUEST)
            if not _poll(recv.test, time.monotonic() + self.comm.timeout_s, self._abort):
                if self._abort.is_set():
                    return
                raise PeerTimeoutError(
                    f"rank {rank}: AD-PSGD's communication thread heard nothing for {self.comm.timeout_s:g} s from "
                    f"active neighbour(s) {sorted(waiting_for)}, which have not said DONE; a peer died or hangs "
                    f"(raise comm.timeout_s if peers are just slow)")
            code, sender, avg_id = incoming[0].item(), int(incoming[1].item()), int(incoming[2].item())
            if code == DONE:
                waiting_for.discard(sender)
                continue
            with self.lock:
                self._jitter()
                answer = self.live.clone()
                self.live.add_(incoming[HEADER:]).mul_(0.5)
                self.version += 1
                if self.record_events:
                    self.events.append(("avg", sender, avg_id, rank))
            self.served += 1
            send = link.start_send(answer, sender, TAG_REPLY)
            link.wait_request("AD-PSGD averaging (sending the reply)", send, [sender])

    def _coordinator(self) -> None:
        """Rank 0, samples budget: add up every peer's samples, answer each report with go on / stop,
        and end once every other peer sent its final report."""
        control, n = self.control, self.comm.size
        reported = {p: 0.0 for p in range(1, n)}
        final: set[int] = set()
        msg = torch.zeros(3, dtype=torch.float64)
        while len(final) < n - 1:
            recv = control.start_recv(msg, None, TAG_PROGRESS)
            if not _poll(recv.test, time.monotonic() + self.comm.timeout_s, self._abort):
                if self._abort.is_set():
                    return
                raise PeerTimeoutError(
                    f"rank 0: AD-PSGD's coordinator heard nothing for {self.comm.timeout_s:g} s from peer(s) "
                    f"{sorted(set(reported) - final)}; a peer died or hangs")
            sender = int(msg[0].item())
            reported[sender] = max(reported[sender], msg[1].item())
            if msg[2].item() > 0:
                final.add(sender)
            if sum(reported.values()) + self.samples >= self.budget_samples:
                self._stop.set()
            answer = torch.tensor([1.0 if self._stop.is_set() else 0.0], dtype=torch.float64)
            send = control.start_send(answer, sender, TAG_ANSWER)
            control.wait_request("AD-PSGD coordinator answer", send, [sender])

    # --- measurement and state ------------------------------------------------------------------
    def _merge_link_stats(self) -> None:
        """The averaging traffic is the algorithm's: add it to the communicator's counters once."""
        if self._link_stats_merged or self.link is None:
            return
        self._link_stats_merged = True
        s, link = self.comm.stats, self.link.stats
        s.bytes_sent += link.bytes_sent
        s.bytes_received += link.bytes_received
        s.messages_sent += link.messages_sent
        s.comm_time_s += self.wait_s
        s.calls["adpsgd_average"] = s.calls.get("adpsgd_average", 0) + self.initiated + self.served

    def measurements(self) -> dict:
        """This peer's figures: steps, averagings initiated and served, staleness, waiting, throughput."""
        hist = self.staleness_histogram
        steps = sum(hist)
        end = self.finished_at or time.monotonic()
        elapsed = end - self.started_at if self.started_at is not None else 0.0
        return {
            "role": self.role,
            "steps": self.step_count,
            "samples": self.samples,
            "averagings_initiated": self.initiated,
            "averagings_served": self.served,
            "staleness_mean": sum(k * c for k, c in enumerate(hist)) / steps if steps else 0.0,
            "staleness_max": max((k for k, c in enumerate(hist) if c), default=0),
            "staleness_histogram": list(hist),
            "wait_s": self.wait_s,
            "elapsed_s": elapsed,
            "samples_per_s": self.samples / elapsed if elapsed > 0 else 0.0,
        }

    def algorithm_state(self):
        with self.lock:
            return {**super().algorithm_state(), "live": self.live.clone(), "samples": self.samples,
                    "staleness_histogram": list(self.staleness_histogram)}

    def load_algorithm_state(self, state):
        super().load_algorithm_state(state)
        with self.lock:
            self.live.copy_(state["live"])
        self.samples = int(state.get("samples", 0))
        self.staleness_histogram = list(state.get("staleness_histogram", []))
