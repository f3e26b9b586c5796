"""Robust aggregation (`robust=` in configs) and corrupt senders: `Robust`, a communicator wrapper that exchanges
every mix and mean of an algorithm as whole messages, sends corrupted ones from the peers that
`faults.corrupt_peer` names (dpsgd.comm.corrupt), and combines what each peer receives by a `Rule`:
- `none`: the plain weighted sum, self_weight x_i + sum_j W[i,j] x_j (a mean: the average of all peers);
- `clipped_gossip` (He, Karimireddy and Jaggi 2022, self-centered clipping):
  x_i <- self_weight x_i + sum_j W[i,j] (x_i + clip(x_j - x_i, tau_i)), clip(v, tau) = v min(1, tau / ||v||);
- `centered_clip` (Karimireddy, He and Jaggi 2021): starting at v = x_i, `iterations` times
  v <- v + (1/m) sum_k clip(x_k - v, tau) over the m values x_i and those received;
- `trimmed_mean`: per coordinate, the mean of the m values less the `byzantine` largest and smallest.
A radius `tau` of null is chosen each time by the rule of He et al.'s experiments: the distance of the
(b+1)-th farthest value received (b = `byzantine`), so that the b farthest are clipped to it (none received
beyond b: tau = 0, the peer keeps its own value). A message whose norm is not finite is clipped to nothing.
Every rule applies to mixes (gossip over W(k), a group's mean) and means; a robust mean gathers every peer's
vector (n - 1 messages of the whole vector each way, counted so), whereas `none` keeps the all-reduce. With
`none`, a non-finite message is noted as its sender's (`nonfinite_from`: dpsgd.divergence names it). On a fleet
(a leading peer axis) every peer's messages are made and combined as on a real peer, with the same bytes.
Point-to-point operations (AD-PSGD's) pass through unaltered. Messages must be exact: compression is refused.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from topologies import Neighbors, Topology

from .base import Communicator, Handle, Wrapped
from .codecs import Compressed
from .corrupt import Corruption

RULES = ("none", "clipped_gossip", "centered_clip", "trimmed_mean")


def clip(v: torch.Tensor, tau: float) -> torch.Tensor:
    """v scaled to norm at most tau; nothing (zeros) when its norm is not finite."""
    norm = float(torch.linalg.vector_norm(v))
    if not math.isfinite(norm):
        return torch.zeros_like(v)
    return v if norm <= tau else v * (tau / norm)


@dataclass(frozen=True)
class Rule:
    """How a peer combines its own value with those it received (see the module)."""

    name: str = "none"
    byzantine: int = 1  # values received that may be Byzantine: trimmed per side, or clipped by the adaptive radius
    tau: float | None = None  # clipping radius; null: adaptive
    iterations: int = 3  # centered_clip's

    def __post_init__(self):
        if self.name not in RULES:
            raise ValueError(f"unknown robust rule {self.name!r}; valid: {', '.join(RULES)}")
        if isinstance(self.byzantine, bool) or not isinstance(self.byzantine, int) or self.byzantine < 0:
            raise ValueError(f"robust.byzantine must be a whole number >= 0, got {self.byzantine!r}")
        if self.tau is not None and (
            isinstance(self.tau, bool) or not isinstance(self.tau, int | float) or self.tau < 0
        ):
            raise ValueError(f"robust.tau must be a radius >= 0, or null for the adaptive one, got {self.tau!r}")
        if isinstance(self.iterations, bool) or not isinstance(self.iterations, int) or self.iterations < 1:
            raise ValueError(f"robust.iterations must be a whole number >= 1, got {self.iterations!r}")

    def radius(self, center: torch.Tensor, others: Sequence[torch.Tensor]) -> float:
        if self.tau is not None:
            return float(self.tau)
        distances = sorted(
            (float(torch.linalg.vector_norm(r - center)) for r in others),
            key=lambda d: -d if d == d else -float("inf"),  # nan: the farthest
        )
        return distances[self.byzantine] if len(distances) > self.byzantine else 0.0

    def combine(
        self, own: torch.Tensor, others: Sequence[torch.Tensor], weights: Sequence[float], self_weight: float
    ) -> torch.Tensor:
        """This peer's result from its `own` flat value and the `others` received with their `weights`."""
        if self.name == "none":
            out = own * self_weight
            for r, w in zip(others, weights):
                out.add_(r, alpha=w)
            return out
        if self.name == "clipped_gossip":
            tau = self.radius(own, others)
            out = own * (self_weight + sum(weights))
            for r, w in zip(others, weights):
                out.add_(clip(r - own, tau), alpha=w)
            return out
        values = [own, *others]
        if self.name == "centered_clip":
            v = own.clone()
            for _ in range(self.iterations):
                tau = self.radius(v, others)
                v = v + sum(clip(x - v, tau) for x in values) / len(values)
            return v
        b, m = min(self.byzantine, (len(values) - 1) // 2), len(values)  # trimmed_mean: at least one value kept
        stacked = torch.stack(values)
        if b == 1 and bool(torch.isfinite(stacked).all()):  # the sum less the largest and smallest: 1/20 of a sort
            return (stacked.sum(0) - stacked.amax(0) - stacked.amin(0)) / (m - 2)
        return stacked.sort(0).values[b : m - b].mean(0)  # nan sorts last: trimmed as the largest


def make(spec: str | dict | Rule | None) -> Rule:
    """The rule a config's `robust` names: a name of RULES, or a dict with `name` and options."""
    if isinstance(spec, Rule):
        return spec
    options = {"name": spec} if spec is None or isinstance(spec, str) else dict(spec)
    options = {k: v for k, v in options.items() if v is not None or k == "tau"}
    options.setdefault("name", "none")
    unknown = sorted(set(options) - {f.name for f in fields(Rule)})
    if unknown:
        raise ValueError(f"robust takes name, byzantine, tau, iterations; got {', '.join(unknown)}")
    return Rule(**options)


def check_mixing(spec, topology: Topology | None) -> None:
    """Refuse an adaptive clipping radius that is 0 at every step of `topology`: a peer receiving no more than
    `byzantine` values a step would clip all of them to nothing and never mix (only train alone)."""
    rule = make(spec)
    if topology is None or rule.name not in ("clipped_gossip", "centered_clip") or rule.tau is not None:
        return
    # values a peer receives a step: W's nonzeros in its row, less its own (a random graph: its first draw)
    fewest = min(int(np.diff(topology.sparse_mixing_matrix(s).indptr).min()) - 1 for s in range(topology.period or 1))
    if fewest <= rule.byzantine:
        raise ValueError(
            f"robust={rule.name} with byzantine={rule.byzantine} on {topology.name}: some peer receives only "
            f"{fewest} value(s) a step, so the adaptive radius (the distance of the nearest value beyond the "
            f"{rule.byzantine} farthest) is 0 and that peer never mixes; use a topology with more than "
            f"{rule.byzantine} neighbour(s) a step (e.g. exponential), set robust.tau, or lower robust.byzantine"
        )


def wrap(comm: Communicator, spec, corruption: Corruption | None = None) -> Communicator:
    """`comm` wearing the config's robust rule and corrupt peers; `comm` itself when neither is set."""
    rule = make(spec)
    if rule.name == "none" and corruption is None:
        return comm
    if isinstance(comm, Compressed):
        raise ValueError(
            "robust aggregation and corrupt peers need exact messages (a rule compares whole values), but "
            f"compression={comm.codec!r} is set; use compression=none"
        )
    return Robust(comm, rule, corruption)


class Robust(Wrapped):
    """`comm` whose mixes and means go through `rule`, with corrupt peers' messages altered (see the module)."""

    def __init__(self, comm: Communicator, rule: Rule, corruption: Corruption | None = None):
        super().__init__(comm)
        self.rule, self.corruption = rule, corruption  # `calls`: the key of a corrupt peer's noise
        self.nonfinite_from: tuple[int, int] | None = None  # (sender, receiver) of the first non-finite message
        self._seen: dict[tuple[str, int], list[torch.Tensor]] = {}  # what each peer received last, per kind (alie)
        # a mean gathers every vector when a rule compares them, or when alie must see the honest ones
        self._gather = rule.name != "none" or (corruption is not None and corruption.mode == "alie")

    # --- what is sent, and what is noted of what arrives ------------------------------------------------
    def _message(self, x: torch.Tensor, sender: int, call: int, kind: str) -> torch.Tensor:
        c = self.corruption
        if c is None or sender not in c.peers:
            return x
        return c.alter(x, sender, call, self._seen.get((kind, sender), ()))

    def _received(self, receiver: int, senders: Sequence[int], values: Sequence[torch.Tensor], kind: str) -> None:
        c = self.corruption
        if c is not None and c.mode == "alie" and receiver in c.peers:
            self._seen[(kind, receiver)] = [v for s, v in zip(senders, values) if s not in c.peers]
        if self.rule.name == "none" and self.nonfinite_from is None:
            for s, v in zip(senders, values):
                if not bool(torch.isfinite(v).all()):
                    self.nonfinite_from = (s, receiver)
                    break

    # --- mixes ------------------------------------------------------------------------------------------
    def _start_weighted_mix(
        self, tensors: Sequence[torch.Tensor], weights: Callable[[int], Neighbors], kind: str = "mix"
    ) -> Handle:
        x, call = self.inner.flatten(tensors), self._call()
        if self.peer_shape:
            result = self._fleet_mix(x, tensors, weights, call, kind)  # every peer's, done now
            return self._done("neighbor_average", result)
        nb = weights(self.rank)
        recv_from = sorted(nb.recv)
        handle = self.inner.start_neighbor_exchange(self._message(x, self.rank, call, kind), sorted(nb.send), recv_from)

        def finish():
            received = handle.wait()
            self._received(self.rank, recv_from, received, kind)
            out = self.rule.combine(x, received, [nb.recv[p] for p in recv_from], nb.self_weight)
            return self.inner.unflatten(out, tensors)

        return self._done("neighbor_average", finish)

    def _fleet_mix(self, x, tensors, weights, call: int, kind: str) -> list[torch.Tensor]:
        started, n = time.perf_counter(), x.shape[0]
        sent = [self._message(x[i], i, call, kind) for i in range(n)]
        out = torch.empty_like(x)
        counts = torch.zeros(2, n, dtype=torch.float64)
        for i in range(n):
            nb = weights(i)
            recv_from = sorted(nb.recv)
            received = [sent[j] for j in recv_from]
            self._received(i, recv_from, received, kind)
            out[i] = self.rule.combine(x[i].clone(), received, [nb.recv[j] for j in recv_from], nb.self_weight)
            counts[0, i], counts[1, i] = len(nb.send), len(nb.recv)
        sent_bytes, received_bytes = counts * x[0].numel() * x.element_size()
        self._count_fleet(sent_bytes, received_bytes, started)
        return self.inner.unflatten(out, tensors)

    # --- means ------------------------------------------------------------------------------------------
    def start_allreduce_mean(self, tensors: Sequence[torch.Tensor], stream: str = "") -> Handle:
        n = self.size
        if n == 1:
            return self._done("allreduce_mean", lambda: list(tensors))
        if not self._gather:  # the all-reduce itself, with the corrupt peers' values altered
            x, call = self.inner.flatten(tensors), self._call()
            held = range(n) if self.peer_shape else [self.rank]
            sent = [self._message(x[a] if self.peer_shape else x, i, call, "mean") for a, i in enumerate(held)]
            flat = torch.stack(sent) if self.peer_shape else sent[0]
            return self.inner.start_allreduce_mean(self.inner.unflatten(flat, tensors), stream)

        def weights(i: int) -> Neighbors:  # every other peer, 1/n each: the mean as a mix over the complete graph
            others = {j: 1.0 / n for j in range(n) if j != i}
            return Neighbors(others, dict(others), 1.0 / n)

        return self._start_weighted_mix(tensors, weights, "mean")

    def __repr__(self) -> str:
        return f"Robust({self.inner!r}, {self.rule!r}, {self.corruption!r})"
