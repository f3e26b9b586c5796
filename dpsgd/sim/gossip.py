"""A topology's mixing matrix W(k) as one (sparse) matrix product on stacked tensors, and what the
real communicators would have sent for it (dpsgd.sim.fleet's gossip)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

SPARSE_BELOW = 0.25  # density of W under which the product is taken with a sparse matrix


@dataclass(frozen=True)
class Mixing:
    """W(k) ready to apply: `matrix` (in the tensors' dtype), and per peer the number of
    peers it sends to (`sends`, off-diagonal nonzeros of its column) and receives from (`recvs`, of its row)."""

    matrix: torch.Tensor  # dense, or sparse (COO) when W has few nonzeros
    sends: torch.Tensor
    recvs: torch.Tensor

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """sum_j W[i, j] x_j for every peer i, x with a leading peer axis."""
        flat = x.reshape(x.shape[0], -1)
        out = torch.sparse.mm(self.matrix, flat) if self.matrix.is_sparse else self.matrix @ flat
        return out.reshape(x.shape)


def mixing(w: np.ndarray, dtype: torch.dtype, device) -> Mixing:
    w = np.asarray(w, dtype=np.float64)
    off = (w != 0) & ~np.eye(len(w), dtype=bool)
    sends = torch.as_tensor(off.sum(0), dtype=torch.float64)
    recvs = torch.as_tensor(off.sum(1), dtype=torch.float64)
    dense = torch.as_tensor(w, dtype=dtype, device=device)
    sparse = np.count_nonzero(w) < SPARSE_BELOW * w.size and device.type == "cpu"
    return Mixing(dense.to_sparse().coalesce() if sparse else dense, sends, recvs)
