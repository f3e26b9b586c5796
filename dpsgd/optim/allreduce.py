"""AllReduce: average the gradients over all peers, then take the base step. Every peer stays
identical; with equal local batches this is large-batch SGD on the union of the batches.

Exact gradients travel as buckets of at most `bucket_mb` MiB (dpsgd.optim.buckets), last parameter
first (the order of the backward pass, and of DDP's buckets); with `overlap=True` each bucket's
all-reduce starts as soon as the backward pass has filled it, as DDP's does.

`compression` (dpsgd.comm.compression): the gradients travel as PowerSGD's low-rank factors or as
fp16/bf16/int8 messages, with error feedback, encoded together after the backward pass; every peer
still gets the same mean, so all stay identical."""

from __future__ import annotations

import torch

from dpsgd.comm import Communicator
from dpsgd.comm import compression as compressions
from topologies import Topology

from .base import DistributedOptimizer
from .buckets import GradientBuckets


class AllReduce(DistributedOptimizer):
    """All-reduce data parallelism: g = mean_j g_j, then the base step on every peer (large-batch SGD).

    Every peer stays identical, as under DDP. `overlap=True` all-reduces the gradients in buckets of
    `bucket_mb` MiB from gradient hooks during the backward pass, as DDP's reducer does. The topology is
    accepted, and ignored, so that configs can swap algorithms. Bytes per step: a ring all-reduce of the
    gradients, 2 (n - 1) / n of the model.
    """

    uses_topology = False

    elastic = True

    def __init__(
        self,
        base: torch.optim.Optimizer,
        *,
        topology: Topology | None = None,
        comm: Communicator,
        broadcast_initial: bool = True,
        compression: str | dict | None = None,
        overlap: bool = False,
        bucket_mb: float = 25.0,
    ):
        super().__init__(base, topology=topology, comm=comm, broadcast_initial=broadcast_initial)
        self.messages = compressions.make(comm, compression, who="AllReduce")
        exact = isinstance(self.messages, compressions.Messages) and self.messages.codec is None
        if overlap and not exact:
            raise ValueError(
                "AllReduce overlap=true all-reduces exact gradient buckets during the backward pass, but "
                "compressed gradients are encoded together after it: use compression=none or overlap=false"
            )
        # every peer must hold gradients for the same parameters, or the messages would not match
        self.buckets = GradientBuckets(self.params(), comm, bucket_mb, overlap=bool(overlap)) if exact else None

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._closure_loss(closure)
        if self.buckets is not None:
            self.buckets.average()
        else:
            # last parameter first: the order DDP's bucket holds them in (the backward pass's), so
            # PowerSGD draws the same random factors as torch's hook
            grads = [p.grad for p in reversed(self.params()) if p.grad is not None]
            if grads:
                for g, avg in zip(grads, self.messages.allreduce_mean(grads, "gradients")):
                    g.copy_(avg)
        self.base.step()
        self.step_count += 1
        return loss

    def algorithm_state(self):
        return {**super().algorithm_state(), "compression": self.messages.state()}

    def load_algorithm_state(self, state):
        super().load_algorithm_state(state)
        self.messages.load_state(state.get("compression"))
