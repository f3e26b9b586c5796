"""Gradients averaged bucket by bucket while the backward pass is still running, as DDP does.

How it works: docs/guide/internals.md#buckets.
"""

from __future__ import annotations

import torch

from dpsgd.comm import Communicator, Handle
from dpsgd.comm.base import unflatten


def plan_buckets(params: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive parameters packed into buckets of at most `bucket_bytes` (a larger tensor alone);
    a bucket never mixes dtypes or devices, since it travels as one flat message."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        last = buckets[-1] if buckets else None
        if last is None or size + nbytes > bucket_bytes or (last[0].dtype, last[0].device) != (p.dtype, p.device):
            buckets.append([p])
            size = nbytes
        else:
            last.append(p)
            size += nbytes
    return buckets


class GradientBuckets:
    """`overlap=False`: no hooks, every bucket starts in `average()` (all in flight at once)."""

    def __init__(self, params: list[torch.Tensor], comm: Communicator, bucket_mb: float, overlap: bool):
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0 MiB, got {bucket_mb}")
        self.comm = comm
        trainable = [p for p in params if p.requires_grad]
        self.buckets = plan_buckets(trainable[::-1], int(bucket_mb * 2**20))
        self._bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket}
        self._arrived = [0] * len(self.buckets)
        self._handles: list[Handle | None] = [None] * len(self.buckets)
        in_place = not comm.peer_shape  # stacked tensors (the fleet's): the list path
        self._flat = [
            torch.empty(sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
            if in_place
            else None
            for bucket in self.buckets
        ]
        self._views = [
            unflatten(flat, bucket) if flat is not None else [] for flat, bucket in zip(self._flat, self.buckets)
        ]
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in trainable] if overlap else []
        self.overlapped = bool(overlap)

    def _on_gradient(self, p: torch.Tensor) -> None:
        b = self._bucket_of[id(p)]
        if self._handles[b] is not None:
            raise RuntimeError(
                "AllReduce(overlap=True) averages each gradient as the backward pass produces it, so a "
                "second backward before step() would be averaged twice: call step() after every backward, "
                "or use overlap=false to accumulate gradients over several backward passes"
            )
        self._arrived[b] += 1
        if self._arrived[b] == len(self.buckets[b]) and not self._modelled_network():
            self._start(b)
        for handle in self._handles:  # MPI moves a started bucket only while it is tested
            if handle is not None:
                handle.progress()

    def _modelled_network(self) -> bool:
        """An emulated network in `model` mode advances its clock by the whole computation at the end
        of the backward pass, so a bucket started inside it would be stamped as if it had started
        before any gradient existed: there, buckets start after the backward pass (no overlap credited)."""
        net = self.comm.network
        return net is not None and net.active and net.clock.mode == "model"

    @torch.no_grad()
    def _start(self, b: int) -> None:
        grads = [p.grad for p in self.buckets[b] if p.grad is not None]
        if not grads:  # a bucket with no gradient at all sends nothing (on every peer alike)
            return
        flat = self._flat[b]
        if flat is None:
            self._handles[b] = self.comm.start_allreduce_sum(grads)
            return
        for p, view in zip(self.buckets[b], self._views[b]):
            if p.grad is None:
                view.zero_()  # the same parameter has no gradient on any peer: it stays None
            elif p.grad.data_ptr() == view.data_ptr():
                view.div_(self.comm.size)  # zero_grad(set_to_none=False) left the view: backward summed into it
            else:
                torch.div(p.grad, self.comm.size, out=view)
        self._handles[b] = self.comm.start_allreduce_sum_(flat)

    @torch.no_grad()
    def average(self) -> None:
        """Every gradient replaced by its average over the peers."""
        for b, handle in enumerate(self._handles):
            if handle is None:
                self._start(b)
        for b, handle in enumerate(self._handles):
            if handle is None:
                continue
            if self._flat[b] is None:
                grads = [p.grad for p in self.buckets[b] if p.grad is not None]
                for g, total in zip(grads, handle.wait()):
                    torch.div(total, self.comm.size, out=g)  # the mean written in one pass
                continue
            handle.wait()  # the bucket now holds the mean
            for p, view in zip(self.buckets[b], self._views[b]):
                if p.grad is not None:
                    p.grad = view
        self._arrived = [0] * len(self.buckets)
        self._handles = [None] * len(self.buckets)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
