"""Asynchronous Local-SGD (Liu et al. 2024, arXiv 2401.09135) with delayed Nesterov and dynamic local updates,
and the quorum merge of Decoupled DiLoCo (2026). A merger (`Merger`, held by rank 0) keeps the global model and
the outer optimizer; every peer, rank 0 included, is a worker that pulls the global model, takes its local steps
and pushes its outer gradient, which the merger applies on arrival (or, with a quorum, merges with others).

How it works: docs/guide/internals.md#async-local-sgd.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence

import torch

from dpsgd.comm import CommError, PeerTimeoutError
from dpsgd.comm.base import flatten, unflatten
from dpsgd.comm.pending import poll_until

from .adpsgd.budget import Budget
from .base import DistributedOptimizer
from .hierarchical import GroupServer, group_of
from .threaded import ThreadedPeer

TAG_PUSH, TAG_REPLY = 21, 22
TAG_UP, TAG_UP_REPLY = 23, 24  # groups > 1 on real peers: a group server and the global merger
PUSH, PULL, DONE, UP = 0.0, 1.0, 2.0, 3.0  # UP: a group server's push to the global merger (groups > 1)
HEADER = 6  # kind, sender, samples of the round, steps of the round, speed (steps/s, 0: unknown), version pulled
REPLY_HEADER = 2  # version of the global model, the worker's next period


def dylu_period(period: int, speed: float | None, fastest: float | None) -> int:
    """Dynamic local updates: H_i = max(1, floor(H v_i / v_max)); H while either speed is unknown."""
    if speed is None or fastest is None or not fastest > 0:
        return period
    return max(1, math.floor(period * speed / fastest + 1e-9))


class Merger:
    """The server's state and rule (rank 0's), with no communication: `push` takes one worker's outer gradient
    Delta_i = x_pulled - x_i with the samples and steps it took and the worker's speed; `tick(now)` merges a quorum
    whose grace window has run out; `finish()` merges what is left. Equations: see AsyncLocalSGD."""

    def __init__(
        self,
        x: torch.Tensor,
        n: int,
        *,
        lr: float,
        momentum: float,
        delayed_nesterov: bool,
        dn_every: int,
        quorum: int,
        grace_s: float,
        period: int,
        periods: Sequence[int] | None,
        dylu: bool,
        speeds: Sequence[float] | None,
    ):
        self.x = x.detach().clone()  # the global model
        self.m = torch.zeros_like(self.x)  # the outer momentum
        self.acc = torch.zeros_like(self.x)  # Delta-bar: the outer gradients since the last momentum update
        self.n, self.lr, self.beta = n, float(lr), float(momentum)
        self.delayed, self.every = bool(delayed_nesterov), int(dn_every)
        self.quorum, self.grace_s = int(quorum), float(grace_s)
        self.period, self.periods, self.dylu = int(period), periods, bool(dylu)
        self.speeds: dict[int, float] = {r: float(s) for r, s in enumerate(speeds or [])}  # given or measured
        self.given_speeds = speeds is not None
        self.updates = 0  # outer updates t (one per arrival, or per merge with a quorum)
        self.version = 0  # global models published (= updates)
        self.buffer: list[tuple[int, torch.Tensor, int, int]] = []  # (rank, Delta, samples, steps) awaiting a merge
        self.quorum_at: float | None = None  # when the buffer reached the quorum
        self.done: set[int] = set()  # workers that said DONE (or were declared departed)
        self.arrivals = self.merges = self.useful_steps = self.useful_samples = 0
        self.staleness: list[int] = []  # versions between a worker's pull and its contribution's arrival

    # --- the rule -------------------------------------------------------------------------------
    def outer_update(self, g: torch.Tensor) -> None:
        """One outer update with outer gradient g (see AsyncLocalSGD's equations)."""
        self.updates += 1
        if not self.delayed:  # Nesterov on every update (torch.optim.SGD(nesterov=True) on -g)
            self.m.mul_(self.beta).add_(g)
            self.x.sub_(self.lr * (g + self.beta * self.m))
        else:
            self.acc.add_(g)
            if self.updates % self.every == 0:
                self.m.mul_(self.beta).add_(self.acc, alpha=1.0 / self.every)
                self.x.sub_(self.lr * (g / self.every + self.beta * self.m))
                self.acc.zero_()
            else:
                self.x.sub_(g, alpha=self.lr / self.every)
        self.version += 1

    def push(self, rank: int, delta: torch.Tensor, samples: int, steps: int, now: float, pulled: int) -> None:
        """Worker `rank`'s outer gradient arrives (at `now`); applied at once, or buffered for a quorum merge."""
        self.arrivals += 1
        self.staleness.append(self.version - pulled)
        self.buffer.append((rank, delta.detach().clone(), int(samples), int(steps)))
        if len(self.buffer) >= self.quorum and self.quorum_at is None:
            self.quorum_at = now
        self.tick(now)

    def due(self) -> float | None:
        """When the buffered quorum must be merged (None: no quorum buffered)."""
        return None if self.quorum_at is None else self.quorum_at + self.grace_s

    def tick(self, now: float) -> bool:
        """Merge if a quorum is buffered and either every active worker contributed or the grace window ran out."""
        if self.quorum_at is None:
            return False
        everyone = {r for r, *_ in self.buffer} >= set(range(self.n)) - self.done
        if everyone or now >= self.quorum_at + self.grace_s - 1e-12:
            self.merge()
            return True
        return False

    def merge(self) -> None:
        """The buffered outer gradients as one update, each weighted by the samples it took:
        G = sum_j s_j Delta_j / sum_j s_j."""
        if not self.buffer:
            return
        total = sum(s for _, _, s, _ in self.buffer)
        if len(self.buffer) == 1:
            g = self.buffer[0][1]
        else:
            g = torch.zeros_like(self.x)
            for _, delta, samples, _ in self.buffer:
                g.add_(delta, alpha=samples / total if total > 0 else 1.0 / len(self.buffer))
        self.outer_update(g)
        self.merges += 1
        self.useful_steps += sum(k for *_, k in self.buffer)
        self.useful_samples += total
        self.buffer, self.quorum_at = [], None

    def finish(self) -> None:
        """The run ends: merge what is buffered, quorum or not."""
        self.merge()

    # --- dynamic local updates ------------------------------------------------------------------
    def report_speed(self, rank: int, speed: float) -> None:
        if speed > 0 and not self.given_speeds:
            self.speeds[rank] = float(speed)

    def period_of(self, rank: int) -> int:
        """Worker `rank`'s next number of local steps H_i: its own period, DyLU's, or H."""
        if self.periods is not None:
            return int(self.periods[rank])
        if not self.dylu:
            return self.period
        return dylu_period(self.period, self.speeds.get(rank), max(self.speeds.values(), default=None))

    # --- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "x": self.x.clone(),
            "m": self.m.clone(),
            "acc": self.acc.clone(),
            "updates": self.updates,
            "version": self.version,
            "buffer": [(r, d.clone(), s, k) for r, d, s, k in self.buffer],
            "speeds": dict(self.speeds),
            "counters": [self.arrivals, self.merges, self.useful_steps, self.useful_samples],
            "staleness": list(self.staleness),
        }

    def load_state_dict(self, state: dict) -> None:
        self.x.copy_(state["x"])
        self.m.copy_(state["m"])
        self.acc.copy_(state["acc"])
        self.updates, self.version = int(state["updates"]), int(state["version"])
        self.buffer = [(int(r), d.clone(), int(s), int(k)) for r, d, s, k in state["buffer"]]
        self.quorum_at = None  # a quorum buffered at the checkpoint is merged at the next arrival or tick
        if len(self.buffer) >= self.quorum:
            self.quorum_at = float("-inf")
        self.speeds = {int(r): float(v) for r, v in state["speeds"].items()}
        self.arrivals, self.merges, self.useful_steps, self.useful_samples = (int(c) for c in state["counters"])
        self.staleness = [int(s) for s in state["staleness"]]


