"""Local SGD / periodic model averaging, with warm-up, outer optimizers and hierarchical groups.

Every peer runs its base optimizer alone; every `period` steps the peers average their models
exactly (all-reduce), and an outer optimizer turns the averaged increment into the next model.
One class covers the family; `SlowMo`, `DiLoCo` and `BMUF` are the same class with their papers'
defaults.

Peer i, global step t = 1, 2, ... (t counts `step()` calls), base(x, g) the wrapped optimizer's
new point, gamma the base learning rate (of the parameter's group, read at the averaging step),
x_anchor the model at the last global averaging (all peers hold the same anchor):

1. Warm-up, t <= warmup_steps (post-local SGD, Lin et al. 2020): g_i <- mean_j g_j, then the base
   step: exactly `AllReduce`.
2. Local phase, s = t - warmup_steps >= 1: x_i <- base(x_i, g_i); then
   - if s % period == 0 (and no groups), a global averaging: x_avg = mean_j x_j and
       outer="average"  (plain model averaging):        x_i <- x_avg
       outer="momentum" (SlowMo, Wang et al. 2020, Alg. 1, slow momentum beta, slow lr alpha):
                        u <- beta u + (x_anchor - x_avg) / gamma
                        x_i <- x_anchor <- x_anchor - alpha gamma u
         With a constant gamma this is BMUF's block momentum (Chen & Huo 2016) with block lr
         alpha: v <- beta v + alpha (x_avg - x_anchor), x <- x_anchor + v (v = -alpha gamma u).
         beta = 0, alpha = 1 is plain averaging.
       outer="nesterov" (DiLoCo, Douillard et al. 2023: outer SGD with Nesterov momentum on the
                        outer gradient, as torch.optim.SGD(nesterov=True) computes it):
                        G = x_anchor - x_avg
                        u <- beta u + G
                        x_i <- x_anchor <- x_anchor - alpha (G + beta u)
     u starts at 0; the anchor starts as the mean of the peers' models when the local phase starts
     (one all-reduce of the model, so peers that start apart still share one anchor; none with
     broadcast_initial, where every peer holds the same model then).
   - Hierarchical (group_size g, global_period P): peers form groups of g consecutive ranks
     {0..g-1}, {g..2g-1}, ...; if s % P == 0 a global averaging as above, else if s % period == 0
     the group averages plainly, x_i <- (1/g) sum_{j in group(i)} x_j (point-to-point messages to
     the g-1 other members). The outer optimizer acts only at global averagings, where the anchor
     is common to all peers.

inner_state, what happens to the base optimizer's state (momentum buffer, Adam moments) at every
averaging, group or global:
   "keep"    each peer keeps its own buffers (torch's PostLocalSGDOptimizer does this). Cheapest;
             each peer's momentum still carries its own recent gradients, so the peers start
             drifting apart again from the first step after an averaging.
   "reset"   the state is cleared (base.state.clear()): SGD momentum restarts from the next
             gradient and Adam restarts its step count, so its bias correction makes the first
             steps after averaging full-size. Loses the momentum's memory at each averaging.
   "average" the buffers are averaged over the same peers as the models (in the same message, so
             one all-reduce), all but Adam's step counter: after an averaging the peers hold the
             same model and the same state, as one optimizer would. It costs twice (SGD momentum)
             or three times (Adam) the bytes of an averaging. (SGD momentum buffers enter the
             mean model linearly, so at period 1 "keep" and "average" both equal AllReduce with
             momentum from a common start; they differ for period > 1 and for Adam.)

With a compressing communicator (`compression=`, dpsgd.comm.codecs) global averagings send the outer
deltas x_anchor - x_i, far smaller than the models, as encoded, error-fed messages, and
x_avg = x_anchor - mean_i delta_i; the anchor is then kept for every outer (plain averaging included).
Group averagings, the first anchor and averaged inner states stay exact (`comm.exact`; error feedback
could turn Adam's second moments negative).

Against torch's PeriodicModelAverager(period, warmup_steps): torch averages after step t when
t - 1 - warmup_steps is a multiple of period (so right after the first local step); here it is
when t - warmup_steps is, i.e. after `period` local steps, as in the local SGD papers.
"""

from __future__ import annotations

import torch

from dpsgd.comm import Communicator
from topologies import Topology

from .base import DistributedOptimizer

OUTERS = ("average", "momentum", "nesterov")
INNER_STATES = ("keep", "reset", "average")


