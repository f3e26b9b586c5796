"""Custom topologies: from a matrix (or a periodic list of matrices) or from a networkx graph."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .base import Topology
from .graphs import weighted
from .matrices import is_sparse

__all__ = ["from_matrix", "from_networkx"]


def from_matrix(w, *, directed: bool = False, name: str = "custom") -> Topology:
    """A topology from one (n, n) mixing matrix (static) or a list of them (repeated periodically).

    Row i holds the weights peer i gives to what it receives. Validated like every topology:
    non-negative, doubly stochastic (directed=False) or column stochastic (directed=True, push-sum),
    and connected (jointly over the period). A scipy.sparse matrix (or a list of them) is kept sparse.
    """
    if is_sparse(w) or (isinstance(w, (list, tuple)) and w and all(is_sparse(m) for m in w)):
        return Topology(name, [w] if is_sparse(w) else list(w), directed=directed)
    try:
        arr = np.asarray(w, dtype=np.float64)
    except ValueError as err:
        raise ValueError(f"{name}: expected an (n, n) matrix or a list of (n, n) matrices ({err})") from None
    if arr.ndim == 2:
        return Topology(name, [arr], directed=directed)
    if arr.ndim == 3:
        return Topology(name, list(arr), directed=directed)
    raise ValueError(f"{name}: expected an (n, n) matrix or a list of (n, n) matrices; got shape {arr.shape}")


def from_networkx(
    graph,
    weights: str | Callable[[np.ndarray], np.ndarray] | None = None,
    *,
    self_weight: float | None = None,
    name: str = "custom",
) -> Topology:
    """A static topology from a networkx graph whose nodes are 0..n-1 (self loops are ignored).

    Undirected graph: `weights` names a scheme of `topologies.weights` ("metropolis_hastings", the
    default, "uniform", "max_degree") or is a function adjacency -> W; or `self_weight` fixes every
    peer's self weight (regular graphs). Directed graph (an edge u -> v: u sends to v): a push-sum
    topology where each sender keeps `self_weight` (default: an even share, weights="uniform") and
    splits the rest evenly over its receivers, or `weights` is a function adjacency -> W with
    adjacency[i, j] meaning j sends to i.
    """
    n = graph.number_of_nodes()
    if sorted(graph.nodes) != list(range(n)):
        raise ValueError(
            f"{name}: the graph's nodes must be the integers 0..{n - 1} (peer ranks); relabel them with "
            "networkx.convert_node_labels_to_integers(G)"
        )
    sends = np.zeros((n, n), dtype=bool)  # sends[u, v]: u sends to v
    for u, v in graph.edges():
        sends[u, v] = True
    np.fill_diagonal(sends, False)
    if callable(weights):
        links = sends.T | sends if not graph.is_directed() else sends.T
        return Topology(name, [weights(links)], directed=graph.is_directed())
    if not graph.is_directed():
        return weighted(name, sends | sends.T, weights=weights, self_weight=self_weight)
    if weights not in (None, "uniform"):
        raise ValueError(
            f"{name}: a directed graph takes weights='uniform' or a function adjacency -> W; got {weights!r}"
        )
    out = sends.sum(axis=1)
    keep = 1.0 / (out + 1.0) if self_weight is None else np.where(out > 0, float(self_weight), 1.0)
    w = np.where(sends.T, (1.0 - keep) / np.maximum(out, 1), 0.0)
    np.fill_diagonal(w, keep)
    return Topology(name, [w], directed=True)
