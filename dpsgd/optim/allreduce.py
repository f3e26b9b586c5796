"""AllReduce: average the gradients over all peers, then take the base step. Every peer stays
identical; with equal local batches this is large-batch SGD on the union of the batches."""

from __future__ import annotations

import torch

from .base import DistributedOptimizer


class AllReduce(DistributedOptimizer):
    """The topology is accepted, and ignored, so that configs can swap algorithms."""

    elastic = True

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._closure_loss(closure)
        # every peer must hold gradients for the same parameters, or the messages would not match
        grads = [p.grad for p in self.params() if p.grad is not None]
        if grads:
            for g, avg in zip(grads, self.comm.allreduce_mean(grads)):
                g.copy_(avg)
        self.base.step()
        self.step_count += 1
        return loss
