"""DES-LOC, desynced low-communication adaptive optimizers (Iacob et al. 2025, arXiv 2505.22549): see `DESLOC`."""

from __future__ import annotations

import torch

from .base import DistributedOptimizer

# the base optimizer's state each period averages: Adam's moments (SGD's momentum buffer as the first)
FIRST, SECOND = ("exp_avg", "momentum_buffer"), ("exp_avg_sq",)


class DESLOC(DistributedOptimizer):
    """DES-LOC (Iacob et al. 2025): local Adam whose parameters and two moments are averaged on their own periods.

    The base optimizer (Adam/AdamW: the paper's; SGD with momentum has a first moment only) steps locally;
    after inner step t = 1, 2, ..., an exact all-reduce averages
    x_i <- mean_j x_j if t % K_x == 0,  u_i <- mean_j u_j if t % K_u == 0,  v_i <- mean_j v_j if t % K_v == 0
    (K_x = `param_period`, K_u = `momentum_period`, K_v = `variance_period`; u, v Adam's exp_avg and
    exp_avg_sq, or SGD's momentum_buffer as u; a state the base does not keep is skipped); the moments
    that fall due at one step travel in one all-reduce. Slow-decaying states sync rarely: the paper
    recommends K_u = 3 K_x and K_v = 6 K_x. K_u = K_v = K_x is Local Adam; moments never synced (a period
    longer than the run) leave each peer its own state. With compression= only the parameters travel
    encoded (error feedback could turn second moments negative). The topology is ignored.

    One guard the paper does not need (its workloads give every peer a gradient for every weight): where a
    peer's second moment is exactly 0 after the sync (it never had a gradient there, e.g. an input always 0
    in its share, and v was not averaged in), its first moment stays 0 when the others' is averaged in;
    Adam would otherwise step that weight by lr u / eps (a jump to 1e5-1e6, seen on non-iid digits).
    """

    uses_topology = False
    label = "DES-LOC"
    knobs = {}
    cost_form = None  # the parameters and each moment on periods of their own: not the periodic form's one period

    def __init__(
        self,
        base: torch.optim.Optimizer,
        *,
        param_period: int = 8,
        momentum_period: int = 24,
        variance_period: int = 48,
        **common,
    ):
        super().__init__(base, **common)
        periods = {"param_period": param_period, "momentum_period": momentum_period, "variance_period": variance_period}
        for name, value in periods.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DESLOC {name} must be an integer >= 1, got {value!r}")
        self.param_period, self.momentum_period, self.variance_period = param_period, momentum_period, variance_period

    def _states(self, keys: tuple[str, ...]) -> list[torch.Tensor]:
        return [s for s, _ in self._states_and_scales(keys)]

    def _states_and_scales(self, keys: tuple[str, ...]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Each parameter's first state among `keys`, with Adam's second moment beside it (None for SGD)."""
        out = []
        for p in self.params():
            state = self.base.state.get(p, {})
            found = [state[k] for k in keys if torch.is_tensor(state.get(k))][:1]
            out += [(found[0], state.get("exp_avg_sq"))] if found else []
        return out

    def update(self) -> None:
        self.base.step()
        t = self.step_count = self.step_count + 1
        if t % self.param_period == 0:
            params = self.params()
            for p, mean in zip(params, self.comm.allreduce_mean(params, stream="parameters")):
                p.copy_(mean)
        firsts = self._states_and_scales(FIRST) if t % self.momentum_period == 0 else []
        states = [u for u, _ in firsts] + (self._states(SECOND) if t % self.variance_period == 0 else [])
        if states:
            for s, mean in zip(states, self.comm.exact.allreduce_mean(states)):
                s.copy_(mean)
        for u, v in firsts:  # the guard above, on the second moment as it now is (averaged if it was due)
            if v is not None:
                u.masked_fill_(v == 0, 0.0)

    def __repr__(self) -> str:
        return (
            f"DESLOC({self.base!r}, param_period={self.param_period}, momentum_period={self.momentum_period}, "
            f"variance_period={self.variance_period})"
        )
