"""SGP, Stochastic Gradient Push (Assran, Loizou, Ballas, Rabbat, ICML 2019): see `SGP`."""

from __future__ import annotations

import torch

from topologies import Topology

from .base import DistributedOptimizer


class SGP(DistributedOptimizer):
    """Stochastic Gradient Push (Assran et al. 2019): push-sum gossip over column stochastic W(k).

    Peer i keeps a numerator x_i and a weight w_i (x_i^0 the initial model, w_i^0 = 1); its model's
    parameters hold the de-biased z_i = x_i / w_i, where its gradient is taken. Each step:

        x_i^{k+1} = sum_j W[i,j] (x_j^k + d_j)      with d_j = base(z_j, g_j) - z_j
        w_i^{k+1} = sum_j W[i,j] w_j^k
        z_i^{k+1} = x_i^{k+1} / w_i^{k+1}

    Only column stochasticity is needed (directed and time-varying graphs such as
    `one_peer_directed_exponential`): it keeps sum_i x_i (up to the increments) and sum_i w_i = n exactly,
    so the z_i agree on the average. The paper pushes W[j,i] x_i to each out-neighbour j; here the receiver
    applies the weights (the same sum). x and w travel in one message (w appended to the flat buffer) and
    are this optimizer's state, created at the first step; evaluation, consensus metrics and checkpoints of
    the model see z, and momentum and other base state act on the increments of z.
    """

    topology: Topology  # required: gossip needs its mixing matrices
    label = "SGP"
    knobs = {}
    cost_form = "gossip"  # x and w in one message: the model (and one number) to each neighbour a step

    def __init__(self, base: torch.optim.Optimizer, *, topology: Topology, **common):
        super().__init__(base, topology=topology, **common)
        self.require_topology("column", why=" (push-sum conserves mass only if each peer shares out all of its value)")
        self.x: list[torch.Tensor] | None = None  # push-sum numerators, shaped like the parameters
        self.w: torch.Tensor | None = None  # push-sum weight: one value per peer, of the parameters' dtype

    def update(self) -> None:
        params, peers = self.params(), self.comm.peer_shape
        if self.x is None or self.w is None:
            self.x = [p.detach().clone() for p in params]
            self.w = torch.ones(*peers, 1, dtype=params[0].dtype, device=params[0].device)
        xs, w = self.x, self.w
        self.check_mixing(self.step_count)
        z = [p.detach().clone() for p in params]
        self.base.step()  # p = z + d
        for x, p, zk in zip(xs, params, z):
            x.add_(p).sub_(zk)  # x^{k+1/2} = x^k + d
        mixed = self.comm.mix([*xs, w], self.topology, self.step_count)
        for x, m in zip(xs, mixed):
            x.copy_(m)
        w.copy_(mixed[-1])
        for p, x in zip(params, xs):
            torch.div(x, w.view(*peers, *[1] * (x.dim() - len(peers))), out=p)  # z^{k+1}
        self.step_count += 1

    def param_group_added(self, params: list[torch.Tensor]) -> None:
        if self.x is not None and self.w is not None:  # numerators x = z w, so that x / w is the parameter
            peers = self.comm.peer_shape
            self.x += [p.detach() * self.w.view(*peers, *[1] * (p.dim() - len(peers))) for p in params]

    def algorithm_state(self):
        return {
            **super().algorithm_state(),
            "x": None if self.x is None else [t.clone() for t in self.x],
            "w": None if self.w is None else self.w.clone(),
        }

    def load_algorithm_state(self, state):
        super().load_algorithm_state(state)
        self.x = self.own_tensors(state.get("x"))
        p = self.params()[0]
        self.w = None if self.x is None else state["w"].detach().clone().to(p.device, p.dtype)
