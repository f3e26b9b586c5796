"""Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication"): see
`StreamingDiLoCo`."""

from __future__ import annotations

import numpy as np
import torch

from .base import DistributedOptimizer
from .outer import DILOCO, OuterOptimizer, factory, saved_outer


class StreamingDiLoCo(DistributedOptimizer):
    """Streaming DiLoCo (Douillard et al. 2025): DiLoCo whose model syncs in fragments, staggered and overlapped.

    The parameters, flattened in layer order, form P = `fragments` consecutive ranges of equal size
    (numpy.array_split: the first d mod P one entry longer), so a fragment is a block of layers, as in the
    paper, that may begin or end inside a tensor. With H = `period`, h = H / P and tau = `delay`
    (0 <= tau < h), after inner step t = 1, 2, ... fragment p:

    - starts a sync when t = (p + 1) h - tau (mod H): the mean over peers of its outer gradient
      Delta_p = x_anchor,p - x_p, while training goes on (on a compressing communicator encoded and
      error-fed, one stream per fragment);
    - completes it tau steps later: the outer optimizer `outer` (any torch optimizer; by default DiLoCo's
      Nesterov SGD, lr 0.7, momentum beta 0.9) steps the anchor's fragment along the mean Delta_p, for
      Nesterov SGD u_p <- beta u_p + Delta_p, x_anchor,p <- x_anchor,p - lr (Delta_p + beta u_p); then
      x_p <- alpha x_p + (1 - alpha) x_anchor,p (alpha = `alpha`: the share of the tau local steps kept).

    One fragment syncs every h steps, so a peer's peak traffic is 1/P of the model. P = 1, tau = 0,
    alpha = 0 is `DiLoCo` with period H (torchft's DiLoCo with fragment_sync_delay = tau and
    fragment_update_alpha = alpha follows the same schedule). The anchor starts as the peers' mean model at
    the first step (their common start, without a message, with broadcast_initial); the inner optimizer's
    state is kept. The topology is accepted and ignored (averaging is exact).
    """

    uses_topology = False  # fragments are averaged exactly (all-reduce)
    label = "Streaming DiLoCo"
    knobs = {}
    cost_form = None  # one fragment's all-reduce every period / fragments steps, overlapped: not the periodic form

    def __init__(
        self,
        base: torch.optim.Optimizer,
        *,
        period: int = 12,
        fragments: int = 3,
        delay: int = 1,
        alpha: float = 0.5,
        outer=DILOCO,
        **common,
    ):
        super().__init__(base, **common)
        for name, value, low in (("period", period, 1), ("fragments", fragments, 1), ("delay", delay, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"StreamingDiLoCo {name} must be an integer >= {low}, got {value!r}")
        flat = self.comm.flatten(self.params())
        numel = flat.shape[-1]  # one peer's (a fleet's tensors lead with a peer axis)
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
        make = factory(outer, "StreamingDiLoCo")
        if make is None:
            raise ValueError("StreamingDiLoCo needs an outer optimizer (its default is DiLoCo's); got outer=None")
        self.period, self.n_fragments, self.delay, self.alpha = period, fragments, delay, float(alpha)
        cuts = np.cumsum([0] + [len(part) for part in np.array_split(np.arange(numel), fragments)])
        self.ranges = [(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:])]  # fragment -> [start, end) entries
        # the anchor, one tensor per fragment of the parameters flattened in order, and the optimizer moving it; the
        # anchor is the peers' mean model at the first step
        anchors = [flat[..., self.fragment(p)].clone() for p in range(fragments)]
        self._outer = OuterOptimizer(make, [anchors], "StreamingDiLoCo")
        self.outer_optimizer = self._outer.optimizer
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
        return self.starting(t - self.delay) if t - self.delay >= 1 else None

    def update(self) -> None:
        params = self.params()
        if not self._outer.anchored:  # the peers' mean model: their common start with broadcast_initial
            start = self.comm.flatten(params if self.broadcast_initial else self.comm.exact.allreduce_mean(params))
            self._outer.set_anchors(start[..., self.fragment(p)] for p in range(self.n_fragments))
        self.base.step()
        t = self.step_count + 1
        started = self.starting(t)
        if started is not None:
            part = self.fragment(started)
            delta = self._outer.anchors[started] - self.comm.flatten(params)[..., part]
            self._in_flight[started] = self.comm.start_allreduce_mean([delta], stream=f"fragment{started}")
        done = self.completing(t)
        if done is not None:
            self._outer_step(done, self._arrived(done)[0])
        self.step_count = t

    def _arrived(self, p: int) -> list[torch.Tensor]:
        pending = self._in_flight.pop(p)
        return pending if isinstance(pending, list) else pending.wait()  # type: ignore[attr-defined]

    def _outer_step(self, p: int, mean_delta: torch.Tensor) -> None:
        self._outer.step([mean_delta if q == p else None for q in range(self.n_fragments)])
        params = self.params()
        x = self.comm.flatten(params)
        x[..., self.fragment(p)].mul_(self.alpha).add_(self._outer.anchors[p], alpha=1 - self.alpha)
        for param, value in zip(params, self.comm.unflatten(x, params)):
            param.copy_(value)

    def buffers_due(self, step: int) -> bool:
        """buffers="average": once per period, when the last fragment has started its sync."""
        return step % self.period == 0

    def param_group_added(self, params: list[torch.Tensor]) -> None:
        raise ValueError(
            f"{type(self).__name__} cannot take a new parameter group "
            f"(its fragments are ranges of the parameters flattened at construction): give every group to the base "
            "optimizer before building it (with lr=0 to hold one back)"
        )

    # --- state ----------------------------------------------------------------------------
    def algorithm_state(self):
        # a checkpoint waits for the syncs in flight (every peer checkpoints at the same step) and keeps
        # their means, applied at their scheduled steps after a resume
        self._in_flight = {p: self._arrived(p) for p in list(self._in_flight)}
        return {
            **super().algorithm_state(),
            "outer": self._outer.state_dict(),
            "arrived": {p: [t.clone() for t in v] for p, v in self._in_flight.items()},  # type: ignore[attr-defined]
        }

    def load_algorithm_state(self, state) -> None:
        super().load_algorithm_state(state)
        p = self.params()[0]
        self._outer.load_state_dict(saved_outer(state, "StreamingDiLoCo"))
        arrived = (state.get("arrived") or {}).items()
        self._in_flight = {int(k): [t.detach().to(p.device, p.dtype).clone() for t in v] for k, v in arrived}

    def __repr__(self) -> str:
        outer = repr(self.outer_optimizer).replace("\n", " ")
        return (
            f"StreamingDiLoCo({self.base!r}, period={self.period}, fragments={self.n_fragments}, "
            f"delay={self.delay}, alpha={self.alpha}, outer={outer})"
        )
