"""Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication"): DiLoCo
whose model is split into fragments that synchronize at staggered steps, each sync overlapped with
inner steps, so a peer's peak traffic is one fragment's instead of the whole model's.

The parameters (in order) form P fragments of consecutive tensors (blocks of layers, as in the paper),
cut so that the largest fragment holds as few entries as possible. With H the period (inner steps
between two syncs of one fragment), h = H / P and tau the delay (0 <= tau < h), after the inner step
t = 1, 2, ...:
- fragment p starts a sync when t = (p + 1) h - tau (mod H): it sends its outer gradient
  Delta_p = x_anchor,p - x_p(t), averaged over the peers (all-reduce; quantized and error-fed with
  `compression`), and keeps training;
- fragment p completes it tau steps later, t = (p + 1) h (mod H), with the mean Delta_p:
      u_p <- beta u_p + Delta_p;   x_anchor,p <- x_anchor,p - lr (Delta_p + beta u_p)   (DiLoCo's Nesterov)
      x_p <- alpha x_p(t) + (1 - alpha) x_anchor,p   (alpha: how much of the tau local steps it keeps)
So every h steps one fragment syncs; P = 1, tau = 0, alpha = 0 is DiLoCo with period H (torchft's
DiLoCo with fragment_sync_delay = tau and fragment_update_alpha = alpha follows the same schedule).
The anchor starts as the peers' mean model at the first step (their common start, without a message,
with broadcast_initial). The inner optimizer's state is kept.
"""

from __future__ import annotations

import numpy as np
import torch

from dpsgd.comm import Communicator
from dpsgd.comm import compression as compressions
from topologies import Topology

from .base import DistributedOptimizer


def balanced_blocks(sizes: list[int], parts: int) -> list[int]:
    """Each item's block when `sizes` is cut into `parts` non-empty runs of consecutive items with the
    largest run total as small as possible (ties: the earliest cuts). Dynamic programming over prefixes."""
    n = len(sizes)
    prefix = np.concatenate([[0], np.cumsum(sizes)])
    inf = float("inf")
    best = np.full((parts + 1, n + 1), inf)  # best[k][i]: the smallest largest total of k runs over items[:i]
    cut = np.zeros((parts + 1, n + 1), dtype=int)
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    blocks, i = [0] * n, n
    for k in range(parts, 0, -1):
        j = int(cut[k][i])
        blocks[j:i] = [k - 1] * (i - j)
        i = j
    return blocks


