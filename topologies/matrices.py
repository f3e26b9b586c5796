"""Mixing matrices dense or sparse: which form a topology of n peers keeps, and the few operations the
package needs on either.

Up to `DENSE_UP_TO` peers a mixing matrix is a dense float64 numpy array, as it always was. Above, the
builders make it a scipy.sparse CSR array: a topology of 8,192 peers would otherwise hold 512 MiB per
matrix of its period for about two nonzeros per row. Sparse matrices here are canonical: float64 (or bool
for links), duplicates summed, explicit zeros dropped, column indices sorted within each row, so their
nonzeros come out in the row-major order of `numpy.nonzero` on the dense form.
"""

from __future__ import annotations

import numpy as np
from scipy import sparse

__all__ = ["DENSE_UP_TO", "canonical", "entries", "from_entries", "is_sparse", "is_symmetric", "positive", "union"]

DENSE_UP_TO = 1024  # above this many peers the builders make sparse matrices


def is_sparse(w) -> bool:
    return sparse.issparse(w)


def canonical(w, dtype=np.float64) -> sparse.csr_array:
    """A fresh CSR copy of `w` (dense or sparse) in `dtype`, duplicates summed, zeros dropped, indices sorted."""
    out = sparse.csr_array(w, dtype=dtype, copy=True)
    out.sum_duplicates()
    out.eliminate_zeros()
    out.sort_indices()
    return out


def from_entries(n: int, rows, cols, values, *, dense: bool | None = None):
    """The (n, n) matrix with `values` at (rows, cols) (repeated positions add up): dense up to DENSE_UP_TO
    peers (or when `dense` says so), sparse above."""
    rows, cols = np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64)
    values = np.broadcast_to(np.asarray(values), rows.shape)
    if dense if dense is not None else n <= DENSE_UP_TO:
        out = np.zeros((n, n), dtype=values.dtype)
        np.add.at(out, (rows, cols), values)
        return out
    return canonical(sparse.coo_array((values, (rows, cols)), shape=(n, n)), dtype=values.dtype)


def entries(w) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, cols, values) of w's nonzeros in row-major order, for a dense or a canonical sparse matrix."""
    if is_sparse(w):
        coo = w.tocoo()
        return coo.row.astype(np.int64), coo.col.astype(np.int64), coo.data
    rows, cols = np.nonzero(w)
    return rows, cols, w[rows, cols]


def positive(w) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols) of w's positive entries, row-major."""
    rows, cols, values = entries(w)
    keep = values > 0
    return rows[keep], cols[keep]


def union(a, b):
    """The links of a or b: bool matrices, sparse if either is."""
    if is_sparse(a) or is_sparse(b):
        return canonical(canonical(a, bool) + canonical(b, bool), bool)
    return a | b


def is_symmetric(w) -> bool:
    if is_sparse(w):
        return (w != w.T).nnz == 0
    return bool(np.array_equal(w, w.T))
