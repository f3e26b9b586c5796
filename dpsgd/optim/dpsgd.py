"""D-PSGD (Lian et al., NeurIPS 2017): gossip averaging with the topology's mixing matrix W.

Peer i at step k, with d_i = base(x_i, g_i) - x_i its local increment (g_i taken at x_i^k):
- order "cta" (combine-then-adapt, the paper's):  x_i <- sum_j W[i,j] x_j^k + d_i.
  x^k is known before the backward pass, so `start_communication()` may send it early and let
  the exchange overlap the gradient computation; `step()` then only waits for it.
- order "atc" (adapt-then-combine):               x_i <- sum_j W[i,j] (x_j^k + d_j).
"""

from __future__ import annotations

import torch

from .base import DistributedOptimizer, snapshot

ORDERS = ("cta", "atc")


def check_topology(topology, comm, algorithm: str) -> None:
    if topology is None:
        raise TypeError(f"{algorithm} needs topology=topologies.make(NAME, comm.size)")
    if topology.n != comm.size:
        raise ValueError(
            f"{algorithm}: the topology has {topology.n} peers but the communicator has {comm.size}; "
            f"build it with topologies.make(name, comm.size)"
        )


class DPSGD(DistributedOptimizer):
    def __init__(self, base: torch.optim.Optimizer, topology, comm, order: str = "cta"):
        super().__init__(base, comm)
        check_topology(topology, comm, "DPSGD")
        if order not in ORDERS:
            raise ValueError(f"DPSGD order must be one of {ORDERS}, got {order!r}")
        self.topology, self.order = topology, order
        self._in_flight = None  # (x^k, handle) when the exchange was started early

    def neighbors(self):
        return self.topology.neighbors(self.comm.rank, self.step_count)

    @torch.no_grad()
    def start_communication(self) -> None:
        """Send x^k now (cta order): call it before the backward pass to overlap the two."""
        if self.order != "cta":
            raise RuntimeError("only order='cta' can start its exchange before the backward pass")
        if self._in_flight is None:
            x_k = snapshot(self.params())
            self._in_flight = (x_k, self.comm.start_neighbor_average(x_k, self.neighbors()))

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._closure_loss(closure)
        params = self.params()
        if self.order == "cta":
            self.start_communication()
            x_k, handle = self._in_flight
            self.base.step()  # p = x^k + d
            mixed = handle.wait()
            self._in_flight = None
            for p, x, m in zip(params, x_k, mixed):
                p.sub_(x).add_(m)  # x^{k+1} = sum_j W_ij x_j^k + d
        else:
            self.base.step()
            for p, m in zip(params, self.comm.neighbor_average(params, self.neighbors())):
                p.copy_(m)
        self.step_count += 1
        return loss

    def algorithm_state(self):
        if self._in_flight is not None:
            raise RuntimeError("state_dict() between start_communication() and step(): finish the step first")
        return {**super().algorithm_state(), "order": self.order}
