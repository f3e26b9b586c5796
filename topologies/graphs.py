"""Static undirected topologies: a graph's links, weighted into one symmetric doubly stochastic W.

Each builder takes n and keyword options and returns a `Topology` of period 1. The weights are
Metropolis-Hastings unless `weights` names another scheme of `topologies.weights`, or
`self_weight` fixes every peer's self weight (regular graphs only). Above `matrices.DENSE_UP_TO` peers the
sparse graphs (all but complete) build W as a sparse matrix (erdos_renyi still draws its links densely).
"""

from __future__ import annotations

import math
import numbers
import random

import numpy as np
from scipy import sparse

from . import matrices, options
from .base import Topology
from .matrices import entries, from_entries
from .weights import SCHEMES, self_weighted

__all__ = [
    "complete",
    "erdos_renyi",
    "exponential",
    "exponential_hops",
    "exponential_links",
    "hierarchical",
    "hypercube",
    "random_regular",
    "ring",
    "ring_links",
    "star",
    "torus",
    "weighted",
]

_TRIES = 1000  # draws of a random graph before giving up on connectivity


def weighted(name: str, links: np.ndarray, *, weights: str | None, self_weight: float | None, **resolved) -> Topology:
    """A static topology from a symmetric bool adjacency matrix and a weight choice; `resolved` records
    the options whose defaults the builder worked out (the torus shape, a random graph's p and seed)."""
    if weights is not None and self_weight is not None:
        raise ValueError(f"{name}: give weights or self_weight, not both")
    if self_weight is not None:
        return Topology(name, [self_weighted(links, options.self_weight(name, self_weight))], options=resolved)
    scheme = weights or "metropolis_hastings"
    if scheme not in SCHEMES:
        raise ValueError(f"{name}: unknown weights {scheme!r}; choose one of {', '.join(SCHEMES)}")
    return Topology(name, [SCHEMES[scheme](links)], options=resolved)


def _large(n: int) -> bool:
    return n > matrices.DENSE_UP_TO


def _sparse_links(n: int, rows, cols):
    """The symmetric sparse links i ~ j for each (rows[k], cols[k]), self loops left out."""
    rows, cols = np.concatenate([rows, cols]), np.concatenate([cols, rows])
    off = rows != cols
    return from_entries(n, rows[off], cols[off], True, dense=False)


def _offsets(n: int, offsets):
    """Circulant links: i ~ i + o (mod n) for each offset o."""
    if _large(n):
        idx = np.arange(n)
        return _sparse_links(n, np.tile(idx, len(offsets)), np.concatenate([(idx + o) % n for o in offsets]))
    links = np.zeros((n, n), dtype=bool)
    idx = np.arange(n)
    for o in offsets:
        links[idx, (idx + o) % n] = True
        links[(idx + o) % n, idx] = True
    np.fill_diagonal(links, False)
    return links


def ring_links(n: int):
    """i ~ i + 1 (mod n)."""
    return _offsets(n, [1] if n > 1 else [])


def exponential_hops(n: int) -> list[int]:
    """2^k for every 2^k < n: the offsets of exponential graphs."""
    return [2**k for k in range((n - 1).bit_length())] if n > 1 else []


def exponential_links(n: int):
    """i ~ i + 2^k (mod n), hence also i ~ i - 2^k, for every 2^k < n."""
    return _offsets(n, exponential_hops(n))


def complete(n: int, *, weights: str | None = None, self_weight: float | None = None) -> Topology:
    """Every peer linked to every other (W = J = 11^T / n with the default weights)."""
    links = ~np.eye(n, dtype=bool)
    return weighted("complete", links, weights=weights, self_weight=self_weight)


def ring(n: int, *, weights: str | None = None, self_weight: float | None = None) -> Topology:
    """Peer i linked to i - 1 and i + 1 (mod n); weights 1/3 for n >= 3."""
    return weighted("ring", ring_links(n), weights=weights, self_weight=self_weight)


