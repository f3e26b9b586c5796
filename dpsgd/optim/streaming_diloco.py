"""Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication"): DiLoCo
whose model is split into fragments that synchronize at staggered steps, each sync overlapped with
inner steps, so a peer's peak traffic is one fragment's instead of the whole model's.

The parameters, flattened in order (layer by layer), form P fragments: consecutive ranges of entries
of equal size (numpy.array_split: the first d mod P one entry longer), so a fragment is a block of
layers, as in the paper, that may begin or end inside a tensor, and each sync carries 1/P of the
model. With H the period (inner steps between two syncs of one fragment), h = H / P and tau the delay
(0 <= tau < h), after the inner step t = 1, 2, ...:
- fragment p starts a sync when t = (p + 1) h - tau (mod H): it sends its outer gradient
  Delta_p = x_anchor,p - x_p(t), averaged over the peers (all-reduce; encoded and error-fed, one
  stream per fragment, on a compressing communicator), and keeps training;
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
from topologies import Topology

from .base import DistributedOptimizer


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
    ):
        super().__init__(base, topology=topology, comm=comm, broadcast_initial=broadcast_initial)
        for name, value, low in (("period", period, 1), ("fragments", fragments, 1), ("delay", delay, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"StreamingDiLoCo {name} must be an integer >= {low}, got {value!r}")
        numel = comm.flatten(self.params()).shape[-1]  # one peer's (a fleet's tensors lead with a peer axis)
        if fragments > numel:
            raise ValueError(f"StreamingDiLoCo fragments={fragments} but the model has {numel} parameters")
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
        cuts = np.cumsum([0] + [len(part) for part in np.array_split(np.arange(numel), fragments)])
        self.ranges = [(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:])]  # fragment -> [start, end) entries
        self._same_start = broadcast_initial
        self._anchor: torch.Tensor | None = None  # flat, like the parameters flattened in order
        self._outer_buffer: torch.Tensor | None = None
        self._in_flight: dict[int, object] = {}  # fragment -> started all-reduce (or its arrived mean)

    def fragment(self, p: int) -> slice:
        """Fragment p's entries of the flattened parameters."""
        return slice(*self.ranges[p])

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
            self._anchor = self.comm.flatten(params if self._same_start else self.comm.exact.allreduce_mean(params))
            self._outer_buffer = torch.zeros_like(self._anchor)
        self.base.step()
        t = self.step_count + 1
        started = self.starting(t)
        if started is not None:
            part = self.fragment(started)
            delta = self._anchor[..., part] - self.comm.flatten(params)[..., part]
            self._in_flight[started] = self.comm.start_allreduce_mean([delta], stream=f"fragment{started}")
        done = self.completing(t)
        if done is not None:
            self._outer_step(done, self._arrived(done)[0])
        self.step_count = t
        return loss

    def _arrived(self, p: int) -> list[torch.Tensor]:
        pending = self._in_flight.pop(p)
        return pending if isinstance(pending, list) else pending.wait()  # type: ignore[attr-defined]

    def _outer_step(self, p: int, mean_delta: torch.Tensor) -> None:
        assert self._anchor is not None and self._outer_buffer is not None  # taken at the first step
        part, beta = self.fragment(p), self.outer_momentum
        anchor, u = self._anchor[..., part], self._outer_buffer[..., part]  # views: updated in place
        u.mul_(beta).add_(mean_delta)
        anchor.sub_(mean_delta + beta * u, alpha=self.outer_lr)
        params = self.params()
        x = self.comm.flatten(params)
        x[..., part].mul_(self.alpha).add_(anchor, alpha=1 - self.alpha)
        for param, value in zip(params, self.comm.unflatten(x, params)):
            param.copy_(value)

    # --- state ----------------------------------------------------------------------------
    def algorithm_state(self):
        # a checkpoint waits for the syncs in flight (every peer checkpoints at the same step) and keeps
        # their means, applied at their scheduled steps after a resume
        self._in_flight = {p: self._arrived(p) for p in list(self._in_flight)}

        def copy(t):
            return None if t is None else t.clone()

        return {
            **super().algorithm_state(),
            "anchor": copy(self._anchor),
            "outer_buffer": copy(self._outer_buffer),
            "arrived": {p: [t.clone() for t in v] for p, v in self._in_flight.items()},  # type: ignore[attr-defined]
        }

    def load_algorithm_state(self, state) -> None:
        super().load_algorithm_state(state)
        p = self.params()[0]

        def own(t):
            return None if t is None else t.detach().clone().to(p.device, p.dtype)

        self._anchor, self._outer_buffer = own(state.get("anchor")), own(state.get("outer_buffer"))
        self._in_flight = {int(k): [own(t) for t in v] for k, v in (state.get("arrived") or {}).items()}

    def __repr__(self) -> str:
        return (
            f"StreamingDiLoCo({self.base!r}, period={self.period}, fragments={self.n_fragments}, "
            f"delay={self.delay}, alpha={self.alpha}, outer_lr={self.outer_lr}, "
            f"outer_momentum={self.outer_momentum})"
        )
