"""Local SGD / periodic model averaging, with warm-up, outer optimizers and hierarchical groups: one class,
`LocalSGD`, covers the family; `SlowMo`, `DiLoCo` and `BMUF` are the same class with their papers' defaults."""

from __future__ import annotations

import functools

import torch

from dpsgd.comm import Communicator
from dpsgd.comm.base import Handle

from .base import DistributedOptimizer
from .outer import DILOCO, OuterOptimizer, factory, saved_outer

INNER_STATES = ("keep", "reset", "average")
SLOWMO = functools.partial(torch.optim.SGD, lr=1.0, momentum=0.5)  # fairscale's slow lr and momentum


def _positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"LocalSGD {name} must be an integer >= {minimum}, got {value!r}")
    return value


class LocalSGD(DistributedOptimizer):
    """Local SGD / model averaging: base steps locally, and every H = `period` steps an exact average.

    Global step t = 1, 2, ... (`step()` calls); gamma the base lr of the parameter's group at the averaging.
    1. Warm-up, t <= `warmup_steps` (post-local SGD, Lin et al. 2020): g_i <- mean_j g_j, then the base step
       (exactly `AllReduce`).
    2. Local phase, s = t - warmup_steps >= 1: x_i <- base(x_i, g_i); if s % H == 0, a global averaging
       x_avg = mean_j x_j. With no outer optimizer (`outer=None`), x_i <- x_avg; with one (any torch
       optimizer over the anchor x_a, the model at the last global averaging, the same on every peer), it
       steps with the outer gradient G = x_a - x_avg as the anchor's gradient and x_i <- x_a. SlowMo (Wang
       et al. 2020): SGD(lr=alpha, momentum=beta) with `scale_by_base_lr`, u <- beta u + G / gamma,
       x_a <- x_a - alpha gamma u (at a constant gamma, BMUF's block momentum, Chen & Huo 2016; beta = 0,
       alpha = 1 is plain averaging). DiLoCo (Douillard et al. 2023): Nesterov SGD, u <- beta u + G,
       x_a <- x_a - alpha (G + beta u). The anchor starts as the peers' mean model when the local phase
       starts (one all-reduce; none with broadcast_initial, where every peer holds the same model).
    3. Hierarchical (`group_size` g, `global_period` P): groups of g consecutive ranks; if s % P == 0 a
       global averaging as above, else if s % H == 0 the group averages plainly (point-to-point messages).
       The outer optimizer acts only at global averagings.

    `inner_state`, the base optimizer's state (momentum, Adam moments) at every averaging: "keep" (each
    peer its own, as torch's PostLocalSGDOptimizer; the peers drift apart again at once), "reset" (cleared:
    momentum restarts, Adam's bias correction makes the first steps full-size), "average" (averaged with
    the models in one all-reduce, all but Adam's step count, as one optimizer would hold; two or three times
    the bytes of an averaging). The topology is accepted and ignored.

    With a compressing communicator (`compression=`, dpsgd.comm.codecs) global averagings send the outer
    deltas x_a - x_i as encoded, error-fed messages, and x_avg = x_a - mean_i delta_i; group averagings, the
    first anchor and averaged inner states stay exact (`comm.exact`: error feedback could turn Adam's second
    moments negative). Unlike torch's PeriodicModelAverager, which averages right after the first local
    step (t - 1 - warmup_steps a multiple of H), this averages after H local steps, as the papers do: with
    plain SGD torch's warm-up W is this one's W + 1. torch's HierarchicalModelAverager tests the absolute step
    (t % period), this the local steps since the warm-up (s % period): the two schedules agree only when the
    warm-up is a multiple of the global period (tests/test_reference_code.py shows both).

    Delayed and eager outer steps (Kale et al. 2025, "Eager updates for overlapped communication and computation
    in DiLoCo"), with an outer optimizer and global averagings only, t the outer step and Delta_i^t = x_a,i - x_i
    peer i's outer gradient from its own copy of the anchor. `outer_delay=1`: the all-reduce of Delta_i^t is
    started and not waited for; it runs behind the next H inner steps (counted as overlapped: comm.stats.overlap_s,
    and the emulated network's clock) and lands at outer step t + 1, so the outer optimizer steps with the mean of
    the previous round, G_i^t = mean_j Delta_j^{t-1} (0 at t = 1), then x_i <- x_a,i. `eager=True` (with
    outer_delay=1): the peer's own fresh outer gradient stands in for its share at once, G_i^t = Delta_i^t / n +
    sum_{j != i} Delta_j^{t-1} / n = mean_j Delta_j^{t-1} + (Delta_i^t - Delta_i^{t-1}) / n, the others' share of
    round t arriving a round late; the anchors (and outer momenta) then differ by peer. A checkpoint
    (state_dict()) waits for the exchange in flight and keeps its mean: code that reuses the communicator after
    the last step calls it first.

    outer: None (plain model averaging), a factory params -> torch.optim.Optimizer such as
    functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True) (in a config, a `_target_` dict);
    scale_by_base_lr: SlowMo's scaling of its gradient and lr by the base lr.
    `outer_optimizer` is the torch optimizer that moves the anchor (None without one)."""

    elastic = True  # the anchor and outer state are the same on every peer: an added peer takes rank 0's
    uses_topology = False  # averaging is exact (all-reduce)
    label = "local SGD"
    knobs = {"period": (2, 4, 8, 16)}
    cost_form = "periodic"

    def __init__(
        self,
        base: torch.optim.Optimizer,
        *,
        period: int = 4,
        warmup_steps: int = 0,
        outer=None,
        scale_by_base_lr: bool = False,
        inner_state: str = "keep",
        group_size: int | None = None,
        global_period: int | None = None,
        outer_delay: int = 0,
        eager: bool = False,
        **common,
    ):
        super().__init__(base, **common)
        name, comm = type(self).__name__, self.comm
        self.period = _positive_int("period", period)
        if outer_delay not in (0, 1) or isinstance(outer_delay, bool):
            raise ValueError(
                f"{name} outer_delay must be 0 (the outer step waits) or 1 (one round late), got {outer_delay!r}"
            )
        if eager and not outer_delay:
            raise ValueError(f"{name} eager stands in for a delayed exchange: set outer_delay=1 with eager=true")
        if outer_delay and (outer is None or group_size is not None or inner_state == "average"):
            raise ValueError(
                f"{name} outer_delay=1 delays the outer optimizer's all-reduce: it needs an outer optimizer (plain "
                "averaging: outer={_target_: torch.optim.SGD, lr: 1.0}), no group_size and inner_state keep or reset; "
                f"got outer={outer!r}, group_size={group_size}, inner_state={inner_state!r}"
            )
        self.outer_delay, self.eager = int(outer_delay), bool(eager)
        self._in_flight: Handle | list[torch.Tensor] | None = None  # round t-1's mean outer gradient, travelling
        self._own_last: list[torch.Tensor] | None = None  # eager: Delta_i^{t-1}, already applied by its 1/n share
        self.warmup_steps = _positive_int("warmup_steps", warmup_steps, minimum=0)
        if inner_state not in INNER_STATES:
            raise ValueError(f"LocalSGD inner_state must be one of {INNER_STATES}, got {inner_state!r}")
        self._make = factory(outer, name)
        if scale_by_base_lr and self._make is None:
            raise ValueError(f"{name} scale_by_base_lr scales an outer optimizer, and outer is None; give outer=...")
        if (group_size is None) != (global_period is None):
            raise ValueError(
                "LocalSGD hierarchical averaging needs both group_size and global_period "
                f"(got group_size={group_size}, global_period={global_period}); set both or neither"
            )
        if group_size is not None:
            _positive_int("group_size", group_size)
            global_period = _positive_int("global_period", global_period)
            if comm.size % group_size:
                raise ValueError(f"LocalSGD group_size {group_size} does not divide the {comm.size} peers")
            if global_period % self.period:
                raise ValueError(f"LocalSGD global_period {global_period} must be a multiple of period {self.period}")
        self.scale_by_base_lr = bool(scale_by_base_lr)
        self.inner_state, self.group_size, self.global_period = inner_state, group_size, global_period
        # the model at the last global averaging (and the outer optimizer moving it), kept when needed; the anchor
        # is taken when the local phase begins
        needed = self._make is not None or comm.exact is not comm
        self._outer = self._new_outer() if needed else None

    def _new_outer(self) -> OuterOptimizer:
        return OuterOptimizer.over(self._make, self.param_groups, type(self).__name__)

    @property
    def outer_optimizer(self) -> torch.optim.Optimizer | None:
        return None if self._outer is None else self._outer.optimizer

    # --- the step -------------------------------------------------------------------------
    def update(self) -> None:
        t = self.step_count + 1
        if t <= self.warmup_steps:
            grads = [p.grad for p in self.params() if p.grad is not None]
            if grads:
                for g, avg in zip(grads, self.comm.allreduce_mean(grads, stream="gradients")):
                    g.copy_(avg)
            self.base.step()
        else:
            if self._outer is not None and not self._outer.anchored:
                self._take_anchor()
            self.base.step()
            s = t - self.warmup_steps
            if self.global_period is not None and s % self.global_period == 0:
                self._average(group=False)
            elif s % self.period == 0:
                self._average(group=self.global_period is not None)
        self.step_count = t

    def _take_anchor(self) -> None:
        """The peers' mean model, the first anchor: without a message when they started from rank 0's
        parameters (broadcast_initial), since exact averaging and all-reduce warm-up keep them equal."""
        assert self._outer is not None  # kept whenever an anchor is
        params = self.params()
        if len(self._outer.anchors) != len(params):  # a parameter group was added since the construction
            self._outer = self._new_outer()
        self._outer.set_anchors(params if self.broadcast_initial else self.comm.exact.allreduce_mean(params))

    def _state_tensors(self) -> list[torch.Tensor]:
        """The base state averaged by inner_state='average', in parameter order (same on every peer)."""
        out = []
        for p in self.params():
            state = self.base.state.get(p, {})
            out += [
                v
                for k, v in sorted(state.items())
                if k != "step" and torch.is_tensor(v) and v.is_floating_point() and v.shape == p.shape
            ]
        return out

    def _average(self, group: bool) -> None:
        if self.outer_delay and not group:
            return self._delayed_outer_step()
        params = self.params()
        state = self._state_tensors() if self.inner_state == "average" else []
        tensors = params + state
        if not group and self.comm.exact is not self.comm:
            assert self._outer is not None  # the anchor is kept whenever deltas are compressed
            anchors = self._outer.anchors
            deltas = [a - p for a, p in zip(anchors, params)]
            mean_delta = self.comm.allreduce_mean(deltas, stream="outer")
            averaged = [a - m for a, m in zip(anchors, mean_delta)]
            averaged += self.comm.exact.allreduce_mean(state) if state else []
        elif not group:
            averaged = self.comm.allreduce_mean(tensors)
        else:
            assert self.group_size is not None  # group averaging is hierarchical averaging
            averaged = self.comm.exact.group_mean(tensors, self.group_size)
        for s, a in zip(state, averaged[len(params) :]):
            s.copy_(a)
        x_avg = averaged[: len(params)]
        if not group and self._outer is not None and self._outer.optimizer is not None:
            self._outer_step(x_avg)
        else:
            for p, a in zip(params, x_avg):
                p.copy_(a)
            if not group and self._outer is not None:
                self._outer.set_anchors(x_avg)
        if self.inner_state == "reset":
            self.base.state.clear()

    def _outer_step(self, x_avg: list[torch.Tensor]) -> None:
        assert self._outer is not None  # an outer optimizer steps
        self._outer_step_along([anchor - x for anchor, x in zip(self._outer.anchors, x_avg)])

    def _outer_step_along(self, grads: list[torch.Tensor]) -> None:
        """The outer optimizer's step with `grads` as the anchor's gradient, then every parameter at its anchor."""
        assert self._outer is not None  # an outer optimizer steps
        anchors = self._outer.anchors
        base_lrs = None
        if self.scale_by_base_lr:
            base_lrs = [float(group["lr"]) for group in self.param_groups]
            if not all(gamma > 0 for gamma in base_lrs):
                raise ValueError(f"{type(self).__name__} scale_by_base_lr divides by the base lr, which is {base_lrs}")
        every: list[torch.Tensor | None] = list(grads)  # every anchor moves
        self._outer.step(every, base_lrs)
        for p, anchor in zip(self.params(), anchors):
            p.copy_(anchor)

    def _delayed_outer_step(self) -> None:
        """Outer step t with outer_delay=1: start round t's exchange, step with round t-1's (and, eager, this
        peer's own Delta_i^t at once)."""
        assert self._outer is not None  # outer_delay needs an outer optimizer
        anchors, params = self._outer.anchors, self.params()
        own = [a - p for a, p in zip(anchors, params)]  # Delta_i^t
        arrived = self._arrived()  # mean_j Delta_j^{t-1}; None at t = 1
        # waited before this round's starts: one outer exchange in flight per peer, in the same order everywhere
        self._in_flight = self.comm.start_allreduce_mean(own, stream="outer")
        grads = [torch.zeros_like(d) for d in own] if arrived is None else arrived
        if self.eager:
            n = self.comm.size
            last = self._own_last or [torch.zeros_like(d) for d in own]
            grads = [g + (d - d_last) / n for g, d, d_last in zip(grads, own, last)]
            self._own_last = own
        self._outer_step_along(grads)

    def _arrived(self) -> list[torch.Tensor] | None:
        pending, self._in_flight = self._in_flight, None
        return pending.wait() if isinstance(pending, Handle) else pending

    def buffers_due(self, step: int) -> bool:
        """buffers="average": every warm-up step, then at each global averaging."""
        s = step - self.warmup_steps
        return s <= 0 or s % (self.global_period or self.period) == 0

    # --- state ----------------------------------------------------------------------------
    def algorithm_state(self):
        state = {**super().algorithm_state(), "outer": None if self._outer is None else self._outer.state_dict()}
        if self.outer_delay:  # the exchange in flight, waited for (every peer checkpoints at the same step)
            self._in_flight = self._arrived()
            state["arrived"] = None if self._in_flight is None else [t.clone() for t in self._in_flight]
            state["own_last"] = None if self._own_last is None else [t.clone() for t in self._own_last]
        return state

    def load_algorithm_state(self, state) -> None:
        super().load_algorithm_state(state)
        saved = saved_outer(state, type(self).__name__)
        if saved is not None and self._outer is None:
            raise ValueError(f"this state_dict holds an outer anchor: build this {type(self).__name__} with an outer")
        if self._outer is not None:
            self._outer.load_state_dict(saved)
        if self.outer_delay:
            like = self.params()[0]
            copied = [
                None if v is None else [t.detach().to(like.device, like.dtype).clone() for t in v]
                for v in (state.get("arrived"), state.get("own_last"))
            ]
            self._in_flight, self._own_last = copied

    def __repr__(self) -> str:
        groups = f", group_size={self.group_size}, global_period={self.global_period}" if self.group_size else ""
        outer = repr(self.outer_optimizer).replace("\n", " ")
        return (
            f"{type(self).__name__}({self.base!r}, period={self.period}, warmup_steps={self.warmup_steps}, "
            f"outer={outer}, scale_by_base_lr={self.scale_by_base_lr}, inner_state={self.inner_state!r}{groups}"
            f"{f', outer_delay=1, eager={self.eager}' if self.outer_delay else ''})"
        )


