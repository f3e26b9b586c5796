"""The wrapper every distributed optimizer shares: it holds a local torch optimizer (the
"base", whose step defines the increment d_i = base(x_i, g_i) - x_i), a communicator and a
step counter, and behaves like a torch optimizer itself (step, zero_grad, param_groups,
state_dict / load_state_dict with the algorithm's own state, LR schedulers)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from dpsgd.comm import Communicator

STATE_KEY = "dpsgd"  # where state_dict() keeps the algorithm's own state beside the base's


class DistributedOptimizer(torch.optim.Optimizer):
    """Base class: subclasses implement `step()` with `self.base.step()` and communication."""

    asynchronous = False  # True: peers never wait for a global step (AD-PSGD: pairs active with passive peers)

    def __init__(self, base: torch.optim.Optimizer, comm: Communicator):
        if not isinstance(base, torch.optim.Optimizer):
            raise TypeError(
                f"{type(self).__name__} wraps a local torch optimizer, e.g. "
                f"{type(self).__name__}(torch.optim.SGD(model.parameters(), lr=0.1), ...); got {type(base).__name__}"
            )
        if comm is None:
            raise TypeError(f"{type(self).__name__} needs comm=dpsgd.comm.init(...)")
        # No Optimizer.__init__: the parameter groups and state are the base's own objects,
        # so LR schedulers and gradient clipping act on the optimizer that really steps.
        self.base, self.comm = base, comm
        self.defaults = base.defaults
        self.param_groups = base.param_groups
        self.step_count = 0  # global steps taken: selects the topology's matrix at each step
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()

    @property
    def state(self):  # type: ignore[override]
        return self.base.state

    def params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        self.base.add_param_group(param_group)

    def _closure_loss(self, closure):
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    # --- state ----------------------------------------------------------------------------
    def algorithm_state(self) -> dict[str, Any]:
        """The algorithm's own state beyond the base optimizer's; subclasses extend it."""
        return {"step_count": self.step_count}

    def load_algorithm_state(self, state: dict[str, Any]) -> None:
        self.step_count = int(state["step_count"])

    def state_dict(self) -> dict[str, Any]:
        sd = self.base.state_dict()
        sd[STATE_KEY] = self.algorithm_state()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if STATE_KEY not in state_dict:
            raise ValueError(
                f"this state_dict has no '{STATE_KEY}' entry: it was saved from a plain torch optimizer, "
                f"not from {type(self).__name__}; load it into the base optimizer instead"
            )
        state_dict = dict(state_dict)
        self.load_algorithm_state(state_dict.pop(STATE_KEY))
        self.base.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base!r}, comm={self.comm!r})"


@torch.no_grad()
def snapshot(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]