def _positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"LocalSGD {name} must be an integer >= {minimum}, got {value!r}")
    return value


class LocalSGD(DistributedOptimizer):
    """Local steps, exact averaging every `period` steps, and an outer optimizer (see the module)."""

    elastic = True  # the anchor and outer momentum are the same on every peer: an added peer takes rank 0's

    def __init__(
        self,
        base: torch.optim.Optimizer,
        *,
        topology: Topology | None = None,
        comm: Communicator,
        broadcast_initial: bool = True,
        period: int = 4,
        warmup_steps: int = 0,
        outer: str = "average",
        outer_lr: float = 1.0,
        outer_momentum: float = 0.0,
        inner_state: str = "keep",
        group_size: int | None = None,
        global_period: int | None = None,
    ):
        # the topology is accepted, and ignored: averaging is exact
        super().__init__(base, topology=topology, comm=comm, broadcast_initial=broadcast_initial)
        self.period = _positive_int("period", period)
        self.warmup_steps = _positive_int("warmup_steps", warmup_steps, minimum=0)
        if outer not in OUTERS:
            raise ValueError(f"LocalSGD outer must be one of {OUTERS}, got {outer!r}")
        if inner_state not in INNER_STATES:
            raise ValueError(f"LocalSGD inner_state must be one of {INNER_STATES}, got {inner_state!r}")
        if not outer_lr > 0:
            raise ValueError(f"LocalSGD outer_lr must be > 0, got {outer_lr}")
        if not 0 <= outer_momentum < 1:
            raise ValueError(f"LocalSGD outer_momentum must be in [0, 1), got {outer_momentum}")
        if outer == "average" and (outer_lr != 1 or outer_momentum != 0):
            raise ValueError(
                f"LocalSGD outer='average' takes no outer_lr ({outer_lr}) or outer_momentum "
                f"({outer_momentum}); use outer='momentum' or 'nesterov' for an outer optimizer"
            )
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
        self.outer, self.outer_lr, self.outer_momentum = outer, float(outer_lr), float(outer_momentum)
        self.inner_state, self.group_size, self.global_period = inner_state, group_size, global_period
        self._same_start = broadcast_initial  # every peer starts from rank 0's parameters
        self._anchor: list[torch.Tensor] | None = None  # model at the last global averaging
        self._outer_buffer: list[torch.Tensor] | None = None  # u, the outer momentum

    # --- the step -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = self._closure_loss(closure)
        t = self.step_count + 1
        if t <= self.warmup_steps:
            grads = [p.grad for p in self.params() if p.grad is not None]
            if grads:
                for g, avg in zip(grads, self.comm.allreduce_mean(grads, stream="gradients")):
                    g.copy_(avg)
            self.base.step()
        else:
            if (self.outer != "average" or self.comm.exact is not self.comm) and self._anchor is None:
                self._anchor = self._common_start()
            self.base.step()
            s = t - self.warmup_steps
            if self.global_period is not None and s % self.global_period == 0:
                self._average(group=False)
            elif s % self.period == 0:
                self._average(group=self.global_period is not None)
        self.step_count = t
        return loss

    def _common_start(self) -> list[torch.Tensor]:
        """The peers' mean model, the first anchor: without a message when they started from rank 0's
        parameters (broadcast_initial), since exact averaging and all-reduce warm-up keep them equal."""
        if self._same_start:
            return [p.detach().clone() for p in self.params()]
        return [a.clone() for a in self.comm.exact.allreduce_mean(self.params())]

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
        params = self.params()
        state = self._state_tensors() if self.inner_state == "average" else []
        tensors = params + state
        if not group and self.comm.exact is not self.comm:
            assert self._anchor is not None  # kept whenever deltas are compressed
            deltas = [a - p for a, p in zip(self._anchor, params)]
            mean_delta = self.comm.allreduce_mean(deltas, stream="outer")
            averaged = [a - m for a, m in zip(self._anchor, mean_delta)]
            averaged += self.comm.exact.allreduce_mean(state) if state else []
        elif not group:
            averaged = self.comm.allreduce_mean(tensors)
        else:
            assert self.group_size is not None  # group averaging is hierarchical averaging
            averaged = self.comm.exact.group_mean(tensors, self.group_size)
        for s, a in zip(state, averaged[len(params) :]):
            s.copy_(a)
        x_avg = averaged[: len(params)]
        if group or self.outer == "average":
            for p, a in zip(params, x_avg):
                p.copy_(a)
            if not group and self._anchor is not None:
                for anchor, a in zip(self._anchor, x_avg):
                    anchor.copy_(a)
        else:
            self._outer_step(x_avg)
        if self.inner_state == "reset":
            self.base.state.clear()

    def _outer_step(self, x_avg: list[torch.Tensor]) -> None:
        assert self._anchor is not None  # taken when the local phase began
        if self._outer_buffer is None:
            self._outer_buffer = [torch.zeros_like(a) for a in self._anchor]
        beta, alpha, i = self.outer_momentum, self.outer_lr, 0
        for group in self.param_groups:
            gamma = float(group["lr"])
            if self.outer == "momentum" and not gamma > 0:
                raise ValueError(f"LocalSGD outer='momentum' divides by the base lr, which is {gamma}")
            for p in group["params"]:
                anchor, u = self._anchor[i], self._outer_buffer[i]
                outer_grad = anchor - x_avg[i]
                if self.outer == "momentum":
                    u.mul_(beta).add_(outer_grad, alpha=1.0 / gamma)
                    anchor.add_(u, alpha=-alpha * gamma)
                else:  # nesterov
                    u.mul_(beta).add_(outer_grad)
                    anchor.add_(outer_grad.add_(u, alpha=beta), alpha=-alpha)
                p.copy_(anchor)
                i += 1

    # --- state ----------------------------------------------------------------------------
    def algorithm_state(self):
        def copy(tensors):
            return None if tensors is None else [t.clone() for t in tensors]

        return {
            **super().algorithm_state(),
            "anchor": copy(self._anchor),
            "outer_buffer": copy(self._outer_buffer),
        }

    def load_algorithm_state(self, state) -> None:
        super().load_algorithm_state(state)
        self._anchor = self.own_tensors(state.get("anchor"))
        self._outer_buffer = self.own_tensors(state.get("outer_buffer"))

    def __repr__(self) -> str:
        groups = f", group_size={self.group_size}, global_period={self.global_period}" if self.group_size else ""
        return (
            f"{type(self).__name__}({self.base!r}, period={self.period}, warmup_steps={self.warmup_steps}, "
            f"outer={self.outer!r}, outer_lr={self.outer_lr}, outer_momentum={self.outer_momentum}, "
            f"inner_state={self.inner_state!r}{groups})"
        )