class SlowMo(LocalSGD):
    """SlowMo (Wang et al. 2020) over local SGD: outer SGD with slow momentum beta = 0.5 and slow lr alpha = 1
    (fairscale's SlowMoDistributedDataParallel defaults), scaled by the base lr as in the paper.

    fairscale has two frequencies, a plain average of all peers every `localsgd_frequency` steps and the slow
    momentum step every `slowmo_frequency`: here `period` = localsgd_frequency with `group_size` = the number of
    peers, and `global_period` = slowmo_frequency. The default (neither set) takes the slow step at every
    averaging, every `period` steps, as the paper's algorithm."""

    label = "SlowMo"
    knobs = {"outer.lr": (0.5, 1.0, 1.5, 2.0)}
    cost_form = "periodic"

    __init__ = functools.partialmethod(LocalSGD.__init__, outer=SLOWMO, scale_by_base_lr=True)


class DiLoCo(LocalSGD):
    """DiLoCo (Douillard et al. 2023): outer SGD with Nesterov momentum 0.9 and lr 0.7 on the outer
    gradient x_anchor - x_avg, every 8 steps; the paper's inner optimizer is AdamW (pass it as `base`)."""

    label = "DiLoCo"
    knobs = {"outer.lr": (0.3, 0.5, 0.7, 1.0)}
    cost_form = "periodic"

    __init__ = functools.partialmethod(LocalSGD.__init__, period=8, outer=DILOCO)