def _torus_shape(n: int, rows: int | None, cols: int | None) -> tuple[int, int]:
    rows = None if rows is None else options.count("torus", "rows", rows, 1)
    cols = None if cols is None else options.count("torus", "cols", cols, 1)
    if rows is None and cols is None:
        rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
        if rows == 1 and n > 3:
            raise ValueError(
                f"torus with n={n}: {n} is prime, so its only shape is 1 x {n} (a ring); pass rows=1 to "
                "accept that, use 'ring', or choose a composite n (e.g. 16 = 4 x 4)"
            )
        return rows, n // rows
    if rows is not None and cols is not None:
        if rows * cols != n:
            raise ValueError(f"torus: rows x cols must equal n; got {rows} x {cols} = {rows * cols} for n={n}")
        return rows, cols
    given = rows if rows is not None else cols
    assert given is not None  # both None is handled above
    if n % given:
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        raise ValueError(f"torus: {given} does not divide n={n}; valid rows or cols: {divisors}")
    return (given, n // given) if rows is not None else (n // given, given)


def torus(
    n: int,
    *,
    rows: int | None = None,
    cols: int | None = None,
    weights: str | None = None,
    self_weight: float | None = None,
) -> Topology:
    """2-D torus: peer (r, c) = r * cols + c linked to its four grid neighbours, wrapping around.
    Shape from rows and/or cols, or the most square factorization of n."""
    rows, cols = _torus_shape(n, rows, cols)
    grid = np.arange(n).reshape(rows, cols)
    if _large(n):
        shifted = [np.roll(grid, shift, axis=axis).ravel() for axis in (0, 1) for shift in (1, -1)]
        links = _sparse_links(n, np.tile(grid.ravel(), 4), np.concatenate(shifted))
        return weighted("torus", links, weights=weights, self_weight=self_weight, rows=rows, cols=cols)
    links = np.zeros((n, n), dtype=bool)
    for axis in (0, 1):
        for shift in (1, -1):
            links[grid.ravel(), np.roll(grid, shift, axis=axis).ravel()] = True
    np.fill_diagonal(links, False)
    return weighted("torus", links, weights=weights, self_weight=self_weight, rows=rows, cols=cols)


def hypercube(n: int, *, weights: str | None = None, self_weight: float | None = None) -> Topology:
    """n = 2^d peers; i linked to i XOR 2^k for k < d."""
    if n & (n - 1):
        raise ValueError(
            f"hypercube needs n a power of 2 (1, 2, 4, 8, 16, ...); got n={n}; use 'exponential' for any n"
        )
    idx = np.arange(n)
    if _large(n):
        hops = range(n.bit_length() - 1)
        links = _sparse_links(n, np.tile(idx, len(hops)), np.concatenate([idx ^ (1 << k) for k in hops]))
        return weighted("hypercube", links, weights=weights, self_weight=self_weight)
    links = np.zeros((n, n), dtype=bool)
    for k in range(n.bit_length() - 1):
        links[idx, idx ^ (1 << k)] = True
    return weighted("hypercube", links, weights=weights, self_weight=self_weight)


def exponential(n: int, *, weights: str | None = None, self_weight: float | None = None) -> Topology:
    """Static symmetric exponential graph: i linked to i +- 2^k (mod n) for every 2^k < n."""
    return weighted("exponential", exponential_links(n), weights=weights, self_weight=self_weight)


def star(n: int, *, weights: str | None = None, self_weight: float | None = None) -> Topology:
    """Peer 0 linked to every other peer (a parameter server drawn as a graph)."""
    if _large(n):
        links = _sparse_links(n, np.zeros(n - 1, dtype=np.int64), np.arange(1, n))
        return weighted("star", links, weights=weights, self_weight=self_weight)
    links = np.zeros((n, n), dtype=bool)
    links[0, 1:] = links[1:, 0] = True
    return weighted("star", links, weights=weights, self_weight=self_weight)


def _is_connected(links: np.ndarray) -> bool:
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import connected_components

    return connected_components(csr_matrix(links), directed=False)[0] == 1


def erdos_renyi(
    n: int,
    *,
    p: float | None = None,
    seed: int = 0,
    weights: str | None = None,
    self_weight: float | None = None,
) -> Topology:
    """Each pair linked with probability p (default 2 ln(n) / n); redrawn, from the same seeded
    generator, until the graph is connected."""
    if p is None:
        p = min(1.0, 2.0 * math.log(n) / n) if n > 1 else 1.0
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 < p <= 1.0:
        raise ValueError(f"erdos_renyi: p must be a number in (0, 1]; got p={p!r}")
    rng = np.random.default_rng(options.count("erdos_renyi", "seed", seed, 0))
    upper = np.triu(np.ones((n, n), dtype=bool), k=1)
    for _ in range(_TRIES):
        links = upper & (rng.random((n, n)) < p)
        links |= links.T
        if _is_connected(links):
            links = sparse.csr_array(links) if _large(n) else links  # the draw is dense; W need not be
            return weighted("erdos_renyi", links, weights=weights, self_weight=self_weight, p=p, seed=seed)
    raise ValueError(
        f"erdos_renyi with n={n}, p={p}: no connected graph in {_TRIES} draws; raise p above the "
        f"connectivity threshold ln(n)/n = {math.log(n) / n:.3g}"
    )


def random_regular(
    n: int,
    *,
    d: int | None = None,
    seed: int = 0,
    weights: str | None = None,
    self_weight: float | None = None,
) -> Topology:
    """A uniformly random connected d-regular graph (default d = min(4, n - 1)), seeded."""
    import networkx as nx

    d = min(4, n - 1) if d is None else options.count("random_regular", "d", d, 0)
    if not 0 <= d < n or (n * d) % 2 or (d == 0 and n > 1) or (d == 1 and n > 2):
        raise ValueError(
            f"random_regular: no connected {d}-regular graph on n={n} peers; "
            "it needs 0 <= d < n, n * d even, and d >= 2 once n > 2"
        )
    rand = random.Random(options.count("random_regular", "seed", seed, 0))
    for _ in range(_TRIES):
        graph = nx.random_regular_graph(d, n, seed=rand)
        if _large(n):
            links = matrices.canonical(nx.to_scipy_sparse_array(graph, nodelist=range(n)), bool)
        else:
            links = nx.to_numpy_array(graph, nodelist=range(n)) > 0
        if _is_connected(links):
            return weighted("random_regular", links, weights=weights, self_weight=self_weight, d=d, seed=seed)
    raise ValueError(f"random_regular: no connected {d}-regular graph on n={n} in {_TRIES} draws; raise d")


def hierarchical(
    n: int,
    *,
    group_size: int | None = None,
    across: str = "exponential",
    weights: str | None = None,
    self_weight: float | None = None,
) -> Topology:
    """Groups of `group_size` consecutive peers (one machine's GPUs), fully connected inside; peer r of
    each group linked to peer r of other groups by a ring or an exponential graph over the groups.
    Default group_size: the largest of 8, 4, 2, 1 that divides n."""
    if group_size is None:
        group_size = next(g for g in (8, 4, 2, 1) if n % g == 0)
    group_size = options.count("hierarchical", "group_size", group_size, 1)
    if group_size > n or n % group_size:
        divisors = [g for g in range(1, n + 1) if n % g == 0]
        raise ValueError(f"hierarchical: group_size must divide n={n}; valid group sizes: {divisors}")
    across_links = {"ring": ring_links, "exponential": exponential_links}
    if across not in across_links:
        raise ValueError(f"hierarchical: across must be one of {', '.join(across_links)}; got {across!r}")
    groups = n // group_size
    if _large(n):
        block = sparse.kron(sparse.eye_array(groups), np.ones((group_size, group_size)))
        across_groups = sparse.kron(across_links[across](groups), sparse.eye_array(group_size))
        rows, cols, _ = entries(matrices.canonical(block + across_groups, bool))
        links = _sparse_links(n, rows, cols)
        return weighted(
            "hierarchical", links, weights=weights, self_weight=self_weight, group_size=group_size, across=across
        )
    inside = np.kron(np.eye(groups, dtype=bool), np.ones((group_size, group_size), dtype=bool))
    between = np.kron(across_links[across](groups), np.eye(group_size, dtype=bool))
    links = inside | between
    np.fill_diagonal(links, False)
    return weighted(
        "hierarchical", links, weights=weights, self_weight=self_weight, group_size=group_size, across=across
    )