class StreamingDiLoCo(DistributedOptimizer):
    def __init__(
        self,
        base: torch.optim.Optimizer,
        *,
        topology: Topology | None = None,
        comm: Communicator,
        broadcast_initial: bool = True,
        period: int = 12,
        fragments: int = 3,
        delay: int = 1,
        alpha: float = 0.5,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        compression: str | dict | None = None,
    ):
        super().__init__(base, topology=topology, comm=comm, broadcast_initial=broadcast_initial)
        for name, value, low in (("period", period, 1), ("fragments", fragments, 1), ("delay", delay, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"StreamingDiLoCo {name} must be an integer >= {low}, got {value!r}")
        n_tensors = len(self.params())
        if fragments > n_tensors:
            raise ValueError(
                f"StreamingDiLoCo fragments={fragments} but the model has {n_tensors} parameter tensors; "
                f"use at most {n_tensors}"
            )
        if period % fragments:
            raise ValueError(
                f"StreamingDiLoCo period {period} must be a multiple of fragments {fragments} (one fragment "
                f"syncs every period / fragments steps)"
            )
        if delay >= period // fragments:
            raise ValueError(
                f"StreamingDiLoCo delay {delay} must be < period / fragments = {period // fragments}: a "
                "fragment's sync must complete before the next one starts"
            )
        if not 0 <= alpha <= 1:
            raise ValueError(f"StreamingDiLoCo alpha (the share of local progress kept) must be in [0, 1], got {alpha}")
        if not outer_lr > 0 or not 0 <= outer_momentum < 1:
            raise ValueError(
                f"StreamingDiLoCo needs outer_lr > 0 and outer_momentum in [0, 1), got {outer_lr}, {outer_momentum}"
            )
        self.period, self.n_fragments, self.delay = period, fragments, delay
        self.alpha, self.outer_lr, self.outer_momentum = float(alpha), float(outer_lr), float(outer_momentum)
        self.messages = compressions.quantized(comm, compression, "StreamingDiLoCo")
        self.fragment_of = balanced_blocks([p.numel() for p in self.params()], fragments)  # tensor -> fragment
        self._same_start = broadcast_initial
        self._anchor: list[torch.Tensor] | None = None
        self._outer_buffer: list[torch.Tensor] | None = None
        self._in_flight: dict[int, object] = {}  # fragment -> started all-reduce (or its arrived mean)

    def fragment(self, p: int) -> list[int]:
        """The indices (in self.params()) of fragment p's tensors."""
        return [i for i, f in enumerate(self.fragment_of) if f == p]

    def starting(self, t: int) -> int | None:
        """The fragment whose sync starts after inner step t, if any."""
        h = self.period // self.n_fragments
        for p in range(self.n_fragments):
            if (t - ((p + 1) * h - self.delay)) % self.period == 0:
                return p
        return None

    def completing(self, t: int) -> int | None:
        """The fragment whose sync completes after inner step t, if any (none before its first start)."""
        p = self.starting(t - self.delay) if t - self.delay >= 1 else None
        return p

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._closure_loss(closure)
        params = self.params()
        if self._anchor is None:  # the peers' mean model: their common start with broadcast_initial
            self._anchor = [a.clone() for a in (params if self._same_start else self.comm.allreduce_mean(params))]
            self._outer_buffer = [torch.zeros_like(a) for a in self._anchor]
        self.base.step()
        t = self.step_count + 1
        started = self.starting(t)
        if started is not None:
            idx = self.fragment(started)
            deltas = [self._anchor[i] - params[i] for i in idx]
            self._in_flight[started] = self.messages.start_allreduce_mean(deltas, f"fragment{started}")
        done = self.completing(t)
        if done is not None:
            self._outer_step(done, self._arrived(done))
        self.step_count = t
        return loss

    def _arrived(self, p: int) -> list[torch.Tensor]:
        pending = self._in_flight.pop(p)
        return pending if isinstance(pending, list) else pending.wait()  # type: ignore[attr-defined]

    def _outer_step(self, p: int, mean_delta: list[torch.Tensor]) -> None:
        assert self._anchor is not None and self._outer_buffer is not None  # taken at the first step
        params, beta = self.params(), self.outer_momentum
        for i, delta in zip(self.fragment(p), mean_delta):
            anchor, u = self._anchor[i], self._outer_buffer[i]
            u.mul_(beta).add_(delta)
            anchor.sub_(delta + beta * u, alpha=self.outer_lr)
            params[i].mul_(self.alpha).add_(anchor, alpha=1 - self.alpha)

    # --- state ----------------------------------------------------------------------------
    def algorithm_state(self):
        # a checkpoint waits for the syncs in flight (every peer checkpoints at the same step) and keeps
        # their means, applied at their scheduled steps after a resume
        self._in_flight = {p: self._arrived(p) for p in list(self._in_flight)}

        def copy(tensors):
            return None if tensors is None else [t.clone() for t in tensors]

        return {
            **super().algorithm_state(),
            "anchor": copy(self._anchor),
            "outer_buffer": copy(self._outer_buffer),
            "arrived": {p: copy(v) for p, v in self._in_flight.items()},
            "compression": self.messages.state(),
        }

    def load_algorithm_state(self, state) -> None:
        super().load_algorithm_state(state)
        self._anchor = self.own_tensors(state.get("anchor"))
        self._outer_buffer = self.own_tensors(state.get("outer_buffer"))
        self._in_flight = {int(p): [t.clone() for t in v] for p, v in (state.get("arrived") or {}).items()}
        self.messages.load_state(state.get("compression"))

    def __repr__(self) -> str:
        return (
            f"StreamingDiLoCo({self.base!r}, period={self.period}, fragments={self.n_fragments}, "
            f"delay={self.delay}, alpha={self.alpha}, outer_lr={self.outer_lr}, "
            f"outer_momentum={self.outer_momentum}, {self.messages!r})"
        )
