"""D^2 (Tang, Lian, Yan, Zhang, Liu, ICML 2018, "D^2: Decentralized Training over Decentralized
Data"): D-PSGD with a correction that removes the dependence on how different the peers' data are.

Peer i at step k, W = topology.mixing_matrix(k) symmetric doubly stochastic, g_i^k taken at x_i^k,
d_i^k = base(x_i^k, g_i^k) - x_i^k the local optimizer's increment (-lr g_i^k for plain SGD):

    k = 0:   x_i^1     = sum_j W[i,j] (x_j^0 + d_j^0)                          (plain D-PSGD, atc)
    k >= 1:  x_i^{k+1} = sum_j W[i,j] (2 x_j^k - x_j^{k-1} + d_j^k - d_j^{k-1})
                       = sum_j W[i,j] (2 x_j^k - x_j^{k-1} - lr g_j^k + lr g_j^{k-1})   (SGD)

which is the paper's Algorithm 1 with x^{-1} = x^0 and g^{-1} = 0. With a base optimizer other
than plain SGD the "increment" is the base's own step d = base(x, g) - x (e.g. -lr times the
momentum buffer, or Adam's step): D^2 then corrects by the difference of consecutive
increments, d^k - d^{k-1}, in place of -lr (g^k - g^{k-1}); the paper's analysis covers plain
SGD only. The optimizer keeps one vector, m_i = x_i^{k-1} + d_i^{k-1} (x^0 before the first
step), so x^{k+1/2} = (x^k + d^k) + x^k - m.

Mixing: the paper needs lambda_min(W) > -1/3. Matrices that break it are refused, unless
`lazy_mixing` is set: True mixes with (I + W) / 2 (eigenvalues (1 + lambda) / 2 >= 0, half the
speed of mixing), "auto" does so only for matrices whose lambda_min(W) <= -1/3 (e.g. a ring of
an even number of peers with Metropolis-Hastings weights, whose lambda_min is exactly -1/3).
Every matrix of a periodic schedule is checked at construction, random ones as they are used.
The average model moves only by the average increment: mean x^{k+1} = mean x^k + mean d^k.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .base import DistributedOptimizer
from .checks import check_stochastic, check_topology

LAMBDA_MIN = -1.0 / 3.0
LAZY_CHOICES = (False, True, "auto")


@dataclass(frozen=True)
class _Weights:
    recv: dict
    send: dict
    self_weight: float


def lambda_min(w: np.ndarray) -> float:
    return float(np.linalg.eigvalsh((w + w.T) / 2).min())


class D2(DistributedOptimizer):
    def __init__(self, base: torch.optim.Optimizer, topology, comm, lazy_mixing: bool | str = False):
        super().__init__(base, comm)
        check_topology(topology, comm, "D2")
        if not (lazy_mixing is True or lazy_mixing is False or lazy_mixing == "auto"):
            raise ValueError(f"D2 lazy_mixing must be one of {LAZY_CHOICES}, got {lazy_mixing!r}")
        self.topology, self.lazy_mixing = topology, lazy_mixing
        self._lazy: dict[int, bool] = {}  # step (within the period) -> mix with (I + W) / 2
        if getattr(topology, "period", 1) is not None:
            for t in range(topology.period):
                self._check(t)
        self.previous: list[torch.Tensor] | None = None  # m = x^{k-1} + d^{k-1}

    def _check(self, step: int) -> bool:
        key = step % self.topology.period if getattr(self.topology, "period", 1) else step
        if key in self._lazy:
            return self._lazy[key]
        check_stochastic(self.topology, "D2", "doubly", step)
        w = self.topology.mixing_matrix(step)
        if not np.allclose(w, w.T, rtol=0, atol=1e-12):
            raise ValueError(
                f"D2 needs symmetric mixing matrices (Tang et al. 2018, Assumption 1); topology "
                f"{getattr(self.topology, 'name', '?')!r} at step {step} is not symmetric - use a static undirected "
                f"topology or a random matching")
        low = lambda_min(w)
        lazy = self.lazy_mixing is True or (self.lazy_mixing == "auto" and low <= LAMBDA_MIN + 1e-9)
        if low <= LAMBDA_MIN + 1e-9 and not lazy:
            raise ValueError(
                f"D2 needs lambda_min(W) > -1/3 (Tang et al. 2018) but topology "
                f"{getattr(self.topology, 'name', '?')!r} at step {step} has lambda_min = {low:.6g}; set "
                f"lazy_mixing=true (mixes with (I + W)/2) or give each peer a larger self weight")
        if len(self._lazy) < 4096:
            self._lazy[key] = lazy
        return lazy

    def weights(self):
        nb = self.topology.neighbors(self.comm.rank, self.step_count)
        if not self._check(self.step_count):
            return nb
        return _Weights(recv={j: v / 2 for j, v in nb.recv.items()}, send={j: v / 2 for j, v in nb.send.items()},
                        self_weight=(1 + nb.self_weight) / 2)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._closure_loss(closure)
        params = self.params()
        x_k = [p.detach().clone() for p in params]
        if self.previous is None:
            self.previous = [x.clone() for x in x_k]  # x^{-1} + d^{-1} = x^0
        self.base.step()  # p = x^k + d^k
        after = [p.detach().clone() for p in params]  # x^k + d^k: the next step's m
        for p, x, m in zip(params, x_k, self.previous):
            p.add_(x).sub_(m)  # x^{k+1/2} = x^k + d^k + x^k - (x^{k-1} + d^{k-1})
        self.previous = after
        for p, m in zip(params, self.comm.neighbor_average(params, self.weights())):
            p.copy_(m)
        self.step_count += 1
        return loss

    def algorithm_state(self):
        return {**super().algorithm_state(), "lazy_mixing": self.lazy_mixing,
                "previous": None if self.previous is None else [t.clone() for t in self.previous]}

    def load_algorithm_state(self, state):
        super().load_algorithm_state(state)
        saved = state.get("previous")
        self.previous = None if saved is None else [
            t.detach().clone().to(p.device, p.dtype) for t, p in zip(saved, self.params())]