class AsyncLocalSGD(DistributedOptimizer, ThreadedPeer):
    """Asynchronous Local-SGD (Liu et al. 2024) with delayed Nesterov (DN) and dynamic local updates (DyLU), and
    the quorum merge of Decoupled DiLoCo (2026). No global step: each worker i pulls the global model x, takes
    H_i steps of the base optimizer from it to x_i and pushes its outer gradient Delta_i = x_pulled - x_i; the
    merger (rank 0, which trains as a worker too) applies each on arrival and answers with the new global model.

    The merger's outer update t (t = 1, 2, ...) with outer gradient g_t (outer lr eps = `outer_lr`, momentum
    beta = `outer_momentum`, N = `dn_every`, m_0 = 0, Delta-bar_0 = 0):

    - delayed Nesterov (`delayed_nesterov: true`, the paper's Algorithm 3 as public code implements it):
          Delta-bar <- Delta-bar + g_t
          if t mod N == 0:  m <- beta m + Delta-bar / N;  x <- x - eps (g_t / N + beta m);  Delta-bar <- 0
          else:             x <- x - eps g_t / N
      so over N updates x moves by eps times the N gradients' mean plus one momentum step, as one synchronous
      DiLoCo outer step over N workers would; with N = 1 it is the next form;
    - Nesterov on every update (`delayed_nesterov: false`, the paper's naive asynchronous DiLoCo):
          m <- beta m + g_t;  x <- x - eps (g_t + beta m).

    g_t is one worker's Delta_i as it arrives (`quorum: 1`, grace_s 0), or a quorum merge (Decoupled DiLoCo):
    the merger buffers arrivals and, once `quorum` = k of them are buffered, merges when every active worker
    has contributed or `grace_s` seconds after the k-th arrival, whichever comes first:
          g_t = sum_j s_j Delta_j / sum_j s_j  (s_j: the samples contribution j took).
    N defaults to the number of workers per outer update's worth: max(1, n // k) (n with k = 1).

    Dynamic local updates (`dylu: true`): the merger answers each push with the worker's next period
    H_i = max(1, floor(H v_i / v_max)), v_i the steps per second worker i measured over its last round (compute
    only; on the event simulator's virtual clock, or a modelled network's emulated clock, so there the compute
    model's speeds) or the given `speeds`; v_max the largest known. `periods` fixes each worker's H_i instead.

    Failures: the event simulator takes `failures` ([[peer, at_s, down_s], ...]: peer fails at virtual time
    at_s, losing the round in progress, and restarts down_s later from the current global model); on real peers
    the merger ends without a worker silent for `comm.timeout_s` once the others are done (`departed` in the
    summary) when quorum > 1, and raises naming it otherwise. Goodput: the steps whose outer gradient was merged,
    per second of the run (virtual seconds on the simulator).

    Hierarchical (`groups: G` > 1, in the spirit of HALoS; quorum 1, no `failures`): the peers split into G
    contiguous groups of s = n / G; group g's first rank g s holds a local server (dpsgd.optim.hierarchical's
    GroupServer) whose merger applies its workers' Delta_i to the group model y_g by the rule above (N = `dn_every`,
    default s), and rank 0 also holds the global merger (x; delayed Nesterov with eps = `global_lr`, beta =
    `global_momentum`, N = `global_dn_every`, default G). With anchor_g = x_0 at the start, K = `global_every`:
          every K local merges with no push of the group in flight (and once more when the group's workers are
          done): D_g = anchor_g - y_g;  y_sent = y_g;  anchor_g <- y_g;  D_g goes to rank 0,
          which applies it on arrival as an outer gradient: x <- DN_global(x, D_g), and answers with x;
          the answer arrives: y_g <- x + (y_g - y_sent);  anchor_g <- x.
    `groups: 1` is the flat rule, number for number. On real peers each leader's communication thread serves its
    group and keeps one push to rank 0 in flight (`_GlobalLink`); rank 0's own group's pushes are served in memory;
    at the end every leader says DONE to rank 0, which sends every peer the final x.

    `budget` (steps per peer, total samples, seconds) ends the run as AD-PSGD's does. At the end every worker
    pushes its last (partial) round, the merger merges what is buffered and every peer takes the final global
    model."""

    asynchronous = True
    uses_topology = False
    summary_key = "async_local_sgd"
    label = "async Local-SGD"
    knobs = {"period": (4, 8, 16)}
    cost_form = None
    final_broadcast = True  # the simulator gives every peer rank 0's final model (real peers: finish() sends it)

    def __init__(
        self,
        base: torch.optim.Optimizer,
        *,
        period: int = 8,
        outer_lr: float = 0.5,
        outer_momentum: float = 0.5,
        delayed_nesterov: bool = True,
        dn_every: int | None = None,
        dylu: bool = True,
        periods: list | None = None,
        speeds: list | None = None,
        quorum: int = 1,
        grace_s: float = 0.0,
        failures: list | None = None,
        budget: str = "samples",
        seconds: float | None = None,
        groups: int = 1,
        global_every: int = 1,
        global_lr: float = 1.0,
        global_momentum: float = 0.0,
        global_dn_every: int | None = None,
        **common,
    ):
        super().__init__(base, **common)
        comm, n, name = self.comm, self.comm.size, type(self).__name__
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"{name} period must be an integer >= 1 (local steps per round), got {period!r}")
        if not outer_lr > 0 or not 0 <= outer_momentum < 1:
            raise ValueError(f"{name} needs outer_lr > 0 and 0 <= outer_momentum < 1, got {outer_lr}, {outer_momentum}")
        if isinstance(quorum, bool) or not isinstance(quorum, int) or not 1 <= quorum <= n:
            raise ValueError(
                f"{name} quorum must be an integer in [1, {n}] (workers whose gradients merge), got {quorum!r}"
            )
        if not grace_s >= 0:
            raise ValueError(f"{name} grace_s must be >= 0 seconds, got {grace_s}")
        hierarchical = _check_groups(name, n, groups, global_every, global_lr, global_momentum, global_dn_every)
        if hierarchical and (quorum > 1 or failures):
            raise ValueError(
                f"{name} groups > 1 takes neither a quorum nor failures yet: set quorum: 1 and failures: null, "
                "or groups: 1"
            )
        self.groups = int(groups)
        self.group, self.leader, members = group_of(comm.rank, n, self.groups)
        if dn_every is None:
            dn_every = max(1, n // quorum) if not hierarchical else len(members)
        if isinstance(dn_every, bool) or not isinstance(dn_every, int) or dn_every < 1:
            raise ValueError(f"{name} dn_every must be an integer >= 1 or null (n // quorum), got {dn_every!r}")
        for key, values in (("periods", periods), ("speeds", speeds)):
            if values is not None and (
                len(values) != n or not all(isinstance(v, int | float) and v > 0 for v in values)
            ):
                raise ValueError(f"{name} {key} must list one number > 0 per peer ({n}), got {values!r}")
        if periods is not None and not all(float(p).is_integer() for p in periods):
            raise ValueError(f"{name} periods must be whole numbers of local steps, got {periods!r}")
        self.failures = _failures(failures, n, name)
        if self.failures and getattr(comm, "clock", None) is None:  # real peers: only the event simulator schedules
            raise ValueError(
                f"{name} failures is a schedule in the event simulator's virtual time (backend=fleet); on real peers "
                "inject a failure with faults.kill_peer (and faults.kill_mode=hang)"
            )
        self.period, self.dylu, self.quorum = period, bool(dylu), quorum
        self.budget = budget
        self.clock = getattr(comm, "clock", time.monotonic)
        net = getattr(comm, "network", None)  # a modelled network: compute (hence speed) is on its emulated clock
        self.compute_clock = self.clock
        if net is not None and net.active and net.clock.mode == "model":
            self.compute_clock = net.clock.now
        self._abort = threading.Event()
        self.run_budget = Budget(self, seconds)
        self.samples_per_step = 1
        self.lock = threading.Lock()  # held from a push until its reply is loaded (the event simulator)
        self._merger_lock = threading.Lock()  # rank 0: its own pushes and its thread's serve the merger in turn
        with torch.no_grad():
            self.live = flatten(self.params()).clone()  # x_i after the last step (what the simulator shows)
        self.anchor = self.live.clone()  # x_pulled: the global model this round started from
        self.pulled_version = 0
        self.merger = (  # the global merger (groups: 1), or this group's local server's merger (on its leader)
            Merger(
                self.live,
                len(members),
                lr=outer_lr,
                momentum=outer_momentum,
                delayed_nesterov=delayed_nesterov,
                dn_every=dn_every,
                quorum=quorum,
                grace_s=grace_s,
                period=period,
                periods=[int(p) for p in periods] if periods is not None else None,
                dylu=dylu,
                speeds=speeds,
            )
            if comm.rank == self.leader
            else None
        )
        self.group_server: GroupServer | None = None  # groups > 1, on a group's leader
        self.global_merger: Merger | None = None  # groups > 1, on rank 0
        if hierarchical and self.merger is not None:
            self.group_server = GroupServer(self.merger, global_every, members)
            if comm.rank == 0:
                self.global_merger = Merger(
                    self.live,
                    self.groups,
                    lr=global_lr,
                    momentum=global_momentum,
                    delayed_nesterov=delayed_nesterov,
                    dn_every=global_dn_every or self.groups,
                    quorum=1,
                    grace_s=0.0,
                    period=period,
                    periods=None,
                    dylu=False,
                    speeds=None,
                )
        self.my_period = int(periods[comm.rank]) if periods is not None else period
        self.role = "active"  # every peer pushes (rank 0 to its own merger, alone too)
        self.partners = frozenset({self.leader}) if comm.rank != self.leader else frozenset()
        self.link = comm.duplicate() if n > 1 else None  # collective: every peer makes it
        if n > 1 and hasattr(comm, "require_thread_multiple"):
            comm.require_thread_multiple(f"{name} (rank 0 serves pushes from a communication thread)")
        self.steps_in_round = self.samples_in_round = 0
        self.round_started: float | None = None
        self.compute_s = 0.0  # this round's compute time (speed = steps / compute_s)
        self._step_began: float | None = None
        self.samples = 0
        self.pushes = 0
        self.lost_steps = 0  # steps of rounds lost to failures
        self.wait_s = 0.0
        self.down = False
        self._due = False  # a round ended: a push is due (the simulator calls request())
        self._sent = PUSH  # what the message in flight is (a restarted worker's first is a pull)
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self.threaded = True
        self._threads: list[threading.Thread] = []
        self._errors: list[BaseException] = []
        self._finished = False
        self.departed: list[int] = []
        self._last_round = False  # this worker's round in progress is its last (its budget is spent)

    # --- the asynchronous optimizer's protocol ----------------------------------------------------
    @property
    def exchanges(self):
        """The pushes and pulls in the three parts the event simulator performs (request, serve, complete)."""
        return self

    @property
    def message_numel(self) -> int:
        return HEADER + self.live.numel()

    @property
    def carries_on(self) -> bool:
        """With a quorum, silent workers are left behind (the merger, the shared samples budget's coordinator)."""
        return self.quorum > 1

    @property
    def staleness(self) -> int:
        """Outer updates the merger applied since this worker pulled (known at its next pull; 0 here)."""
        return 0

    def start(self, threads: bool = True) -> None:
        """Start the clock and, on real peers, rank 0's communication thread (and the samples coordinator)."""
        if self.started_at is not None:
            return
        self.started_at, self.round_started = self.clock(), self.compute_clock()
        self.threaded = threads
        if not threads:
            return
        if self.run_budget.coordinating:
            self.run_budget.require()
            self._spawn(self.run_budget.coordinate, "coordinator")
        if self.merger is not None and self.comm.size > 1:
            self._spawn(self._serve_loop, "merger")

    def param_group_added(self, params: list[torch.Tensor]) -> None:
        raise ValueError(
            f"{type(self).__name__} cannot take a new parameter group (its global model is the parameters flattened "
            "at construction): give every group to the base optimizer before building it (with lr=0 to hold one back)"
        )

    def should_stop(self) -> bool:
        self.start()
        self._raise_thread_error()
        assert self.started_at is not None
        return self.run_budget.spent(self.step_count, self.samples, self.clock() - self.started_at)

    # --- a worker's step --------------------------------------------------------------------------
    def update(self) -> None:
        self.start()
        self._raise_thread_error()
        if self.down:
            raise RuntimeError(f"rank {self.comm.rank}: {type(self).__name__} stepped while failed; restart() first")
        self.base.step()
        now = self.compute_clock()
        began = self._step_began if self._step_began is not None else self.round_started
        self.compute_s += now - (now if began is None else began)
        self._step_began = now
        self.step_count += 1
        self.samples += self.samples_per_step
        self.steps_in_round += 1
        self.samples_in_round += self.samples_per_step
        with self.lock:
            self.live.copy_(flatten(self.params()))
        self.run_budget.report(self.samples, final=False)
        spent = self.run_budget.spent(self.step_count, self.samples, self.clock() - (self.started_at or 0.0))
        if self.steps_in_round >= self.my_period or spent:
            self._due = True
            self._last_round = bool(spent)
            if self.threaded:
                self._push_and_pull()

    def _speed(self) -> float:
        return self.steps_in_round / self.compute_s if self.compute_s > 0 else 0.0

    def _message(self, kind: float) -> torch.Tensor:
        msg = torch.empty(self.message_numel, dtype=self.live.dtype)
        msg[0], msg[1] = kind, float(self.comm.rank)
        msg[2], msg[3] = float(self.samples_in_round), float(self.steps_in_round)
        msg[4], msg[5] = self._speed(), float(self.pulled_version)
        if kind == PUSH:
            torch.sub(self.anchor, self.live, out=msg[HEADER:])
        else:
            msg[HEADER:].zero_()
        return msg

    # --- the three parts (the event simulator's, and the threads' on real peers) ---------------------
    def request(self) -> tuple[int, torch.Tensor] | None:
        """After a step: the push of a finished round (or a failed worker's pull on restart), to the merger (rank 0),
        with x_i locked until `complete`; None when no message is due."""
        if not self._due:
            return None
        self._due = False
        self.lock.acquire()
        self._sent = PULL if self.steps_in_round == 0 else PUSH
        return self.leader, self._message(self._sent)

    def serve(self, message: torch.Tensor) -> torch.Tensor | None:
        """The merger (rank 0): take a push, a pull or a DONE; answer [version, the sender's next period, x]
        (None for DONE)."""
        merger = self.merger
        if merger is None:
            raise CommError(f"rank {self.comm.rank} got a message for the merger, which is rank 0")
        kind, sender = message[0].item(), int(message[1].item())
        if kind == UP:
            return self._serve_group(message)
        with self._merger_lock:
            if kind == DONE:
                merger.done.add(sender)
                merger.tick(self.clock())
                return None
            if kind == PUSH:
                merger.report_speed(sender, float(message[4].item()))
                merger.push(
                    sender,
                    message[HEADER:].to(merger.x.device),
                    int(message[2].item()),
                    int(message[3].item()),
                    self.clock(),
                    int(message[5].item()),
                )
                if sender == self.comm.rank and self._last_round and self.group_server is not None:
                    merger.done.add(sender)  # the leader's own worker pushed its last round
            reply = torch.empty(REPLY_HEADER + merger.x.numel(), dtype=merger.x.dtype)
            reply[0], reply[1] = float(merger.version), float(merger.period_of(sender))
            reply[REPLY_HEADER:].copy_(merger.x)
        return reply

    # --- groups > 1: a group server's exchange with the global merger (the event simulator's upstream) -----
    def upstream(self) -> tuple[int, torch.Tensor] | None:
        """A group's leader: its push of the group delta D_g to the global merger (rank 0) when one is due (every
        `global_every` local merges, and the rest once its workers are done); None otherwise."""
        group = self.group_server
        if group is None:
            return None
        with self._merger_lock:
            if not group.due():
                return None
            delta = group.take_push()
        message = torch.empty(self.message_numel, dtype=self.live.dtype)
        merger = group.merger
        message[0], message[1] = UP, float(self.comm.rank)
        message[2], message[3] = float(merger.useful_samples), float(merger.useful_steps)
        message[4], message[5] = 0.0, float(group.global_version)
        message[HEADER:].copy_(delta)
        return 0, message

    def _serve_group(self, message: torch.Tensor) -> torch.Tensor:
        """The global merger (rank 0): apply a group's delta D_g with the global outer optimizer and answer with the
        global model [version, 0, x]."""
        merger = self.global_merger
        if merger is None:
            raise CommError(f"rank {self.comm.rank} got a group's push for the global merger, which is rank 0")
        sender = int(message[1].item())
        with self._merger_lock:
            merger.push(
                sender // (self.comm.size // self.groups),
                message[HEADER:].to(merger.x.device),
                int(message[2].item()),
                int(message[3].item()),
                self.clock(),
                int(message[5].item()),
            )
            reply = torch.empty(REPLY_HEADER + merger.x.numel(), dtype=merger.x.dtype)
            reply[0], reply[1] = float(merger.version), 0.0
            reply[REPLY_HEADER:].copy_(merger.x)
        return reply

    def complete_upstream(self, partner: int, reply: torch.Tensor) -> None:
        """A group's leader: adopt the global model of the reply (y <- x + (y - y_sent), anchor <- x)."""
        group = self.group_server
        assert group is not None
        with self._merger_lock:
            group.adopt(reply[REPLY_HEADER:].to(group.merger.x.device), int(reply[0].item()))

    def complete(self, partner: int, reply: torch.Tensor) -> None:
        """The worker: load the global model of the reply, start the next round, release x_i."""
        try:
            if not self.down:
                self._adopt(reply[REPLY_HEADER:], int(reply[0].item()))
                self.my_period = int(reply[1].item())
                self.pushes += self._sent == PUSH
                self._sent = PUSH
        finally:
            if self.lock.locked():
                self.lock.release()

    def _adopt(self, x: torch.Tensor, version: int) -> None:
        params = self.params()
        with torch.no_grad():
            for p, value in zip(params, unflatten(x, params)):
                p.copy_(value)
            self.live.copy_(x)
            self.anchor.copy_(x)
        self.pulled_version = version
        self.steps_in_round = self.samples_in_round = 0
        self.compute_s = 0.0
        self.round_started = self.compute_clock()
        self._step_began = None

    def tick(self) -> float | None:
        """The merger: merge a quorum whose grace window ran out; the time of the next such merge (None: none)."""
        if self.merger is None:
            return None
        with self._merger_lock:
            self.merger.tick(self.clock())
            return self.merger.due()

    # --- failures (the event simulator's schedule) --------------------------------------------------
    def fail(self) -> None:
        """This worker fails: the round in progress is lost, a push in flight is abandoned."""
        self.lost_steps += self.steps_in_round
        self.down, self._due = True, False
        self.steps_in_round = self.samples_in_round = 0
        if self.lock.locked():
            self.lock.release()

    def restart(self) -> None:
        """This worker is back: its next message pulls the current global model."""
        self.down, self._due = False, True

    # --- real peers: the worker's blocking push and rank 0's thread ---------------------------------
    def _push_and_pull(self) -> None:
        """Real peers: push this round's outer gradient and load the answer (rank 0: to its own merger)."""
        if self.merger is not None:  # rank 0 (a group's leader) is its own merger
            reply = self.serve(self._message(PUSH))
            assert reply is not None
            self.complete(self.comm.rank, reply)
            self._due = False
            return
        link = self.link
        assert link is not None
        self._due = False
        message = self._message(PUSH)
        reply = torch.empty(REPLY_HEADER + self.live.numel(), dtype=self.live.dtype)
        recv = link.start_recv(reply, self.leader, TAG_REPLY)
        send = link.start_send(message, self.leader, TAG_PUSH)
        then = "; the merger died or hangs (raise comm.timeout_s if it is slow)"
        what = f"push to the merger (rank {self.leader}) was not answered"
        self._wait(lambda: send.test() and recv.test(), what, then)
        self.complete(self.leader, reply)

    def _serve_loop(self) -> None:
        """Rank 0's communication thread (with groups, each group leader's): answer pushes, merge quorums whose grace
        ran out, until every other worker (of the group) said DONE; with groups, also the exchange with the global
        merger (`_GlobalLink`) until it is settled. A worker silent for comm.timeout_s after this rank's own worker is
        done is departed (quorum > 1: the merger ends without it) or named in a PeerTimeoutError (quorum 1)."""
        link, merger, timeout_s = self.link, self.merger, self.comm.timeout_s
        assert link is not None and merger is not None
        workers = set(group_of(self.comm.rank, self.comm.size, self.groups)[2]) - {self.comm.rank}
        heard = {r: time.monotonic() for r in workers}
        incoming = torch.empty(self.message_numel, dtype=self.live.dtype)
        recv = link.start_recv(incoming, None, TAG_PUSH) if workers else None
        upper = _GlobalLink(self) if self.group_server is not None else None
        while workers - merger.done or (upper is not None and not upper.settled()):
            if self._abort.is_set():
                return
            if upper is not None:
                upper.pump()
            if recv is None or not (workers - merger.done) or not recv.test():
                self.tick()
                if self._finished_own is not None:  # rank 0's worker is done: silence now counts
                    now = time.monotonic()
                    waiting = workers - merger.done
                    silent = sorted(r for r in waiting if now - max(heard[r], self._finished_own) > timeout_s)
                    if silent and self.quorum == 1:
                        raise PeerTimeoutError(
                            f"rank {self.comm.rank}: the async Local-SGD merger heard nothing for {timeout_s:g} s "
                            f"from worker(s) "
                            f"{silent}; a peer died or hangs (algorithm.quorum > 1 carries on without it; raise "
                            "comm.timeout_s if peers are just slow)"
                        )
                    if silent:
                        with self._merger_lock:
                            merger.done.update(silent)
                        self.departed.extend(silent)
                        continue
                time.sleep(0.0005)
                continue
            sender = int(incoming[1].item())
            heard[sender] = time.monotonic()
            reply = self.serve(incoming)
            if workers - merger.done:
                recv = link.start_recv(incoming, None, TAG_PUSH)
            if reply is not None:
                send = link.start_send(reply, sender, TAG_REPLY)
                link.wait_request("async Local-SGD merger's reply", send, [sender])
        with self._merger_lock:
            merger.finish()

    _finished_own: float | None = None  # when rank 0's worker finished (silent workers may then be departed)

    def finish(self) -> None:
        """End this peer's part: its last round was pushed by its last step; a worker says DONE and waits for the
        final global model, which rank 0 sends once every worker is done (the simulator: `final_broadcast`)."""
        if self._finished:
            return
        self.start()
        self.finished_at = self.clock()
        try:
            self.run_budget.report(self.samples, final=True)
            if self.threaded and self.steps_in_round > 0:  # the budget ran out between its pushes (the shared
                self._push_and_pull()  # samples budget's answer comes a step late): its last steps are not lost
            if self.threaded and self.comm.size > 1:
                self._final_exchange()
            elif self.merger is not None and not self.threaded:
                pass  # the simulator merges the rest once every worker is done (conclude)
            self._raise_thread_error()
        except BaseException:
            self.abort()
            raise
        self._finished = True
        self._merge_link_stats()
        for link in (self.link, self.run_budget.control):
            if link is not None:
                link.close()

    def closing(self) -> torch.Tensor | None:
        """A finished worker's DONE to the merger (the event simulator delivers it)."""
        return self._message(DONE)

    def conclude(self) -> None:
        """The simulator: every worker is done; the merger merges what is buffered and rank 0 takes the result."""
        root = self.global_merger if self.global_merger is not None else self.merger
        if root is not None:
            with self._merger_lock:
                root.finish()
            self._adopt(root.x, root.version)

    def adopt_final(self, x: torch.Tensor) -> None:
        """Take rank 0's final global model (the simulator's `final_broadcast`)."""
        self._adopt(x, self.pulled_version)

    def _final_exchange(self) -> None:
        link = self.link
        assert link is not None
        final = torch.empty(REPLY_HEADER + self.live.numel(), dtype=self.live.dtype)
        leader = self.merger is not None and self.comm.rank != 0  # groups > 1: a group's leader other than rank 0
        if leader and self.merger is not None:
            self._finished_own = time.monotonic()
            with self._merger_lock:
                self.merger.done.add(self.comm.rank)  # its own worker is done: the group's last push may go
            self._join_threads(3 * self.comm.timeout_s)
        if self.merger is None or leader:  # say DONE (a leader to the global merger) and take the final model
            recv = link.start_recv(final, 0, TAG_REPLY)
            closing = self._message(DONE)
            send = link.start_send(closing, 0, TAG_UP) if leader else link.start_send(closing, self.leader, TAG_PUSH)
            deadline = 2 * self.comm.timeout_s
            t0 = time.monotonic()
            try:
                done = poll_until(lambda: send.test() and recv.test(), t0 + deadline, abort=self._abort.is_set)
            except PeerTimeoutError:
                done = False
            if not done:
                raise PeerTimeoutError(
                    f"rank {self.comm.rank}: async Local-SGD's final model did not come from the merger (rank 0) "
                    f"within {deadline:g} s; it died or hangs (raise comm.timeout_s if peers are slow)"
                )
            self._adopt(final[REPLY_HEADER:], int(final[0].item()))
            return
        self._finished_own = time.monotonic()
        if self.group_server is not None:
            with self._merger_lock:
                self.group_server.merger.done.add(0)  # rank 0's own worker is done
        self._join_threads(3 * self.comm.timeout_s)
        if self.group_server is not None:  # its own group's last pushes, in memory
            while (begun := self.upstream()) is not None:
                self.complete_upstream(0, self._serve_group(begun[1]))
        merger = self.global_merger if self.global_merger is not None else self.merger
        assert merger is not None
        self._adopt(merger.x, merger.version)
        final[0], final[1] = float(merger.version), 0.0
        final[REPLY_HEADER:].copy_(merger.x)
        sends = [(r, link.start_send(final, r, TAG_REPLY)) for r in range(1, self.comm.size) if r not in self.departed]
        for r, send in sends:
            link.wait_request("async Local-SGD's final model", send, [r])

    def settle(self) -> None:
        """No push of this worker is in flight after a step on real peers (each push waits for its reply)."""

    def abort(self) -> None:
        self._abort.set()

    def _merge_link_stats(self) -> None:
        if self.link is None:
            return
        s, link = self.comm.stats, self.link.stats
        s.bytes_sent += link.bytes_sent
        s.bytes_received += link.bytes_received
        s.messages_sent += link.messages_sent
        s.comm_time_s += self.wait_s
        s.calls["async_local_sgd_push"] = s.calls.get("async_local_sgd_push", 0) + self.pushes

    # --- measurements -----------------------------------------------------------------------------
    def measurements(self) -> dict:
        end = self.finished_at or self.clock()
        elapsed = end - self.started_at if self.started_at is not None else 0.0
        row = {
            "role": "merger" if self.merger is not None else "worker",
            "steps": self.step_count,
            "samples": self.samples,
            "pushes": self.pushes,
            "lost_steps": self.lost_steps,
            "period": self.my_period,
            "wait_s": self.wait_s,
            "elapsed_s": elapsed,
        }
        m = self.merger
        if m is not None:
            row.update(
                arrivals=m.arrivals,
                merges=m.merges,
                useful_steps=m.useful_steps,
                useful_samples=m.useful_samples,
                staleness=list(m.staleness),
                departed=list(self.departed),
                speeds={str(r): v for r, v in sorted(m.speeds.items())},
            )
        if self.group_server is not None:
            row.update(role="group server", global_pushes=self.group_server.pushes)
        g = self.global_merger
        if g is not None:
            row.update(role="global merger", global_arrivals=g.arrivals, global_staleness=list(g.staleness))
        return row

    def summary(self, rows: list[dict]) -> dict:
        """summary.json's `async_local_sgd` block: the merger's counts, goodput and staleness, per-peer lists."""
        server = rows[0]
        elapsed = max(float(r["elapsed_s"]) for r in rows)
        servers = [r for r in rows if "arrivals" in r]  # the merger (groups: 1) or each group's server
        stale = [s for r in servers for s in r["staleness"]]
        steps = sum(int(r["steps"]) for r in rows)
        useful = sum(int(r["useful_steps"]) for r in servers)
        hierarchy = {}
        if "global_arrivals" in server:  # groups > 1: the global merger's counts (staleness in its updates)
            global_stale = server["global_staleness"]
            hierarchy = {
                "global_arrivals": int(server["global_arrivals"]),
                "global_pushes_per_group": [int(r["global_pushes"]) for r in servers],
                "global_staleness_mean": sum(global_stale) / len(global_stale) if global_stale else 0.0,
            }
        return {
            **hierarchy,
            "arrivals": sum(int(r["arrivals"]) for r in servers),
            "merges": sum(int(r["merges"]) for r in servers),
            "useful_steps": useful,
            "lost_steps": steps - useful,
            "goodput_steps_per_s": useful / elapsed if elapsed > 0 else 0.0,
            "goodput_fraction": useful / steps if steps else 0.0,
            "elapsed_s": elapsed,
            "staleness_mean": sum(stale) / len(stale) if stale else 0.0,
            "staleness_max": max(stale, default=0),
            "departed": server.get("departed", []),
            "speeds": {k: v for r in servers for k, v in r.get("speeds", {}).items()},
            "steps_per_peer": [int(r["steps"]) for r in rows],
            "pushes_per_peer": [int(r["pushes"]) for r in rows],
            "period_per_peer": [int(r["period"]) for r in rows],
            "wait_s_per_peer": [float(r["wait_s"]) for r in rows],
            "slowdown_s_per_peer": [float(r.get("slowdown_s", 0.0)) for r in rows],
        }

    def algorithm_state(self):
        """The worker's round and counters, and on rank 0 the merger's state. A checkpoint is taken after a step on
        every peer (a steps budget; dpsgd.training), when no push is in flight: each push waits for its reply."""
        state = {
            **super().algorithm_state(),
            "live": self.live.clone(),
            "anchor": self.anchor.clone(),
            "round": [self.pulled_version, self.my_period, self.steps_in_round, self.samples_in_round],
            "counters": [self.samples, self.pushes, self.lost_steps],
            "times": [self.compute_s, self.wait_s],
        }
        if self.merger is not None:
            with self._merger_lock:
                state["merger"] = self.merger.state_dict()
                if self.group_server is not None:
                    state["group_server"] = self.group_server.state_dict()
                if self.global_merger is not None:
                    state["global_merger"] = self.global_merger.state_dict()
        return state

    def load_algorithm_state(self, state):
        super().load_algorithm_state(state)
        roles = ("merger", "group_server", "global_merger")  # which servers a rank holds (groups > 1: leaders, 0)
        if [self.merger is None, self.group_server is None, self.global_merger is None] != [
            r not in state for r in roles
        ]:
            flat = f"rank {'0' if 'merger' in state else '> 0'}"
            saved = flat if self.groups == 1 else "a rank with other servers (another rank, or other groups)"
            raise ValueError(
                f"this {type(self).__name__} state_dict was saved on {saved} and "
                f"cannot load on rank {self.comm.rank}: load each rank's own checkpoint"
            )
        with self.lock:
            self.live.copy_(state["live"])
            self.anchor.copy_(state["anchor"])
        self.pulled_version, self.my_period, self.steps_in_round, self.samples_in_round = (
            int(v) for v in state["round"]
        )
        self.samples, self.pushes, self.lost_steps = (int(v) for v in state["counters"])
        self.compute_s, self.wait_s = (float(v) for v in state["times"])
        if self.merger is not None:
            with self._merger_lock:
                self.merger.load_state_dict(state["merger"])
                if self.group_server is not None:
                    self.group_server.load_state_dict(state["group_server"])
                if self.global_merger is not None:
                    self.global_merger.load_state_dict(state["global_merger"])


class _GlobalLink:
    """groups > 1 on real peers, in a group leader's communication thread: its group's pushes to the global merger
    (rank 0) and their answers, one in flight at a time (rank 0's own group's in memory); on rank 0 also the other
    groups' pushes, each answered with the global model, and their DONE."""

    def __init__(self, opt: AsyncLocalSGD):
        assert opt.link is not None
        self.opt, self.link = opt, opt.link
        n, groups = opt.comm.size, opt.groups
        self.leaders = {g * (n // groups) for g in range(1, groups)} if opt.global_merger is not None else set()
        self.leaders_done: set[int] = set()
        self.heard = {r: time.monotonic() for r in self.leaders}
        self.incoming = torch.empty(opt.message_numel, dtype=opt.live.dtype)
        self.recv = self.link.start_recv(self.incoming, None, TAG_UP) if self.leaders else None
        self.flight: tuple | None = None  # (send, recv, message, answer) of this group's push in flight

    def settled(self) -> bool:
        """Rank 0: every other group said DONE; another leader: its group is done and its last push answered."""
        opt, group = self.opt, self.opt.group_server
        assert group is not None
        if opt.global_merger is not None:
            return self.leaders <= self.leaders_done
        return group.finished and self.flight is None and not group.due()

    def pump(self) -> None:
        opt, link = self.opt, self.link
        if self.recv is not None and self.recv.test():  # rank 0: a group's push (answered) or its DONE
            sender = int(self.incoming[1].item())
            self.heard[sender] = time.monotonic()
            if self.incoming[0].item() == DONE:
                self.leaders_done.add(sender)
            else:
                send = link.start_send(opt._serve_group(self.incoming), sender, TAG_UP_REPLY)
                link.wait_request("async Local-SGD global merger's reply", send, [sender])
            self.recv = link.start_recv(self.incoming, None, TAG_UP) if self.leaders - self.leaders_done else None
        elif self.recv is not None and opt._finished_own is not None:  # rank 0's worker is done: silence counts
            now, timeout_s = time.monotonic(), opt.comm.timeout_s
            waiting = self.leaders - self.leaders_done
            silent = sorted(r for r in waiting if now - max(self.heard[r], opt._finished_own) > timeout_s)
            if silent:
                raise PeerTimeoutError(
                    f"rank 0: the async Local-SGD global merger heard nothing for {timeout_s:g} s from group "
                    f"leader(s) {silent}; a peer died or hangs (raise comm.timeout_s if groups are just slow)"
                )
        if self.flight is not None and self.flight[0].test() and self.flight[1].test():
            opt.complete_upstream(0, self.flight[3])
            self.flight = None
        if self.flight is None and (begun := opt.upstream()) is not None:
            if opt.comm.rank == 0:
                opt.complete_upstream(0, opt._serve_group(begun[1]))
            else:
                answer = torch.empty(REPLY_HEADER + opt.live.numel(), dtype=opt.live.dtype)
                recv = link.start_recv(answer, 0, TAG_UP_REPLY)
                self.flight = (link.start_send(begun[1], 0, TAG_UP), recv, begun[1], answer)


def _check_groups(name, n, groups, every, lr, momentum, dn_every) -> bool:
    """The hierarchical options checked (one line each); True when there is more than one group."""
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or n % groups:
        raise ValueError(
            f"{name} groups must be a whole divisor of the peers ({n}) (G equal contiguous groups), got {groups!r}"
        )
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"{name} global_every must be an integer >= 1 (local merges per global push), got {every!r}")
    if not (isinstance(lr, int | float) and lr > 0) or not (isinstance(momentum, int | float) and 0 <= momentum < 1):
        raise ValueError(f"{name} needs global_lr > 0 and 0 <= global_momentum < 1, got {lr!r}, {momentum!r}")
    if dn_every is not None and (isinstance(dn_every, bool) or not isinstance(dn_every, int) or dn_every < 1):
        raise ValueError(f"{name} global_dn_every must be an integer >= 1 or null (groups), got {dn_every!r}")
    return groups > 1


def _failures(failures, n: int, name: str) -> list[tuple[int, float, float]]:
    """[[peer, at_s, down_s], ...] checked: peers 1..n-1 (rank 0 is the merger), times >= 0, down_s > 0."""
    out = []
    for entry in failures or []:
        ok = isinstance(entry, list | tuple) and len(entry) == 3
        if ok:
            peer, at, down = entry
            ok = isinstance(peer, int) and not isinstance(peer, bool) and 1 <= peer < n
            ok = ok and isinstance(at, int | float) and at >= 0 and isinstance(down, int | float) and down > 0
        if not ok:
            raise ValueError(
                f"{name} failures takes [[peer, at_s, down_s], ...] with peer in [1, {n}) (rank 0 is the merger), "
                f"at_s >= 0 and down_s > 0 virtual seconds; got {entry!r}"
            )
        out.append((int(entry[0]), float(entry[1]), float(entry[2])))
    return out
