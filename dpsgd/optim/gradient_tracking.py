"""Gradient tracking (DIGing / Pu & Nedic 2021 "Distributed stochastic gradient tracking methods";
analysis of Koloskova, Lin, Stich, NeurIPS 2021 "An improved analysis of gradient tracking for
decentralized machine learning"): see `GradientTracking`."""

from __future__ import annotations

import torch

from topologies import Topology

from .base import DistributedOptimizer


class GradientTracking(DistributedOptimizer):
    """Gradient tracking (DIGing; Pu & Nedic 2021): each peer steps along a tracker y_i of the average gradient.

    With g_i^k taken at x_i^k and W(k) doubly stochastic:

        y_i^0     = g_i^0
        y_i^k     = sum_j W(k-1)[i,j] y_j^{k-1} + g_i^k - g_i^{k-1}
        x_i^{k+1} = sum_j W(k)[i,j] base(x_j^k, y_j^k)

    For SGD, base(x, y) = x - lr y. The base optimizer takes y_i as its gradient (momentum acts on the
    tracked direction; weight decay is added on top of y, untracked, the same function on every peer). The
    mean of the trackers equals the mean gradient (W is column stochastic), so the average model moves by
    the average increment and heterogeneous data leave no bias in the fixed point. Two vectors (x^{k+1/2}
    and y) per neighbour per step, in one message; W y^k is kept as c_i = W y^k - g^k for the next step.
    """

    topology: Topology  # required: gossip needs its mixing matrices
    label = "gradient tracking"
    knobs = {}
    cost_form = None  # two vectors to each neighbour a step: twice the messages of the map's gossip form

    def __init__(self, base: torch.optim.Optimizer, *, topology: Topology, **common):
        super().__init__(base, topology=topology, **common)
        self.require_topology("doubly", why=" (W must keep the average of the trackers equal to the average gradient)")
        self.correction: list[torch.Tensor] | None = None  # c_i = W y^{k-1} - g^{k-1} (0 before step 0)

    def update(self) -> None:
        params = self.params()
        self.check_mixing(self.step_count)
        grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params]
        if self.correction is None:
            self.correction = [torch.zeros_like(p) for p in params]
        trackers = [g + c for g, c in zip(grads, self.correction)]  # y^k = W y^{k-1} + g^k - g^{k-1}
        for p, y in zip(params, trackers):
            p.grad = y.clone()  # the base steps along y
        self.base.step()  # p = base(x^k, y^k)
        n = len(params)
        mixed = self.comm.mix([*params, *trackers], self.topology, self.step_count)
        for p, m in zip(params, mixed[:n]):
            p.copy_(m)
        for c, wy, g in zip(self.correction, mixed[n:], grads):
            torch.sub(wy, g, out=c)
        self.step_count += 1

    def param_group_added(self, params: list[torch.Tensor]) -> None:
        if self.correction is not None:  # a new parameter's tracker starts at its gradient, as at step 0
            self.correction += [torch.zeros_like(p) for p in params]

    def algorithm_state(self):
        return {
            **super().algorithm_state(),
            "correction": None if self.correction is None else [t.clone() for t in self.correction],
        }

    def load_algorithm_state(self, state):
        super().load_algorithm_state(state)
        self.correction = self.own_tensors(state.get("correction"))
