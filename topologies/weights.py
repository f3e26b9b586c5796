"""Mixing weights: turn a graph's adjacency matrix into a mixing matrix W.

Every function takes a square boolean-like adjacency matrix (the diagonal is ignored) and returns
a float64 matrix whose row i holds the weights peer i gives to what it receives. For an
undirected graph `adjacency[i, j]` means i and j are linked; for `column_uniform` (directed
graphs) it means j sends to i. A scipy.sparse adjacency gives a sparse W (topologies.matrices), with the same
weights up to the rounding of the self weights' sums.
"""

from __future__ import annotations

import numpy as np

from . import options
from .matrices import canonical, entries, from_entries, is_sparse

__all__ = ["SCHEMES", "column_uniform", "max_degree", "metropolis_hastings", "self_weighted", "uniform"]


def _links(adjacency, *, symmetric: bool):
    """The adjacency as a bool matrix without self loops, checked for shape (and symmetry)."""
    if is_sparse(adjacency):
        return _sparse_links(adjacency, symmetric=symmetric)
    a = np.asarray(adjacency)
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"an adjacency matrix must be square (n, n); got shape {a.shape}")
    a = a != 0
    np.fill_diagonal(a, False)
    if symmetric and not np.array_equal(a, a.T):
        i, j = np.argwhere(a != a.T)[0]
        raise ValueError(
            f"this weight scheme needs an undirected graph, but adjacency[{i}, {j}] != adjacency[{j}, {i}]; "
            "symmetrize it (A | A.T) or use column_uniform for a directed graph"
        )
    return a


def _sparse_links(adjacency, *, symmetric: bool):
    """_links of a sparse adjacency: a canonical bool CSR array."""
    a = canonical(adjacency, bool)
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"an adjacency matrix must be square (n, n); got shape {a.shape}")
    rows, cols, _ = entries(a)
    off = rows != cols
    a = from_entries(a.shape[0], rows[off], cols[off], True, dense=False)
    if symmetric:
        rows, cols, _ = entries(canonical(a != a.T, bool))
        if rows.size:
            raise ValueError(
                f"this weight scheme needs an undirected graph, but adjacency[{rows[0]}, {cols[0]}] != "
                f"adjacency[{cols[0]}, {rows[0]}]; symmetrize it (A | A.T) or use column_uniform for a directed graph"
            )
    return a


def _on_links(a, values):
    """A sparse float64 matrix with `values` (one per link of the sparse a, row-major) on a's links."""
    rows, cols, _ = entries(a)
    return from_entries(a.shape[0], rows, cols, np.asarray(values, dtype=np.float64), dense=False)


def _degrees(a, axis: int = 1) -> np.ndarray:
    return np.asarray(a.sum(axis=axis)).astype(np.int64)


def _with_self_weights(off_diagonal):
    """Fill the diagonal so that every row sums to 1."""
    if is_sparse(off_diagonal):
        n = off_diagonal.shape[0]
        rows, cols, values = entries(off_diagonal)
        off = rows != cols
        own = 1.0 - np.bincount(rows[off], weights=values[off], minlength=n)
        diag = np.arange(n)
        return from_entries(n, np.r_[rows[off], diag], np.r_[cols[off], diag], np.r_[values[off], own], dense=False)
    w = off_diagonal.astype(np.float64)
    np.fill_diagonal(w, 0.0)
    np.fill_diagonal(w, 1.0 - w.sum(axis=1))
    return w


def metropolis_hastings(adjacency) -> np.ndarray:
    """W[i, j] = 1 / (1 + max(deg i, deg j)) on each link; symmetric and doubly stochastic on any graph."""
    a = _links(adjacency, symmetric=True)
    deg = a.sum(axis=1)
    if is_sparse(a):
        rows, cols, _ = entries(a)
        deg = _degrees(a)
        return _with_self_weights(_on_links(a, 1.0 / (1.0 + np.maximum(deg[rows], deg[cols]))))
    return _with_self_weights(np.where(a, 1.0 / (1.0 + np.maximum.outer(deg, deg)), 0.0))


def uniform(adjacency) -> np.ndarray:
    """W[i, j] = 1 / (deg i + 1) for each neighbour j and for i itself.

    Row stochastic always; doubly stochastic only on a regular graph (every peer the same degree),
    which validation checks when the matrix becomes a topology.
    """
    a = _links(adjacency, symmetric=True)
    if is_sparse(a):
        return _with_self_weights(_on_links(a, 1.0 / (_degrees(a)[entries(a)[0]] + 1.0)))
    w = np.where(a, 1.0 / (a.sum(axis=1, keepdims=True) + 1.0), 0.0)
    return _with_self_weights(w)


def max_degree(adjacency) -> np.ndarray:
    """W[i, j] = 1 / (d_max + 1) on each link, where d_max is the largest degree; doubly stochastic."""
    a = _links(adjacency, symmetric=True)
    d_max = int(a.sum(axis=1).max(initial=0))
    if is_sparse(a):
        return _with_self_weights(_on_links(a, 1.0 / (d_max + 1.0)))
    return _with_self_weights(np.where(a, 1.0 / (d_max + 1.0), 0.0))


def self_weighted(adjacency, self_weight: float) -> np.ndarray:
    """W[i, i] = self_weight and the rest, 1 - self_weight, split evenly over the neighbours.

    Doubly stochastic only when every peer has the same degree, so other graphs are refused.
    """
    s = options.self_weight("self_weighted", self_weight)
    a = _links(adjacency, symmetric=True)
    deg = a.sum(axis=1)
    if deg.size and deg.min() != deg.max():
        raise ValueError(
            f"an explicit self_weight needs every peer to have the same degree, but degrees range from "
            f"{deg.min()} to {deg.max()}; use weights='metropolis_hastings' or 'max_degree' for this graph"
        )
    d = int(deg[0]) if deg.size else 0
    if d == 0:
        n = a.shape[0]
        return np.eye(n) if not is_sparse(a) else from_entries(n, np.arange(n), np.arange(n), 1.0, dense=False)
    if is_sparse(a):
        n = a.shape[0]
        rows, cols, _ = entries(a)
        values = np.r_[np.full(rows.size, (1.0 - s) / d), np.full(n, s)]
        return from_entries(n, np.r_[rows, np.arange(n)], np.r_[cols, np.arange(n)], values, dense=False)
    w = np.where(a, (1.0 - s) / d, 0.0)
    np.fill_diagonal(w, s)
    return w


def column_uniform(adjacency) -> np.ndarray:
    """Directed graphs (adjacency[i, j]: j sends to i): each sender splits its value evenly over
    itself and its receivers, W[i, j] = 1 / (out-degree of j + 1). Column stochastic, for push-sum."""
    a = _links(adjacency, symmetric=False)
    if is_sparse(a):
        n, share = a.shape[0], 1.0 / (_degrees(a, axis=0) + 1.0)
        rows, cols, _ = entries(a)
        diag = np.arange(n)
        return from_entries(n, np.r_[rows, diag], np.r_[cols, diag], np.r_[share[cols], share], dense=False)
    w = np.where(a, 1.0 / (a.sum(axis=0, keepdims=True) + 1.0), 0.0)
    np.fill_diagonal(w, 1.0 / (a.sum(axis=0) + 1.0))
    return w


# The schemes a builder accepts by name (`weights="..."`), undirected graphs only.
SCHEMES = {"metropolis_hastings": metropolis_hastings, "uniform": uniform, "max_degree": max_degree}
