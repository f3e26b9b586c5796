"""The AD-PSGD optimizer: one peer's steps, beside its averaging thread (`averaging`). The peer keeps
its *live* parameters x_i (a flat buffer guarded by a lock) apart from the model's parameters, which
hold the *snapshot* x_hat_i the gradient is computed at. A step of peer i:

How it works: docs/guide/internals.md#adpsgd-step.
"""

from __future__ import annotations

import random
import threading
import time

import torch

from dpsgd.comm.base import flatten, unflatten
from dpsgd.seeds import protocol_jitter_seed

from ..base import DistributedOptimizer
from ..threaded import ThreadedPeer
from .averaging import Averaging
from .budget import Budget


class ADPSGD(DistributedOptimizer, ThreadedPeer):
    """AD-PSGD (Lian et al. 2018): asynchronous pairwise averaging, no global step.

    Each peer takes its gradient g_i at a snapshot of x_i while x_i may change underneath; an active peer
    averages atomically with one passive neighbour, x_i, x_j <- (x_i + x_j) / 2, and each peer adds its own
    increment d_i = base(x_i, g_i) - x_i to its live x_i. The topology must be bipartite (active and
    passive peers). `budget` names what ends the run ('steps' per peer, total 'samples' across peers, or
    wall-clock 'seconds'); the training loop fills in the amounts with `set_budget`. `seed` drives
    the choice of neighbours; `jitter_s` adds random delays (up to that many seconds) inside the
    protocol, for tests; `record_events` logs every change to the live parameters, in order.

    Times come from `comm.clock` where the communicator keeps one (the event simulator's virtual clock),
    else from time.monotonic."""

    asynchronous = True
    summary_key = "adpsgd"  # summary.json's block of `summary()`
    HISTOGRAM_BINS = 16  # staleness 0..15 in summary.json, the last bin holding 15 and more
    label = "AD-PSGD"
    knobs = {}
    cost_form = "async"

    def __init__(
        self,
        base: torch.optim.Optimizer,
        *,
        budget: str = "steps",
        seconds: float | None = None,
        seed: int = 0,
        jitter_s: float = 0.0,
        record_events: bool = False,
        **common,
    ):
        super().__init__(base, **common)
        comm = self.comm
        if comm.size > 1:
            self.require_topology()
        self.budget = budget
        self.clock = getattr(comm, "clock", time.monotonic)
        self._abort = threading.Event()  # set on a thread's error or by abort(): the threads end early
        self.run_budget = Budget(self, seconds)
        self.samples_per_step = 1
        self.jitter_s = float(jitter_s)
        self._jitter_rng = random.Random(protocol_jitter_seed(seed, comm.rank))
        self.record_events = bool(record_events)
        self.events: list[tuple] = []  # ("step", k), ("avg", active, averaging id, passive): in order
        with torch.no_grad():
            self.live = flatten(self.params()).clone()  # x_i: changed only under self.lock
        self.lock = threading.Lock()
        self.averaging = Averaging(self, seed)
        self.role = self.averaging.role  # "active", "passive" or "alone" (no neighbour to average with)
        if comm.size > 1 and hasattr(comm, "require_thread_multiple"):  # MPI: threads need THREAD_MULTIPLE
            comm.require_thread_multiple("ADPSGD (a communication thread beside the computing one)")
        self._snap_version = 0  # averaging.version when the snapshot was taken
        self.samples = 0
        self.staleness_histogram: list[int] = []
        self.wait_s = 0.0  # main thread blocked: lock, previous averaging, coordinator answer
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self._threads: list[threading.Thread] = []
        self._errors: list[BaseException] = []
        self._finished = False

    @property
    def exchanges(self) -> Averaging:
        """Its exchanges, as the event simulator asks for them (AsynchronousOptimizer)."""
        return self.averaging

    # --- set-up -----------------------------------------------------------------------------
    def start(self, threads: bool = True) -> None:
        """Start the communication threads and the clock (call it after a barrier, on every peer).
        `threads=False`: no thread; the caller performs the averagings with `averaging.request`, `serve`
        and `complete` (dpsgd.sim.events does, in virtual time)."""
        if self.started_at is not None:
            return
        self.started_at = self.clock()
        self.averaging.threaded = threads
        if not threads:
            return
        if self.run_budget.coordinating:
            self.run_budget.require()
        if self.role == "active":
            self._spawn(self.averaging.run_active, "averager")
        elif self.role == "passive":
            self._spawn(self.averaging.run_passive, "server")
        if self.run_budget.coordinating:
            self._spawn(self.run_budget.coordinate, "coordinator")

    def param_group_added(self, params: list[torch.Tensor]) -> None:
        raise ValueError(
            f"{type(self).__name__} cannot take a new parameter group "
            f"(its live copy x_i is the parameters flattened at construction): give every group to the base "
            "optimizer before building it (with lr=0 to hold one back)"
        )

    # --- the main thread --------------------------------------------------------------------
    def should_stop(self) -> bool:
        """True once this peer's share of the budget is spent (never blocks)."""
        self.start()
        self._raise_thread_error()
        assert self.started_at is not None  # start() set it
        return self.run_budget.spent(self.step_count, self.samples, self.clock() - self.started_at)

    def update(self) -> None:
        self.start()
        self._raise_thread_error()
        params = self.params()
        before = flatten(params)  # the snapshot x_hat the gradient was taken at
        self.base.step()
        after = flatten(params)
        self._jitter()
        self.averaging.wait_emulated()  # x_i is locked until the averaging in flight completes
        t0 = self.clock()
        with self.lock:
            self.wait_s += self.clock() - t0
            stale = self.averaging.version - self._snap_version
            if stale == 0:
                self.live.copy_(after)  # nothing changed x_i meanwhile: x_i + d_i is exactly `after`
            else:
                self.live.add_(after.sub_(before))
            self._snap_version = self.averaging.version
            if self.record_events:
                self.events.append(("step", self.step_count))
            snapshot = self.live.clone()
        self._load_into_model(snapshot)  # outside the lock: only this thread touches the model
        self.staleness_histogram.extend([0] * (stale + 1 - len(self.staleness_histogram)))
        self.staleness_histogram[stale] += 1
        self.step_count += 1
        self.samples += self.samples_per_step
        if self.role == "active":  # one averaging per step, overlapping the next gradient; one in flight
            self._wait(
                self.averaging.idle.is_set,
                "averaging did not finish",
                f" (neighbours {sorted(self.averaging.partners)}); a neighbour died or hangs "
                f"(raise comm.timeout_s if it is slow)",
            )
            self.averaging.order()
        self.run_budget.report(self.samples, final=False)

    @property
    def staleness(self) -> int:
        """Averagings applied to x_i since the snapshot the next gradient is taken at."""
        return self.averaging.version - self._snap_version

    @staticmethod
    def mix(own: torch.Tensor, other: torch.Tensor) -> None:
        """One averaging, on either side, in place: x_i <- (x_i + x_j) / 2. Both sides compute it with the same
        operands, so they hold bit-identical values afterwards and the sum of all parameters is conserved."""
        own.add_(other).mul_(0.5)

    def _load_into_model(self, flat: torch.Tensor) -> None:
        params = self.params()
        for p, value in zip(params, unflatten(flat, params)):
            p.copy_(value)

    def finish(self) -> None:
        """End this peer's part: finish the averaging in flight, tell passive neighbours we are done,
        serve until our active neighbours are done, join every thread; then copy x_i into the model.
        After it, every peer may run collectives on `comm` again."""
        if self._finished:
            return
        self.start()
        self.finished_at = self.clock()
        try:
            self.run_budget.report(self.samples, final=True)
            if self.role == "active":
                self.averaging.stop()
            self._join_threads(2 * self.comm.timeout_s)
        except BaseException:
            self.abort()
            raise
        self._finished = True
        self.averaging.wait_emulated()  # the run ends when its last averaging does
        with torch.no_grad(), self.lock:
            self._load_into_model(self.live)
        self._merge_link_stats()
        for link in (self.averaging.link, self.run_budget.control):
            if link is not None:
                link.close()

    def settle(self) -> None:
        """Wait for this peer's averaging in flight (a checkpoint follows, once every peer settled)."""
        self._wait(self.averaging.idle.is_set, "averaging did not finish before the checkpoint", "")

    def abort(self) -> None:
        """Stop the communication threads without the closing handshake (after an error)."""
        self._abort.set()
        self.averaging.stop()

    def _jitter(self) -> None:
        if self.jitter_s > 0:
            time.sleep(self._jitter_rng.uniform(0, self.jitter_s))

    # --- measurement and state ------------------------------------------------------------------
    def _merge_link_stats(self) -> None:
        """The averaging traffic is the algorithm's: add it to the communicator's counters (once: finish)."""
        if self.averaging.link is None:
            return
        s, link, a = self.comm.stats, self.averaging.link.stats, self.averaging
        s.bytes_sent += link.bytes_sent
        s.bytes_received += link.bytes_received
        s.messages_sent += link.messages_sent
        s.comm_time_s += self.wait_s
        s.calls["adpsgd_average"] = s.calls.get("adpsgd_average", 0) + a.initiated + a.served

    def measurements(self) -> dict:
        """This peer's figures: steps, averagings initiated and served, staleness, waiting, throughput."""
        hist = self.staleness_histogram
        steps = sum(hist)
        end = self.finished_at or self.clock()
        elapsed = end - self.started_at if self.started_at is not None else 0.0
        return {
            "role": self.role,
            "steps": self.step_count,
            "samples": self.samples,
            "averagings_initiated": self.averaging.initiated,
            "averagings_served": self.averaging.served,
            "staleness_mean": sum(k * c for k, c in enumerate(hist)) / steps if steps else 0.0,
            "staleness_max": max((k for k, c in enumerate(hist) if c), default=0),
            "staleness_histogram": list(hist),
            "wait_s": self.wait_s,
            "elapsed_s": elapsed,
            "samples_per_s": self.samples / elapsed if elapsed > 0 else 0.0,
        }

    def summary(self, rows: list[dict]) -> dict:
        """The `adpsgd` block of summary.json from every peer's `measurements()` (rank order), each with the
        loop's `slowdown_s` (its emulated compute slowdown): totals, then per-peer lists and histograms."""
        histograms = [_binned(r["staleness_histogram"], self.HISTOGRAM_BINS) for r in rows]
        total = [sum(col) for col in zip(*histograms)]
        count = sum(total)
        per_peer = {f"{k}_per_peer": [int(r[k]) if k in _COUNTS else float(r[k]) for r in rows] for k in _PER_PEER}
        return {
            "budget": self.budget,
            "averagings": sum(per_peer["averagings_initiated_per_peer"]),
            "staleness_mean": sum(k * c for k, c in enumerate(total)) / count if count else 0.0,
            "staleness_max": max(per_peer["staleness_max_per_peer"]),
            "staleness_histogram": total,  # over all steps of all peers; last bin: >= HISTOGRAM_BINS - 1
            "wait_s_mean": sum(per_peer["wait_s_per_peer"]) / len(rows),
            **per_peer,
            "roles": [r["role"] for r in rows],
            "staleness_histogram_per_peer": histograms,
        }

    def algorithm_state(self):
        """x_i, the counters and the generators' states: with no averaging in flight (dpsgd.training
        checkpoints after every peer's averaging completed), a peer resumes where it stood."""
        a = self.averaging
        with self.lock:
            return {
                **super().algorithm_state(),
                "live": self.live.clone(),
                "samples": self.samples,
                "staleness_histogram": list(self.staleness_histogram),
                "version": a.version,
                "snap_version": self._snap_version,
                "initiated": a.initiated,
                "served": a.served,
                "wait_s": self.wait_s,
                "partner_rng": _rng_state(a.rng),
                "jitter_rng": _rng_state(self._jitter_rng),
                "link_stats": a.link.stats.as_dict() if a.link is not None else {},  # merged at finish()
            }

    def load_algorithm_state(self, state):
        super().load_algorithm_state(state)
        a = self.averaging
        with self.lock:
            self.live.copy_(state["live"])
        self.samples = int(state.get("samples", 0))
        self.staleness_histogram = list(state.get("staleness_histogram", []))
        if "version" in state:  # saved by a checkpoint of a run (an older state_dict lacks them)
            a.version, self._snap_version = int(state["version"]), int(state["snap_version"])
            a.initiated, a.served, self.wait_s = int(state["initiated"]), int(state["served"]), float(state["wait_s"])
            a.rng.setstate(_rng_from(state["partner_rng"]))
            self._jitter_rng.setstate(_rng_from(state["jitter_rng"]))
            if a.link is not None:
                for key, value in state["link_stats"].items():
                    setattr(a.link.stats, key, value)


_PER_PEER = "steps samples averagings_initiated averagings_served staleness_mean staleness_max wait_s".split()
_PER_PEER += ["samples_per_s", "slowdown_s"]
_COUNTS = {"steps", "samples", "averagings_initiated", "averagings_served", "staleness_max"}


def _binned(histogram: list[int], bins: int) -> list[int]:
    """A histogram in `bins` bins, the last one holding every larger value."""
    head = [int(c) for c in histogram[: bins - 1]]
    return head + [0] * (bins - 1 - len(head)) + [int(sum(histogram[bins - 1 :]))]


def _rng_state(rng: random.Random) -> list[int]:
    """A generator's state as plain integers (checkpoints load with torch.load(weights_only=True))."""
    version, internal, gauss = rng.getstate()
    assert version == 3 and gauss is None, "random.Random's state format changed"
    return list(internal)


def _rng_from(state: list[int]) -> tuple:
    return (3, tuple(int(v) for v in state), None)
