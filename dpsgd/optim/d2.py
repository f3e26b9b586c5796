"""D^2 (Tang, Lian, Yan, Zhang, Liu, ICML 2018, "D^2: Decentralized Training over Decentralized Data"): see `D2`."""

from __future__ import annotations

import numpy as np
import torch

from topologies import Topology

from .base import DistributedOptimizer

LAMBDA_MIN = -1.0 / 3.0
LAZY_CHOICES = (False, True, "auto")


def lambda_min(w: np.ndarray) -> float:
    """The smallest eigenvalue of W's symmetric part, (W + W^T) / 2 (D2 needs it > -1/3)."""
    return float(np.linalg.eigvalsh((w + w.T) / 2).min())


class D2(DistributedOptimizer):
    """D^2 (Tang et al. 2018): D-PSGD corrected so that the peers' data heterogeneity leaves no bias.

    With d^k = base(x^k, g^k) - x^k each peer's increment and W = W(k) symmetric doubly stochastic:

        x^1     = W (x^0 + d^0)                                  (the first step is D-PSGD's atc)
        x^{k+1} = W (2 x^k - x^{k-1} + d^k - d^{k-1})            (k >= 1)

    This is the paper's Algorithm 1 with x^{-1} = x^0 and g^{-1} = 0: for plain SGD d^k - d^{k-1} =
    -lr (g^k - g^{k-1}); other bases correct by the difference of their own increments (the paper's
    analysis covers plain SGD only). The optimizer keeps one vector, m = x^{k-1} + d^{k-1} (x^0 at first).
    The average model moves only by the average increment.

    The paper needs lambda_min(W) > -1/3; a matrix that breaks it is refused in one line unless
    `lazy_mixing` is True (mix with (I + W) / 2, half the speed of mixing) or "auto" (only where needed,
    e.g. an even ring with Metropolis-Hastings weights, whose lambda_min is exactly -1/3). Every matrix of
    a periodic schedule is checked at construction, random ones as they are used. One model per neighbour
    per step, as D-PSGD.
    """

    topology: Topology  # required: gossip needs its mixing matrices
    label = "D²"
    knobs = {}
    cost_form = None  # the map's gossip runs on the one-peer exponential graph too, whose W is not symmetric

    def __init__(self, base: torch.optim.Optimizer, *, topology: Topology, lazy_mixing: bool | str = "auto", **common):
        super().__init__(base, topology=topology, **common)
        self.require_topology("doubly")
        if not (lazy_mixing is True or lazy_mixing is False or lazy_mixing == "auto"):
            raise ValueError(f"D2 lazy_mixing must be one of {LAZY_CHOICES}, got {lazy_mixing!r}")
        self.lazy_mixing = lazy_mixing
        self._lazy: dict[int, bool] = {}  # step (within the period) -> mix with (I + W) / 2
        if topology.period is not None:
            for t in range(topology.period):
                self._check(t)
        self.previous: list[torch.Tensor] | None = None  # m = x^{k-1} + d^{k-1}

    def _check(self, step: int) -> bool:
        """Whether W(step) is mixed lazily; refuses matrices D2 cannot use, in one line."""
        period = self.topology.period
        key = step % period if period else step
        if key in self._lazy:
            return self._lazy[key]
        w = self.topology.mixing_matrix(step)
        name = self.topology.name
        self.check_mixing(key)
        if not np.allclose(w, w.T, rtol=0, atol=1e-12):
            raise ValueError(
                f"D2 needs symmetric mixing matrices (Tang et al. 2018, Assumption 1); topology {name!r} at step "
                f"{step} is not symmetric - use a static undirected topology or a random matching"
            )
        low = lambda_min(w)
        lazy = self.lazy_mixing is True or (self.lazy_mixing == "auto" and low <= LAMBDA_MIN + 1e-9)
        if low <= LAMBDA_MIN + 1e-9 and not lazy:
            raise ValueError(
                f"D2 needs lambda_min(W) > -1/3 (Tang et al. 2018) but topology {name!r} at step {step} has "
                f"lambda_min = {low:.6g}; set lazy_mixing=true (mixes with (I + W)/2) or give each peer a larger "
                f"self weight"
            )
        if len(self._lazy) < 4096:
            self._lazy[key] = lazy
        return lazy

    def update(self) -> None:
        params = self.params()
        x_k = [p.detach().clone() for p in params]
        if self.previous is None:
            self.previous = [x.clone() for x in x_k]  # x^{-1} + d^{-1} = x^0
        self.base.step()  # p = x^k + d^k
        after = [p.detach().clone() for p in params]  # x^k + d^k: the next step's m
        for p, x, m in zip(params, x_k, self.previous):
            p.add_(x).sub_(m)  # x^{k+1/2} = x^k + d^k + x^k - (x^{k-1} + d^{k-1})
        self.previous = after
        mixed = self.comm.mix(params, self.topology, self.step_count, lazy=self._check(self.step_count))
        for p, m in zip(params, mixed):
            p.copy_(m)
        self.step_count += 1

    def param_group_added(self, params: list[torch.Tensor]) -> None:
        if self.previous is not None:  # x^{-1} + d^{-1} = x^0, as for the first parameters
            self.previous += [p.detach().clone() for p in params]

    def algorithm_state(self):
        return {
            **super().algorithm_state(),
            "lazy_mixing": self.lazy_mixing,
            "previous": None if self.previous is None else [t.clone() for t in self.previous],
        }

    def load_algorithm_state(self, state):
        super().load_algorithm_state(state)
        self.previous = self.own_tensors(state.get("previous"))
