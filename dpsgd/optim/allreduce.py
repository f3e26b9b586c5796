"""AllReduce: all-reduce data parallelism, as DDP does it; see `AllReduce`."""

from __future__ import annotations

import torch

from .base import DistributedOptimizer
from .buckets import GradientBuckets


class AllReduce(DistributedOptimizer):
    """All-reduce data parallelism: g = mean_j g_j, then the base step on every peer (large-batch SGD).

    Every peer stays identical, as under DDP; with equal local batches this is large-batch SGD on the union
    of the batches. Exact gradients travel as buckets of at most `bucket_mb` MiB (dpsgd.optim.buckets), last
    parameter first (the order of the backward pass, and of DDP's buckets); `overlap=True` starts each
    bucket's all-reduce from gradient hooks as soon as the backward pass has filled it, as DDP's reducer
    does. With a compressing communicator (`compression=`, dpsgd.comm.codecs) the gradients travel as one
    encoded, error-fed mean of all of them after the backward pass, last parameter first (so PowerSGD draws
    the factors torch's hook draws for DDP's one bucket). The topology is accepted, and ignored, so that
    configs can swap algorithms. Bytes per step: a ring all-reduce of the gradients, 2 (n - 1) / n of the
    model.
    """

    uses_topology = False
    elastic = True
    label = "all-reduce"
    knobs = {}
    cost_form = "allreduce"

    def __init__(self, base: torch.optim.Optimizer, *, overlap: bool = False, bucket_mb: float = 25.0, **common):
        super().__init__(base, **common)
        comm = self.comm
        exact = comm.exact is comm
        if overlap and not exact:
            raise ValueError(
                "AllReduce overlap=true all-reduces exact gradient buckets during the backward pass, but "
                "compressed gradients are encoded together after it: use compression=none or overlap=false"
            )
        # every peer must hold gradients for the same parameters, or the messages would not match
        self.bucket_mb = bucket_mb
        self.buckets = GradientBuckets(self.params(), comm, bucket_mb, overlap=bool(overlap)) if exact else None

    def param_group_added(self, params: list[torch.Tensor]) -> None:
        if self.buckets is not None:  # the buckets cover every parameter: planned again
            overlap = self.buckets.overlapped
            self.buckets.remove()
            self.buckets = GradientBuckets(self.params(), self.comm, self.bucket_mb, overlap=overlap)

    def check_grad_scaler(self) -> None:
        if self.buckets is not None and self.buckets.overlapped:
            raise ValueError(
                "AllReduce(overlap=True) all-reduces gradients during the backward pass, before a GradScaler has "
                "unscaled and checked them (and each peer's scale is its own): use overlap=false with a GradScaler"
            )

    def update(self) -> None:
        if self.buckets is not None:
            self.buckets.average()
        else:
            grads = [p.grad for p in reversed(self.params()) if p.grad is not None]  # DDP's bucket order
            if grads:
                for g, avg in zip(grads, self.comm.allreduce_mean(grads, stream="gradients")):
                    g.copy_(avg)
        self.base.step()
        self.step_count += 1
