"""PowerSGD (Vogels, Karimireddy, Jaggi, NeurIPS 2019): all-reduce of gradients compressed to rank r,
with error feedback and warm start, the rule of torch's DDP hook
(torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook) for one bucket holding every gradient.

Call t = 0, 1, ... of `allreduce_mean(tensors)` (one per optimizer step):
- t < start_iter: the exact mean (plain all-reduce).
- otherwise, with v the gradients as one flat vector, e the error memory (0 at the first such call):
  v <- v + e; each tensor of v is a matrix M of shape (shape[0], numel / shape[0]), n x m, with
  rank k = min(n, m, r); it is compressed when (n + m) k * min_compression_rate < n m, and the
  others (vectors, small matrices) are averaged exactly in one all-reduce.
  For the compressed ones, Q (m x k) is, on the first call or every call without warm start, drawn
  from a normal distribution (one seed per draw from numpy's RandomState(seed), every peer the same)
  and otherwise the previous call's Q; then
      Q <- orth(Q);  P <- M Q;  P <- sum_i P_i;  P <- orth(P);  Q <- M^T P;  Q <- (sum_i Q_i) / n
      M <- P Q^T
  orth: Gram-Schmidt (columns normalised by their norm plus `orthogonalization_epsilon`) for
  k <= 2, else the Q of torch.linalg.qr, as the hook does. With error feedback, e <- v_before - v_after
  (what this peer wanted minus the common result).
  Draws follow the order of the tensors grouped by shape (first-seen shape first), as the hook does;
  the caller passes the gradients in the order of DDP's bucket (see AllReduce).
Traffic: the all-reduces of the P's, the Q's and the exact tensors, counted by the communicator.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .base import Communicator, flatten, unflatten


def orthogonalize(matrix: torch.Tensor, epsilon: float = 0.0) -> None:
    """Orthonormalise the columns of `matrix` (m x k) in place, as the hook's `_orthogonalize`."""
    k = matrix.shape[1]
    if k > 2:
        matrix.copy_(torch.linalg.qr(matrix).Q)
        return
    for i in range(k):
        col = matrix[:, i : i + 1]
        col /= torch.norm(col, dim=0, keepdim=True) + epsilon
        if i + 1 < k:
            rest = matrix[:, i + 1 :]
            rest -= torch.sum(col * rest, dim=0, keepdim=True) * col


class PowerSGD:
    """Rank-r compressed all-reduce mean of gradients (see the module), with its error and Q memories."""

    def __init__(
        self,
        comm: Communicator,
        rank: int = 1,
        start_iter: int = 10,
        min_compression_rate: float = 2.0,
        error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0.0,
        seed: int = 0,
    ):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"PowerSGD rank (of the low-rank approximation) must be an integer >= 1, got {rank!r}")
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(
                f"PowerSGD start_iter (exact all-reduce steps first) must be an integer >= 0, got {start_iter!r}"
            )
        if comm.peer_shape:
            raise ValueError("PowerSGD runs on real peers (backend local, mpi or torch), not on the fleet")
        self.comm, self.rank, self.start_iter = comm, rank, start_iter
        self.min_compression_rate, self.error_feedback, self.warm_start = (
            float(min_compression_rate),
            bool(error_feedback),
            bool(warm_start),
        )
        self.epsilon, self.seed = float(orthogonalization_epsilon), int(seed)
        self.iter = 0
        self.rng = np.random.RandomState(self.seed)
        self.draws = 0  # seeds drawn from rng: its state, in a form a weights-only checkpoint keeps
        self.error: torch.Tensor | None = None
        self.q_memory: torch.Tensor | None = None

    def _matrices(self, views: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(matrices to compress, grouped by shape in first-seen order; tensors sent exactly)."""
        by_shape: dict[tuple[int, ...], list[torch.Tensor]] = {}
        exact = []
        for t in views:
            m = t.view(t.shape[0], -1) if t.dim() else t.view(1, 1)
            k = min(*m.shape, self.rank)
            if (m.shape[0] + m.shape[1]) * k * self.min_compression_rate < m.numel():
                by_shape.setdefault(tuple(m.shape), []).append(m)
            else:
                exact.append(t)
        return [m for group in by_shape.values() for m in group], exact

    def allreduce_mean(self, tensors: Sequence[torch.Tensor], stream: str = "allreduce") -> list[torch.Tensor]:
        if self.iter < self.start_iter:
            self.iter += 1
            return self.comm.allreduce_mean(tensors)
        v = flatten(tensors)
        if self.error_feedback:
            if self.error is None or self.error.shape != v.shape:
                self.error = torch.zeros_like(v)
            v += self.error
        wanted = v.clone()
        views = unflatten(v, tensors)
        matrices, exact = self._matrices(views)
        ks = [min(*m.shape, self.rank) for m in matrices]
        q_size = sum(m.shape[1] * k for m, k in zip(matrices, ks))
        fresh = not self.warm_start or self.q_memory is None or self.q_memory.numel() != q_size
        if fresh:
            self.q_memory = torch.empty(q_size, dtype=v.dtype, device=v.device)
        assert self.q_memory is not None
        qs, offset = [], 0
        for m, k in zip(matrices, ks):
            qs.append(self.q_memory[offset : offset + m.shape[1] * k].view(m.shape[1], k))
            offset += m.shape[1] * k
        if fresh:
            gen = torch.Generator().manual_seed(int(self.rng.randint(1_000_000_000)))
            self.draws += 1
            for q in qs:
                q.copy_(torch.randn(*q.shape, generator=gen, dtype=v.dtype))
        for q in qs:
            orthogonalize(q, self.epsilon)
        ps = [m @ q for m, q in zip(matrices, qs)]
        if exact:
            for t, mean in zip(exact, self.comm.allreduce_mean(exact)):
                t.copy_(mean)
        if ps:
            ps = self.comm.allreduce_sum(ps)
            for p in ps:
                orthogonalize(p, self.epsilon)
            new_qs = self.comm.allreduce_sum([m.t() @ p for m, p in zip(matrices, ps)])
            for q, new in zip(qs, new_qs):
                q.copy_(new).div_(self.comm.size)
            for m, p, q in zip(matrices, ps, qs):
                torch.matmul(p, q.t(), out=m)
        if self.error_feedback:
            self.error = wanted - v
        self.iter += 1
        return views

    def state(self) -> dict:
        def copy(t):
            return None if t is None else t.clone()

        return {
            "iter": self.iter,
            "draws": self.draws,
            "error": copy(self.error),
            "q_memory": copy(self.q_memory),
        }

    def load_state(self, state: dict | None) -> None:
        if not state:
            return
        self.iter = int(state["iter"])
        self.rng, self.draws = np.random.RandomState(self.seed), int(state["draws"])
        for _ in range(self.draws):
            self.rng.randint(1_000_000_000)
        self.error = None if state["error"] is None else state["error"].detach().clone()
        self.q_memory = None if state["q_memory"] is None else state["q_memory"].detach().clone()

    def __repr__(self) -> str:
        return (
            f"PowerSGD(rank={self.rank}, start_iter={self.start_iter}, error_feedback={self.error_feedback}, "
            f"warm_start={self.warm_start})"
        )
