"""The outer optimizer of the LocalSGD family and Streaming DiLoCo: any torch optimizer over the anchor (the
model the peers last agreed on), stepping with the peers' mean outer gradient G = x_anchor - mean_i x_i as
its gradient, as DiLoCo frames it and torchft composes it.

An outer optimizer is given as a factory params -> torch.optim.Optimizer
(`functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)`, DiLoCo's) or as a config dict
naming one with `_target_` (`{_target_: torch.optim.Adam, lr: 0.1}`); None means no outer optimizer.

`scale_by_base_lr` is SlowMo's form (Wang et al. 2020): at each outer step the gradient is divided by the
base lr gamma of its parameter group and the outer lr multiplied by it, so SGD with momentum beta computes
u <- beta u + G / gamma, x_anchor <- x_anchor - alpha gamma u (equal to SGD on G itself at a constant gamma).
"""

from __future__ import annotations

import copy
import functools
import importlib
from collections.abc import Callable, Mapping

import torch

# DiLoCo's outer optimizer (Douillard et al. 2023): u <- 0.9 u + G, x_anchor <- x_anchor - 0.7 (G + 0.9 u)
DILOCO = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
EXAMPLE = "{_target_: torch.optim.SGD, lr: 0.7, momentum: 0.9, nesterov: true}"


def factory(outer, who: str) -> Callable[..., torch.optim.Optimizer] | None:
    """The factory an `outer` option names (a callable, a `_target_` dict or None), or a one-line error."""
    if outer is None or callable(outer):
        return outer
    if not isinstance(outer, Mapping):
        raise ValueError(
            f"{who} outer must be a torch optimizer factory (e.g. functools.partial(torch.optim.SGD, lr=0.7, "
            f"momentum=0.9, nesterov=True)), a config dict such as {EXAMPLE}, or null for plain averaging; "
            f"got {outer!r}"
        )
    options = dict(outer)
    target = options.pop("_target_", None)
    if not isinstance(target, str) or "." not in target:
        raise ValueError(f"{who} outer {outer!r} needs a `_target_` naming a torch optimizer, e.g. {EXAMPLE}")
    module, _, name = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"{who} outer._target_={target!r} cannot be imported ({type(exc).__name__}: {exc}); name a torch "
            "optimizer class such as torch.optim.SGD or torch.optim.Adam"
        ) from None
    return functools.partial(cls, **options)


class OuterOptimizer:
    """Anchor tensors in groups and the torch optimizer that moves them; `step` takes their outer gradients."""

    def __init__(self, make: Callable[..., torch.optim.Optimizer] | None, groups: list[list[torch.Tensor]], who: str):
        self.anchors = [a for group in groups for a in group]
        self.optimizer: torch.optim.Optimizer | None = None  # None: anchors only (compressed plain averaging)
        if make is None:
            return
        try:
            self.optimizer = make([{"params": group} for group in groups])
        except (TypeError, ValueError) as exc:  # torch's own checks: a negative lr, an unknown keyword, ...
            raise ValueError(f"{who} cannot build its outer optimizer: {exc}") from None
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise ValueError(f"{who} outer must make a torch.optim.Optimizer, got {type(self.optimizer).__name__}")

    def step(self, grads: list[torch.Tensor | None], base_lrs: list[float] | None = None) -> None:
        """One outer step with grads[k] the gradient of anchor k (None: that anchor does not move, as for
        Streaming DiLoCo's fragments out of turn); base_lrs, one per group, applies SlowMo's scaling."""
        assert self.optimizer is not None  # only an outer optimizer steps
        groups = self.optimizer.param_groups
        lrs = [group["lr"] for group in groups]
        for anchor, grad in zip(self.anchors, grads):
            anchor.grad = grad
        if base_lrs is not None:
            for group, gamma in zip(groups, base_lrs):
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

    def state_dict(self) -> dict:
        # copies: a state dict saved now must not move with the optimizer's later steps
        optimizer = None if self.optimizer is None else copy.deepcopy(self.optimizer.state_dict())
        return {"anchors": [a.clone() for a in self.anchors], "optimizer": optimizer}

    def load_state_dict(self, state: dict) -> None:
        if len(state["anchors"]) != len(self.anchors):
            raise ValueError(
                f"this state_dict holds {len(state['anchors'])} outer anchors but the optimizer has "
                f"{len(self.anchors)}: it was saved from a different model or fragment count"
            )
        for anchor, saved in zip(self.anchors, state["anchors"]):
            anchor.copy_(saved)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
