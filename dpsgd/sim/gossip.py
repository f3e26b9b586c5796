"""A topology's mixing matrix W(k) as one (sparse) matrix product on stacked tensors, and what the
real communicators would have sent for it: the fleet's whole communication layer."""

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
    if np.count_nonzero(w) < SPARSE_BELOW * w.size and device.type == "cpu":
        return Mixing(dense.to_sparse().coalesce(), sends, recvs)
    return Mixing(dense, sends, recvs)


class Gossip:
    """W(k) of a topology for every step k, built once per step of its period (each step for random
    schedules); `transform` may change a matrix (e.g. D^2's lazy (I + W) / 2) before it is used."""

    def __init__(self, topology, dtype: torch.dtype, device, transform=None):
        self.topology, self.dtype, self.device, self.transform = topology, dtype, torch.device(device), transform
        self._cache: dict[int, Mixing] = {}

    def at(self, step: int) -> Mixing:
        period = self.topology.period
        key = step % period if period else None
        if key is not None and key in self._cache:
            return self._cache[key]
        w = self.topology.mixing_matrix(step)
        if self.transform is not None:
            w = self.transform(w, step)
        m = mixing(w, self.dtype, self.device)
        if key is not None:
            self._cache[key] = m
        return m
