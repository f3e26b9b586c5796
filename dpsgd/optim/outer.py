"""The outer optimizer of the LocalSGD family and Streaming DiLoCo: any torch optimizer over the anchor (the
model the peers last agreed on), stepping with the peers' mean outer gradient G = x_anchor - mean_i x_i as
its gradient, as DiLoCo frames it and torchft composes it.

How it works: docs/guide/internals.md#outer.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import torch

# DiLoCo's outer optimizer (Douillard et al. 2023): u <- 0.9 u + G, x_anchor <- x_anchor - 0.7 (G + 0.9 u)
DILOCO = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)


def factory(outer, who: str) -> Callable[..., torch.optim.Optimizer] | None:
    """The factory `outer` is (a callable or None), or a one-line error."""
    if outer is None or callable(outer):
        return outer
    raise ValueError(
        f"{who} outer must be a torch optimizer factory (functools.partial(torch.optim.SGD, lr=0.7, ...)) or None "
        "for plain averaging (a config names one as {_target_: torch.optim.SGD, lr: 0.7, momentum: 0.9, nesterov: "
        f"true}}); {outer!r} is neither"
    )


def saved_outer(state: dict, who: str) -> dict | None:
    """The outer state an algorithm_state holds (None before the anchor is taken)."""
    if "outer_buffer" in state:  # its momentum was a bare tensor list, not a torch optimizer's state
        raise ValueError(
            f"this {who} state_dict predates torch outer optimizers; resume it with the version that saved it"
        )
    return state.get("outer")


class OuterOptimizer:
    """Anchor tensors in groups and the torch optimizer that moves them (None: anchors only). `anchored`: the
    anchors were set (an algorithm takes them at its first step, or when its local phase begins); before that its
    state_dict() is None."""

    def __init__(self, make: Callable[..., torch.optim.Optimizer] | None, groups: list[list[torch.Tensor]], who: str):
        self.anchors = [a for group in groups for a in group]
        self.anchored = False
        try:  # torch's own checks: a negative lr, an unknown keyword, ...
            self.optimizer = None if make is None else make([{"params": group} for group in groups])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{who} cannot build its outer optimizer: {exc}") from None

    @classmethod
    def over(cls, make, param_groups: list[dict], who: str) -> OuterOptimizer:
        """One anchor per parameter of `param_groups` (a copy of it until the anchors are set), in their groups."""
        return cls(make, [[p.detach().clone() for p in group["params"]] for group in param_groups], who)

    def set_anchors(self, values) -> None:
        for anchor, value in zip(self.anchors, values):
            anchor.copy_(value)
        self.anchored = True

    def step(self, grads: list[torch.Tensor | None], base_lrs: list[float] | None = None) -> None:
        """One outer step with grads[k] the gradient of anchor k (None: it does not move, as Streaming DiLoCo's
        fragments out of turn); base_lrs, one per group, applies SlowMo's form."""
        assert self.optimizer is not None  # only an outer optimizer steps
        groups = self.optimizer.param_groups
        lrs = [group["lr"] for group in groups]
        for anchor, grad in zip(self.anchors, grads):
            anchor.grad = grad
        for group, gamma in zip(groups, base_lrs or []):
            for anchor in group["params"]:
                if anchor.grad is not None:
                    anchor.grad.mul_(1.0 / gamma)
            group["lr"] = group["lr"] * gamma
        try:
            self.optimizer.step()
        finally:
            for group, lr in zip(groups, lrs):
                group["lr"] = lr
            for anchor in self.anchors:
                anchor.grad = None

    def state_dict(self) -> dict | None:
        if not self.anchored:
            return None
        # copies: a state dict saved now must not move with the optimizer's later steps
        optimizer = None if self.optimizer is None else copy.deepcopy(self.optimizer.state_dict())
        return {"anchors": [a.clone() for a in self.anchors], "optimizer": optimizer}

    def load_state_dict(self, state: dict | None) -> None:
        """Restore what state_dict() returned (None: the anchors are not taken yet)."""
        self.anchored = False
        if state is None:
            return
        # a state of another model fails torch's own checks (the outer optimizer's groups, the base's)
        self.set_anchors(state["anchors"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