class BMUF(LocalSGD):
    """Blockwise model-update filtering (Chen & Huo 2016): block momentum as outer SGD (lr = the block lr,
    1; momentum = the block momentum, by default the paper's 1 - 1/n for n peers; a config's
    `outer.momentum: null` means the same), scaled by the base lr, which at a constant base lr is BMUF's
    block momentum exactly (see `LocalSGD`; scale_by_base_lr=False gives it under any lr schedule)."""

    label = "BMUF"
    knobs = {"outer.lr": (0.5, 1.0, 1.5, 2.0)}
    cost_form = "periodic"

    def __init__(
        self,
        base: torch.optim.Optimizer,
        *,
        comm: Communicator,
        outer=None,
        scale_by_base_lr: bool = True,
        **options,  # LocalSGD's (period, warmup_steps, ...) and the common ones
    ):
        block_momentum = 1.0 - 1.0 / comm.size
        if outer is None:
            outer = functools.partial(torch.optim.SGD, lr=1.0, momentum=block_momentum)
        elif (
            isinstance(outer, functools.partial) and "momentum" in outer.keywords and outer.keywords["momentum"] is None
        ):
            outer = functools.partial(outer.func, *outer.args, **{**outer.keywords, "momentum": block_momentum})
        super().__init__(base, comm=comm, outer=outer, scale_by_base_lr=scale_by_base_lr, **options)