class SlowMo(LocalSGD):
    """SlowMo (Wang et al. 2020) over local SGD: outer='momentum' with slow momentum beta = 0.5 and
    slow lr alpha = 1 (fairscale's SlowMoDistributedDataParallel defaults)."""

    def __init__(
        self,
        base: torch.optim.Optimizer,
        *,
        comm: Communicator,
        period: int = 4,
        outer: str = "momentum",
        outer_lr: float = 1.0,
        outer_momentum: float = 0.5,
        **options,
    ):
        super().__init__(
            base, comm=comm, period=period, outer=outer, outer_lr=outer_lr, outer_momentum=outer_momentum, **options
        )


class DiLoCo(LocalSGD):
    """DiLoCo (Douillard et al. 2023): outer SGD with Nesterov momentum 0.9 and lr 0.7 on the outer
    gradient x_anchor - x_avg; the paper's inner optimizer is AdamW (pass it as `base`)."""

    def __init__(
        self,
        base: torch.optim.Optimizer,
        *,
        comm: Communicator,
        period: int = 8,
        outer: str = "nesterov",
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        **options,
    ):
        super().__init__(
            base, comm=comm, period=period, outer=outer, outer_lr=outer_lr, outer_momentum=outer_momentum, **options
        )


class BMUF(LocalSGD):
    """Blockwise model-update filtering (Chen & Huo 2016): outer='momentum', which at a constant base lr
    is BMUF's block momentum (see the module), with block lr outer_lr (1) and block momentum
    outer_momentum, by default the paper's 1 - 1/n for n peers."""

    def __init__(
        self,
        base: torch.optim.Optimizer,
        *,
        comm: Communicator,
        period: int = 4,
        outer: str = "momentum",
        outer_lr: float = 1.0,
        outer_momentum: float | None = None,
        **options,
    ):
        if outer_momentum is None:
            outer_momentum = 1.0 - 1.0 / comm.size
        super().__init__(
            base, comm=comm, period=period, outer=outer, outer_lr=outer_lr, outer_momentum=outer_momentum, **options
        )
