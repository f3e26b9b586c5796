"""AllReduce: average the gradients over all peers, then take the base step. Every peer stays
identical; with equal local batches this is large-batch SGD on the union of the batches.

The gradients travel as buckets of at most `bucket_mb` MiB (dpsgd.optim.buckets); with
`overlap=True` each bucket's all-reduce starts as soon as the backward pass has filled it, as DDP's
does, so the baseline hides communication behind computation as well as the best systems."""

from __future__ import annotations

import torch

from .base import DistributedOptimizer
from .buckets import GradientBuckets


class AllReduce(DistributedOptimizer):
    """The topology is accepted, and ignored, so that configs can swap algorithms."""

    def __init__(self, base, *, topology=None, comm, broadcast_initial=True, overlap=False, bucket_mb=25.0):
        super().__init__(base, topology=topology, comm=comm, broadcast_initial=broadcast_initial)
        # every peer must hold gradients for the same parameters, or the messages would not match
        self.buckets = GradientBuckets(self.params(), comm, bucket_mb, overlap=bool(overlap))

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._closure_loss(closure)
        self.buckets.average()
        self.base.step()
        self.step_count += 1
        return loss
