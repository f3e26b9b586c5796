"""Asynchronous algorithms as an event-driven simulation in virtual time: each simulated peer holds the
algorithm's own optimizer over a `SimulatedCommunicator` whose clock is the simulator's, so the rule is
written once, in the optimizer.

The peers' models and gradients live on the config's `device` (a GPU too); messages are staged in host memory.
How it works: docs/guide/internals.md#events.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from torch.func import functional_call, grad_and_value

from dpsgd import placement
from dpsgd.build import build_model, build_optimizer, build_topology, plan
from dpsgd.comm.base import MessagelessCommunicator
from dpsgd.comm.netem import NetworkEmulator
from dpsgd.config import Choice, NetworkConfig, RunConfig
from dpsgd.metrics import loss_function
from dpsgd.optim import AsynchronousOptimizer

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


class SimulatedCommunicator(MessagelessCommunicator):
    """Peer `rank` of a simulated world: its `clock` is the simulator's virtual time and `tally` every peer's
    samples (a samples budget is known at once); it has no messages of its own, the simulator carrying the
    exchanges in virtual time."""

    backend = "fleet"

    def __init__(self, rank: int, size: int, clock, tally: dict):
        super().__init__(rank=rank, size=size)
        self.clock, self.tally = clock, tally
        self.instead = "the simulator carries the exchanges it schedules (request, serve) in virtual time"

    def duplicate(self) -> SimulatedCommunicator:
        return SimulatedCommunicator(self.rank, self.size, self.clock, self.tally)


class Simulation:
    """An asynchronous algorithm on n simulated peers of the run `config` (the same data shares, batches, initial
    model, topology, optimizer and partner draws as the real run)."""

    def __init__(self, config: RunConfig, link=None, compute: ComputeTimes | None = None):
        n, bs = config.peers, config.batch_size
        self.n, self.batch_size = n, bs
        emulator = NetworkEmulator.from_config(config.network)
        self.link = link if link is not None else emulator.link
        self.hosts = emulator.hosts  # network.peers_per_host > 1: a message inside a host takes the intra-host link
        self.compute = compute if compute is not None else compute_times(config.backend, config.network, config.seed, n)
        self.plan = run = plan(config, n)
        self.batches = [run.batches(r) for r in range(n)]
        self.device = placement.single_device(config.device)  # the config's `device`: the peers' tensors, all on one
        self.model = build_model(config.model, run.split, config.seed, config.data.name).to(self.device)
        self.names = [name for name, _ in self.model.named_parameters()]
        self.topology = build_topology(config.topology, n)
        self.loss_fn = loss_function(run.split.y_train)
        self.now = 0.0
        tally: dict[int, int] = {}
        algorithm = config.algorithm
        alone = config.replace(  # no collective here
            algorithm=Choice(algorithm.name, algorithm.target, {**algorithm.options, "broadcast_initial": False})
        )
        self.params = [[p.detach().clone() for p in self.model.parameters()] for _ in range(n)]  # x_hat_i
        self.opts: list[AsynchronousOptimizer] = []
        for r in range(n):
            comm = SimulatedCommunicator(r, n, lambda: self.now, tally)
            built = build_optimizer(alone, self.params[r], self.topology, comm, model=self.model)
            if not isinstance(built, AsynchronousOptimizer) or not built.asynchronous:
                raise ValueError(f"the event simulator runs asynchronous algorithms; {type(built).__name__} is not one")
            self.opts.append(built)
        self.budget_samples = run.total_steps * bs * n
        for opt in self.opts:
            opt.set_budget(steps=run.total_steps, samples=self.budget_samples, samples_per_step=bs)
            opt.start(threads=False)
        self.bytes_sent = [0] * n
        self.bytes_received = [0] * n
        self.finished_at = [0.0] * n
        self.losses: list[list[float]] = [[] for _ in range(n)]
        self.log: list[tuple] = []
        self._waiting: list[float | None] = [None] * n  # (time computed) of a step waiting for the lock
        self._stopping = [False] * n
        self._server_free = [0.0] * n
        self._epoch = [0] * n  # bumped when a peer fails: its events scheduled before are lost
        self._tick_at: list[float | None] = [None] * n
        self._heap: list = []
        self._seq = itertools.count()
        self._grad = grad_and_value(self._loss)
        self._started = self._closed = False
        self._stepped: int | None = None

    # --- what the peers hold ------------------------------------------------------------------
    @property
    def live(self) -> torch.Tensor:
        """(n, D): every peer's x_i."""
        return torch.stack([opt.live for opt in self.opts])

    @property
    def steps(self) -> list[int]:
        return [opt.step_count for opt in self.opts]

    def live_params(self) -> list[torch.Tensor]:
        """The live parameters as stacked tensors (n, *shape), in model.parameters() order."""
        live, out, offset = self.live, [], 0
        for p in self.model.parameters():
            out.append(live[:, offset : offset + p.numel()].reshape(self.n, *p.shape))
            offset += p.numel()
        return out

    @property
    def end_time(self) -> float:
        return max(self.finished_at)

    # --- the event queue ------------------------------------------------------------------------
    def _at(self, t: float, kind: str, *args) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, args))

    def advance(self) -> int | None:
        """Simulate until some peer takes a step; return that peer (None once every peer has finished)."""
        if not self._started:
            self._started = True
            for r in range(self.n):
                self._at(self.compute.draw(r), "computed", r, 0)
            for peer, at, down in getattr(self.opts[0], "failures", ()):
                self._at(at, "fail", peer)
                self._at(at + down, "restart", peer)
        self._stepped = None
        while self._heap and self._stepped is None:
            t, _, kind, args = heapq.heappop(self._heap)
            self.now = t
            getattr(self, "_on_" + kind)(*args)
        if not self._heap and not self._closed:  # every peer's part ends, at its own time
            self._closed = True
            for opt, t in zip(self.opts, self.finished_at):
                self.now = t
                opt.finish()
            self.now = self.end_time
            if getattr(self.opts[0], "final_broadcast", False):  # every peer takes rank 0's final model
                root: Any = self.opts[0]
                root.conclude()
                for opt in self.opts[1:]:
                    cast(Any, opt).adopt_final(root.live)
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

    def _on_computed(self, i: int, epoch: int = 0) -> None:
        if epoch != self._epoch[i]:  # computed before the peer failed: lost with it
            return
        if self.opts[i].exchanges.lock.locked():  # the exchange in flight holds x_i: the step waits
            self._waiting[i] = self.now
            return
        self._step(i)

    def _step(self, i: int) -> None:
        opt, params = self.opts[i], self.params[i]
        x, y = (t.to(self.device) for t in self.batches[i].next())  # the data stays in host memory, as a peer's
        grads, loss = self._grad(tuple(params), x, y)
        for p, g in zip(params, grads):
            p.grad = g
        self.log.append(("step", self.now, i, opt.step_count, opt.staleness))
        opt.step()
        self.losses[i].append(float(loss))
        if opt.role == "active":
            self._request(i)
        self._go_on(i)
        self._stepped = i

    def _go_on(self, i: int) -> None:
        """After a step (or a restart): peer i finishes once its budget is spent, else computes its next step."""
        opt = self.opts[i]
        if opt.should_stop():
            self._stopping[i] = True
            if not opt.exchanges.lock.locked():
                self._finish(i)
        else:
            self._at(self.now + self.compute.draw(i), "computed", i, self._epoch[i])

    # --- the communication threads --------------------------------------------------------------
    def _message_time(self, i: int, j: int, nbytes: int) -> float:
        if i == j:  # a peer's message to itself stays in memory
            return 0.0
        if self.hosts.peers_per_host > 1 and self.hosts.host(i) == self.hosts.host(j):
            return self.hosts.intra.message_time(nbytes)
        return self.link.message_time(nbytes)

    def _request(self, i: int) -> None:
        begun = self.opts[i].exchanges.request()
        if begun is None:
            return
        j, message = begun
        nbytes = message.numel() * message.element_size()
        if i != j:
            self.bytes_sent[i] += nbytes
        self._at(self.now + self._message_time(i, j, nbytes), "request", j, i, message, self._epoch[i])

    def _on_request(self, j: int, i: int, message: torch.Tensor, epoch: int = 0) -> None:
        if self._server_free[j] > self.now:  # still sending its previous reply: serve in arrival order
            self._at(self._server_free[j], "request", j, i, message, epoch)
            return
        if i != j:
            self.bytes_received[j] += message.numel() * message.element_size()
        exchanges = self.opts[j].exchanges
        reply = exchanges.serve(message)
        self._schedule_tick(j, exchanges.tick())
        self._upstream(j)
        if reply is None:  # a closing message: nothing to answer
            return
        self.log.append(("avg", self.now, i, int(message[2].item()), j))
        nbytes = reply.numel() * reply.element_size()
        if i != j:
            self.bytes_sent[j] += nbytes
        self._server_free[j] = done = self.now + self._message_time(i, j, nbytes)
        self._at(done, "reply", i, j, reply, epoch)

    # --- a server's exchange with a server above it (hierarchical algorithms: `upstream`) ----------
    def _upstream(self, j: int) -> None:
        """Peer j's exchanges may owe a message to a server above it (`upstream()`: (k, message) or None): it travels
        over the link, k serves it in arrival order and the answer comes back to j's `complete_upstream`."""
        ask = getattr(self.opts[j].exchanges, "upstream", None)
        begun = ask() if ask is not None else None
        if begun is None:
            return
        k, message = begun
        nbytes = message.numel() * message.element_size()
        if j != k:
            self.bytes_sent[j] += nbytes
        self._at(self.now + self._message_time(j, k, nbytes), "upstream", k, j, message)

    def _on_upstream(self, k: int, j: int, message: torch.Tensor) -> None:
        if self._server_free[k] > self.now:  # still sending a previous reply: serve in arrival order
            self._at(self._server_free[k], "upstream", k, j, message)
            return
        if j != k:
            self.bytes_received[k] += message.numel() * message.element_size()
        reply = self.opts[k].exchanges.serve(message)
        if reply is None:
            raise RuntimeError(f"peer {k} did not answer peer {j}'s upstream message")
        nbytes = reply.numel() * reply.element_size()
        if j != k:
            self.bytes_sent[k] += nbytes
        self._server_free[k] = done = self.now + self._message_time(j, k, nbytes)
        self.finished_at[j] = max(self.finished_at[j], done)
        self._at(done, "upstream_reply", j, k, reply)

    def _on_upstream_reply(self, j: int, k: int, reply: torch.Tensor) -> None:
        if j != k:
            self.bytes_received[j] += reply.numel() * reply.element_size()
        cast(Any, self.opts[j].exchanges).complete_upstream(k, reply)
        self._upstream(j)  # the next push may be due already (or the last, once the group is done)

    def _schedule_tick(self, j: int, due: float | None) -> None:
        """Peer j's exchanges want to act on their own at virtual time `due` (a quorum's grace window)."""
        if due is not None and due > self.now and self._tick_at[j] != due:
            self._tick_at[j] = due
            self._at(due, "tick", j)

    def _on_tick(self, j: int) -> None:
        if self._tick_at[j] == self.now:
            self._tick_at[j] = None
            self._schedule_tick(j, self.opts[j].exchanges.tick())

    def _on_reply(self, i: int, j: int, reply: torch.Tensor, epoch: int = 0) -> None:
        if epoch != self._epoch[i]:  # the peer failed since it asked: the answer is lost
            return
        opt = self.opts[i]
        if i != j:
            self.bytes_received[i] += reply.numel() * reply.element_size()
        opt.exchanges.complete(j, reply)
        waiting = self._waiting[i]
        if waiting is not None:
            opt.wait_s += self.now - waiting  # its main thread waited for the lock since then
            self._waiting[i] = None
            self._step(i)
        elif self._stopping[i]:
            self._finish(i)

    def _finish(self, i: int) -> None:
        exchanges = self.opts[i].exchanges
        if self.opts[i].role == "active":  # DONE to every partner, one message each
            nbytes = exchanges.message_numel * self.opts[i].live.element_size()
            closing = exchanges.closing()
            for j in sorted(exchanges.partners):
                self.bytes_sent[i] += nbytes
                arrival = self.now + self._message_time(i, j, nbytes)
                if closing is not None:  # the partner acts on it (the merger counts its workers done)
                    self._at(arrival, "request", j, i, closing, self._epoch[i])
                else:
                    self.bytes_received[j] += nbytes
                self.finished_at[j] = max(self.finished_at[j], arrival)
        self.finished_at[i] = max(self.finished_at[i], self.now)

    # --- failures: peers that stop and restart (the optimizer's `failures` schedule) ---------------
    def _on_fail(self, i: int) -> None:
        if self._stopping[i]:  # it had finished its part: nothing left to lose
            return
        self._epoch[i] += 1  # its scheduled step and any answer on the way are lost
        self._waiting[i] = None
        cast(Any, self.opts[i]).fail()
        self.log.append(("fail", self.now, i))

    def _on_restart(self, i: int) -> None:
        if self._stopping[i]:
            return
        cast(Any, self.opts[i]).restart()  # its first message pulls the current model
        self.log.append(("restart", self.now, i))
        self._request(i)
        self._go_on(i)


def compute_times(backend: Choice, network: NetworkConfig, seed: int, n: int) -> ComputeTimes:
    """The compute model of a run: its `backend.compute_*` keys (fleet.yaml), the straggler keys of `network`
    (slow_peers x compute_scale; compute_time, when set, as the mean)."""
    options = backend.options
    scale = float(network.compute_scale or 1.0)
    mean = float(network.compute_time or options.get("compute_mean_s") or 0.01)
    return ComputeTimes(
        n,
        mean,
        str(options.get("compute_distribution") or "constant"),
        float(options.get("compute_sigma") or 0.5),
        float(options.get("compute_shape") or 2.5),
        {int(p): scale for p in network.slow_peers},
        seed,
    )
