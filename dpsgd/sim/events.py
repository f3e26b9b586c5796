"""AD-PSGD as an event-driven simulation in virtual time: the protocol of `dpsgd.optim.adpsgd` replayed
exactly (roles, partner draws with the real peer's generator and candidates, locks, staleness), with
compute times drawn per peer and step from a configurable distribution (stragglers, heavy tails) and
message times from a `dpsgd.comm.netem.Link`. What virtual time adds to that protocol:
- the gradient at the snapshot x_hat_i takes `compute.draw(i)` virtual seconds; the step then waits
  while x_i is locked (an active peer holds the lock from sending its request until the reply is
  averaged in);
- a request [header, x_i] arrives after `link.message_time(bytes)`; a passive peer serves requests one
  at a time in arrival order, and is busy until its reply (arriving after its own message time) is sent;
- budgets: 'steps' per peer, total 'samples' (the coordinator's answer is instant here; on real peers it
  arrives one step late) or virtual 'seconds'.

Events at the same virtual time run in the order they were scheduled, so a seed gives one history.
`Simulation.log` records it: ("step", t, peer, k, staleness) and ("avg", t, active, id, passive).
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.func import functional_call, grad_and_value

from dpsgd import data
from dpsgd.build import base_optimizer, build_model, build_topology, load_data, partition
from dpsgd.comm.base import flatten, unflatten
from dpsgd.comm.netem import NetworkEmulator
from dpsgd.metrics import loss_function
from dpsgd.optim.adpsgd import HEADER, check_budget, choose_partner, partner_rng, roles
from dpsgd.seeds import batch_seed

DISTRIBUTIONS = ("constant", "exponential", "lognormal", "pareto")


@dataclass
class ComputeTimes:
    """Per-step compute times in virtual seconds: mean_s x the peer's scale x a factor of mean 1 drawn
    from `distribution` (constant; exponential; lognormal with `sigma`; pareto with tail index `shape` > 1,
    heavy-tailed), from one generator per peer seeded by (seed, rank)."""

    n: int
    mean_s: float = 0.01
    distribution: str = "constant"
    sigma: float = 0.5
    shape: float = 2.5
    scales: dict = field(default_factory=dict)  # rank -> slowdown (network.slow_peers x compute_scale)
    seed: int = 0

    def __post_init__(self):
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(
                f"compute distribution must be one of {', '.join(DISTRIBUTIONS)}, got {self.distribution!r}"
            )
        if not self.mean_s > 0:
            raise ValueError(f"the mean compute time must be > 0 seconds, got {self.mean_s}")
        if self.distribution == "pareto" and not self.shape > 1:
            raise ValueError(f"pareto compute times need a tail index shape > 1 (a finite mean), got {self.shape}")
        self._rngs = [np.random.default_rng([int(self.seed), r]) for r in range(self.n)]

    def draw(self, rank: int) -> float:
        rng, d = self._rngs[rank], self.distribution
        if d == "constant":
            factor = 1.0
        elif d == "exponential":
            factor = rng.exponential()
        elif d == "lognormal":
            factor = math.exp(self.sigma * rng.standard_normal() - self.sigma**2 / 2)
        else:
            factor = (1.0 + rng.pareto(self.shape)) * (self.shape - 1) / self.shape
        return self.mean_s * self.scales.get(rank, 1.0) * factor


class Simulation:
    """AD-PSGD on n simulated peers of the experiment config `cfg` (the same data shares, batches,
    initial model, topology and partner draws as the real run)."""

    def __init__(
        self,
        cfg: dict,
        link=None,
        compute: ComputeTimes | None = None,
        budget: str | None = None,
        record_increments: bool = False,
    ):
        algo, n, seed = cfg["algorithm"], int(cfg["peers"]), int(cfg["seed"])
        self.cfg, self.n = cfg, n
        self.budget = check_budget(budget or algo.get("budget", "samples"))
        self.link = link if link is not None else NetworkEmulator.from_config(cfg.get("network")).link
        self.compute = compute if compute is not None else compute_times(cfg, n)
        self.split = load_data(cfg)
        self.shares = partition(cfg, self.split, n)
        bs = int(cfg["batch_size"])
        self.batches = [
            data.Batches(self.split.x_train[s], self.split.y_train[s], bs, seed=batch_seed(seed, r))
            for r, s in enumerate(self.shares)
        ]
        self.model = build_model(cfg, self.split)
        self.names = [name for name, _ in self.model.named_parameters()]
        self.topology = build_topology(cfg, n)
        self.loss_fn = loss_function(self.split.y_train)
        init = [p.detach() for p in self.model.parameters()]
        self.params = [[p.clone() for p in init] for _ in range(n)]  # each peer's snapshot x_hat_i
        self.base = [base_optimizer(cfg, ps) for ps in self.params]
        flat0 = flatten(init)
        self.live = flat0.repeat(n, 1)  # x_i
        self.role, self.partners = zip(*(roles(self.topology, r, n) for r in range(n)))
        self.rng = [partner_rng(int(algo.get("seed", 0)), r) for r in range(n)]
        self.steps_per_epoch = max(1, len(self.split.x_train) // (n * bs))
        self.total_steps = int(cfg["epochs"]) * self.steps_per_epoch
        self.budget_steps, self.budget_samples = self.total_steps, self.total_steps * bs * n
        self.budget_seconds = None if algo.get("seconds") is None else float(algo["seconds"])
        if self.budget == "seconds" and self.budget_seconds is None:
            raise ValueError("ADPSGD(budget='seconds') needs algorithm.seconds (virtual seconds here)")
        self.batch_size = bs
        item = flat0.element_size()
        self.request_bytes, self.reply_bytes = (HEADER + flat0.numel()) * item, flat0.numel() * item
        self.version = [0] * n
        self.snap_version = [0] * n
        self.steps = [0] * n
        self.initiated = [0] * n
        self.served = [0] * n
        self.staleness: list[list[int]] = [[] for _ in range(n)]  # histogram per peer
        self.wait_s = [0.0] * n
        self.bytes_sent = [0] * n
        self.bytes_received = [0] * n
        self.finished_at = [0.0] * n
        self.losses: list[list[float]] = [[] for _ in range(n)]
        self.log: list[tuple] = []
        self.increments: list[torch.Tensor] | None = [] if record_increments else None
        self.now = 0.0
        self._locked = [False] * n
        self._waiting: list[float | None] = [None] * n  # (time computed) of a step waiting for the lock
        self._stopping = [False] * n
        self._server_free = [0.0] * n
        self._heap: list = []
        self._seq = itertools.count()
        self._grad = grad_and_value(self._loss)
        self._started = False
        self._stepped: int | None = None

    # --- the event queue ------------------------------------------------------------------------
    def _at(self, t: float, kind: str, *args) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, args))

    def advance(self) -> int | None:
        """Simulate until some peer takes a step; return that peer (None once every peer has finished)."""
        if not self._started:
            self._started = True
            for r in range(self.n):
                self._at(self.compute.draw(r), "computed", r)
        self._stepped = None
        while self._heap and self._stepped is None:
            t, _, kind, args = heapq.heappop(self._heap)
            self.now = t
            getattr(self, "_on_" + kind)(*args)
        return self._stepped

    def done(self) -> bool:
        return self._started and not self._heap

    def run(self) -> Simulation:
        """Simulate until every peer has finished."""
        while not self.done():
            self.advance()
        return self

    # --- peer i's main thread -------------------------------------------------------------------
    def _loss(self, params, x, y):
        return self.loss_fn(functional_call(self.model, dict(zip(self.names, params)), (x,)), y)

    def _on_computed(self, i: int) -> None:
        if self._locked[i]:  # the averaging in flight holds x_i: the step waits for the reply
            self._waiting[i] = self.now
            return
        self._step(i)

    def _step(self, i: int) -> None:
        params, base = self.params[i], self.base[i]
        x, y = self.batches[i].next()
        grads, loss = self._grad(tuple(params), x, y)
        for p, g in zip(params, grads):
            p.grad = g
        with torch.no_grad():
            before = flatten(params)
            base.step()
            after = flatten(params)
            stale = self.version[i] - self.snap_version[i]
            if self.increments is not None:
                self.increments.append(after - before)
            if stale == 0:
                self.live[i].copy_(after)
            else:
                self.live[i].add_(after.sub_(before))
            self.snap_version[i] = self.version[i]
            for p, value in zip(params, unflatten(self.live[i], params)):
                p.copy_(value)
        hist = self.staleness[i]
        hist.extend([0] * (stale + 1 - len(hist)))
        hist[stale] += 1
        self.log.append(("step", self.now, i, self.steps[i], stale))
        self.steps[i] += 1
        self.losses[i].append(float(loss))
        if self.role[i] == "active":
            self._request(i)
        if self._should_stop(i):
            self._stopping[i] = True
            if not self._locked[i]:
                self._finish(i)
        else:
            self._at(self.now + self.compute.draw(i), "computed", i)
        self._stepped = i

    def _should_stop(self, i: int) -> bool:
        if self.budget == "steps":
            return self.steps[i] >= self.budget_steps
        if self.budget == "seconds":
            return self.budget_seconds is not None and self.now >= self.budget_seconds
        return sum(self.steps) * self.batch_size >= self.budget_samples

    # --- the communication threads --------------------------------------------------------------
    def _request(self, i: int) -> None:
        j = choose_partner(self.topology, i, self.partners[i], self.rng[i], self.initiated[i])
        if j is None:
            return
        self._locked[i] = True
        self.bytes_sent[i] += self.request_bytes
        self.bytes_received[i] += self.reply_bytes
        arrival = self.now + self.link.message_time(self.request_bytes)
        self._at(arrival, "request", j, i, self.initiated[i], self.live[i].clone())

    def _on_request(self, j: int, i: int, avg_id: int, x_i: torch.Tensor) -> None:
        if self._server_free[j] > self.now:  # still sending its previous reply: serve in arrival order
            self._at(self._server_free[j], "request", j, i, avg_id, x_i)
            return
        self.bytes_received[j] += self.request_bytes
        answer = self.live[j].clone()
        self.live[j].add_(x_i).mul_(0.5)
        self.version[j] += 1
        self.served[j] += 1
        self.log.append(("avg", self.now, i, avg_id, j))
        self.bytes_sent[j] += self.reply_bytes
        done = self.now + self.link.message_time(self.reply_bytes)
        self._server_free[j] = done
        self._at(done, "reply", i, answer)

    def _on_reply(self, i: int, x_j: torch.Tensor) -> None:
        self.live[i].add_(x_j).mul_(0.5)
        self.version[i] += 1
        self.initiated[i] += 1
        self._locked[i] = False
        waiting = self._waiting[i]
        if waiting is not None:
            self.wait_s[i] += self.now - waiting
            self._waiting[i] = None
            self._step(i)
        elif self._stopping[i]:
            self._finish(i)

    def _finish(self, i: int) -> None:
        if self.role[i] == "active":  # DONE to every partner, one message each
            for j in sorted(self.partners[i]):
                self.bytes_sent[i] += self.request_bytes
                self.bytes_received[j] += self.request_bytes
                arrival = self.now + self.link.message_time(self.request_bytes)
                self.finished_at[j] = max(self.finished_at[j], arrival)
        self.finished_at[i] = max(self.finished_at[i], self.now)

    # --- results ----------------------------------------------------------------------------------
    @property
    def end_time(self) -> float:
        return max(self.finished_at)

    def live_params(self) -> list[torch.Tensor]:
        """The live parameters as stacked tensors (n, *shape), in model.parameters() order."""
        out, offset = [], 0
        for p in self.model.parameters():
            out.append(self.live[:, offset : offset + p.numel()].reshape(self.n, *p.shape))
            offset += p.numel()
        return out


def compute_times(cfg: dict, n: int) -> ComputeTimes:
    """The compute model of a config: `backend.compute_*` keys (fleet.yaml), the straggler keys of
    `network` (slow_peers x compute_scale; compute_time, when set, as the mean)."""
    backend, network = cfg.get("backend") or {}, cfg.get("network") or {}
    slow = network.get("slow_peers") or ()
    slow = (slow,) if isinstance(slow, int) else slow
    scale = float(network.get("compute_scale") or 1.0)
    mean = float(network.get("compute_time") or backend.get("compute_mean_s") or 0.01)
    return ComputeTimes(
        n,
        mean,
        str(backend.get("compute_distribution") or "constant"),
        float(backend.get("compute_sigma") or 0.5),
        float(backend.get("compute_shape") or 2.5),
        {int(p): scale for p in slow},
        int(cfg["seed"]),
    )
