"""`Topology` and `Neighbors`: a schedule of mixing matrices, validated once, read by the peers.

A topology is a sequence of mixing matrices W(0), W(1), ... over n peers. Row i of W(t) holds the
weights peer i gives at step t to the values it receives: W[i, j] > 0 only if j sends to i, and
W[i, i] is i's self weight. Undirected topologies (directed=False) have doubly stochastic matrices
(symmetric when static); directed ones (push-sum) have column stochastic matrices. A periodic
schedule repeats its `period` matrices; a random one (period None) draws W(t) from (seed, t).
A topology keeps each matrix as its builder made it: dense up to `matrices.DENSE_UP_TO` peers, a scipy.sparse
CSR array above (`mixing_matrix` still returns the dense array; `sparse_mixing_matrix` never makes one).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import sparse
from scipy.sparse.csgraph import connected_components

from .matrices import canonical, entries, is_sparse, is_symmetric, positive, union

__all__ = ["TOL", "Neighbors", "Topology", "check_connected", "check_matrix", "links_of"]

TOL = 1e-12  # stochasticity tolerance of validation


@dataclass(frozen=True)
class Neighbors:
    """What peer `rank` does at one step, read off row and column `rank` of the mixing matrix.

    recv: {peer: W[rank, peer]} for the peers whose values `rank` receives (sorted by peer).
    send: {peer: W[peer, rank]} for the peers `rank` sends its value to (sorted by peer).
    self_weight: W[rank, rank].
    """

    recv: dict[int, float] = field(default_factory=dict)
    send: dict[int, float] = field(default_factory=dict)
    self_weight: float = 1.0


def check_matrix(w, *, directed: bool, label: str = "mixing matrix"):
    """Return `w` as a float64 (n, n) array (a canonical CSR array when `w` is scipy.sparse), or raise
    ValueError naming the property it breaks."""
    w = canonical(w) if is_sparse(w) else np.array(w, dtype=np.float64)
    if w.ndim != 2 or w.shape[0] != w.shape[1] or w.shape[0] == 0:
        raise ValueError(f"{label}: a mixing matrix must be square (n, n) with n >= 1; got shape {w.shape}")
    rows, cols, values = entries(w)
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        i, j, v = rows[bad[0]], cols[bad[0]], values[bad[0]]
        raise ValueError(f"{label} is not finite: W[{i}, {j}] = {v}")
    bad = np.flatnonzero(values < 0)
    if bad.size:
        i, j, v = rows[bad[0]], cols[bad[0]], values[bad[0]]
        raise ValueError(f"{label} is not non-negative: W[{i}, {j}] = {v:.6g}; gossip weights must be >= 0")
    if not directed:
        rows = w.sum(axis=1)
        i = int(np.argmax(np.abs(rows - 1.0)))
        if abs(rows[i] - 1.0) > TOL:
            raise ValueError(
                f"{label} is not doubly stochastic: row {i} sums to {rows[i]:.15g}, "
                f"expected 1 within {TOL:g} (row i holds the weights peer i gives to what it receives, "
                "itself included); for a column stochastic push-sum matrix pass directed=True"
            )
    cols = w.sum(axis=0)
    j = int(np.argmax(np.abs(cols - 1.0)))
    if abs(cols[j] - 1.0) > TOL:
        prop = "column stochastic" if directed else "doubly stochastic"
        raise ValueError(
            f"{label} is not {prop}: column {j} sums to {cols[j]:.15g}, expected 1 within {TOL:g} "
            f"(column j is how peer j's value is shared out, itself included, so no mass is lost or made)"
        )
    return w


def links_of(matrices):
    """The union of the matrices' links as a bool (n, n) matrix (self loops included); a sparse one when
    a matrix is sparse."""
    support = None
    for w in matrices:
        links = _links(w)
        support = links if support is None else union(support, links)
    return support


def _links(w):
    """w > 0 as a bool matrix of w's form."""
    return canonical(w > 0, bool) if is_sparse(w) else w > 0


def check_connected(support, *, directed: bool, label: str, steps: int = 1) -> None:
    """Raise ValueError unless the links in `support` (the union over `steps` steps) are (strongly)
    connected."""
    count, component = connected_components(sparse.csr_array(support), directed=True, connection="strong")
    if count == 1:
        return
    cut = np.flatnonzero(component != component[0])
    kind = "strongly connected" if directed else "connected"
    over = f" (jointly, over {steps} steps)" if steps > 1 else ""
    more = f" and {cut.size - 1} other peer(s)" if cut.size > 1 else ""
    raise ValueError(
        f"{label} is not {kind}{over}: it splits into {count} groups, and peer {cut[0]}{more} never "
        f"exchange(s) values with peer 0; add links between the groups"
    )


def _is_connected(support: np.ndarray) -> bool:
    return connected_components(sparse.csr_array(support), directed=True, connection="strong")[0] == 1


class Topology:
    """A validated schedule of mixing matrices over `n` peers.

    schedule: a sequence of p matrices (periodic: W(t) = schedule[t mod p]) or a function
        step -> matrix (random schedule, period None; it must be deterministic in step).
    directed: False for doubly stochastic matrices, True for column stochastic ones (push-sum).
    options: the options the topology was built with (for descriptions and reproduction).
    split: for random schedules only, the (active, passive) split every step respects, if any.
    window: for random schedules, how many first steps validation checks and must be jointly
        connected.
    """

    def __init__(
        self,
        name: str,
        schedule: Sequence[np.ndarray] | Callable[[int], np.ndarray],
        *,
        directed: bool = False,
        options: Mapping | None = None,
        split: tuple[Sequence[int], Sequence[int]] | None = None,
        window: int | None = None,
    ):
        self.name = name
        self.directed = bool(directed)
        self.options = dict(options or {})
        self._split = split
        if callable(schedule):
            self.period = None
            self._draw = schedule
            self._matrices = None
            self.n = check_matrix(schedule(0), directed=directed, label=f"{name!r} at step 0").shape[0]
            self._random_matrix = functools.lru_cache(maxsize=64)(self._checked_draw)
            # Validate the first steps, until their links join up (or the window ends).
            limit = window if window else 4 * self.n + 16
            support = None
            for t in range(limit):
                links = _links(self._random_matrix(t))
                support = links if support is None else union(support, links)
                if _is_connected(support):
                    break
            self._window = t + 1
            check_connected(support, directed=self.directed, label=repr(name), steps=self._window)
        else:
            if len(schedule) == 0:
                raise ValueError(f"{name!r}: a schedule needs at least one mixing matrix")
            self._matrices = [
                check_matrix(w, directed=directed, label=f"{name!r} at step {t}" if len(schedule) > 1 else repr(name))
                for t, w in enumerate(schedule)
            ]
            shapes = {w.shape for w in self._matrices}
            if len(shapes) > 1:
                raise ValueError(f"{name!r}: all matrices of a schedule must have the same shape; got {sorted(shapes)}")
            for w in self._matrices:
                if not is_sparse(w):
                    w.flags.writeable = False  # cached: callers get copies
            self.period = len(self._matrices)
            self.n = self._matrices[0].shape[0]
            self._window = self.period
            check_connected(links_of(self._matrices), directed=self.directed, label=repr(name), steps=self.period)
        if split is not None:
            self._check_split(split)

    def _checked_draw(self, step: int) -> np.ndarray:
        w = check_matrix(self._draw(step), directed=self.directed, label=f"{self.name!r} at step {step}")
        if w.shape != (self.n, self.n):
            raise ValueError(f"{self.name!r} at step {step}: shape {w.shape}, expected {(self.n, self.n)}")
        if not is_sparse(w):
            w.flags.writeable = False
        return w

    def _stored(self, step: int):
        """The cached W(step) as the builder made it: a read-only dense array or a CSR array (not to modify)."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be an integer >= 0; got {step!r}")
        if self._matrices is not None:
            return self._matrices[int(step) % len(self._matrices)]
        return self._random_matrix(int(step))

    def _matrix(self, step: int) -> np.ndarray:
        """W(step) dense and read-only (made afresh from a sparse one: large n pays n x n here)."""
        w = self._stored(step)
        if is_sparse(w):
            w = w.toarray()
            w.flags.writeable = False
        return w

    def mixing_matrix(self, step: int = 0) -> np.ndarray:
        """W(step) as a fresh (n, n) float64 array (row i: the weights peer i gives to what it receives)."""
        return np.array(self._matrix(step))

    def sparse_mixing_matrix(self, step: int = 0) -> sparse.csr_array:
        """W(step) as a fresh scipy.sparse CSR array (float64, no stored zeros, sorted indices): the same values
        as `mixing_matrix`, without an (n, n) dense array when the topology keeps its matrices sparse."""
        return canonical(self._stored(step))

    def neighbors(self, rank: int, step: int = 0) -> Neighbors:
        """Who `rank` receives from and sends to at `step`, with the weights, read off W(step)."""
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.n:
            raise ValueError(f"rank must be an integer in [0, {self.n}); got {rank!r}")
        w = self._stored(step)
        rank = int(rank)
        if is_sparse(w):  # row rank, then column rank (its entries come row-major: by peer)
            row = slice(w.indptr[rank], w.indptr[rank + 1])
            recv_peers, recv_weights = w.indices[row], w.data[row]
            in_column = np.flatnonzero(w.indices == rank)
            send_peers = np.searchsorted(w.indptr, in_column, side="right") - 1
            send_weights = w.data[in_column]
            own = recv_weights[recv_peers == rank]
            self_weight = float(own[0]) if own.size else 0.0
        else:
            recv_peers = send_peers = np.arange(self.n)
            recv_weights, send_weights, self_weight = w[rank, :], w[:, rank], float(w[rank, rank])

        def weighted(peers: np.ndarray, weights: np.ndarray) -> dict[int, float]:
            return {int(peers[k]): float(weights[k]) for k in np.flatnonzero((weights > 0) & (peers != rank))}

        return Neighbors(
            recv=weighted(recv_peers, recv_weights), send=weighted(send_peers, send_weights), self_weight=self_weight
        )

    def _steps_to_inspect(self) -> range:
        """The steps whose links define the graph: one period, or the validated window of a random one."""
        return range(self._window)

    def bipartite(self) -> tuple[frozenset[int], frozenset[int]]:
        """An (active, passive) split of the peers such that every link, at every step, crosses it.

        AD-PSGD pairs active peers with passive ones so that pairings never deadlock. Peer 0 is active.
        Raises ValueError when the graph has no such split (an odd cycle: an odd ring, complete n >= 3).
        """
        if self.period is None:
            if self._split is None:
                raise ValueError(
                    f"{self.name!r} draws random links at every step, so no fixed active/passive split "
                    "covers them; build it with bipartite=True if it offers that option"
                )
            return frozenset(self._split[0]), frozenset(self._split[1])
        rows, cols = positive(links_of(self._stored(t) for t in self._steps_to_inspect()))
        off = rows != cols
        ends = (np.r_[rows[off], cols[off]], np.r_[cols[off], rows[off]])  # both directions, no self loops
        both = canonical(sparse.coo_array((np.ones(ends[0].size, bool), ends), shape=(self.n, self.n)), bool)
        side = np.full(self.n, -1)
        side[0] = 0
        stack = [0]
        while stack:
            i = stack.pop()
            for j in both.indices[both.indptr[i] : both.indptr[i + 1]]:
                if side[j] < 0:
                    side[j] = 1 - side[i]
                    stack.append(int(j))
                elif side[j] == side[i]:
                    raise ValueError(
                        f"{self.name!r} with n={self.n} has no active/passive split: peers {i} and {j} are "
                        "linked but must fall on the same side (the graph has an odd cycle); AD-PSGD needs a "
                        "bipartite graph, e.g. an even ring, a hypercube or an even torus"
                    )
        return frozenset(np.flatnonzero(side == 0).tolist()), frozenset(np.flatnonzero(side == 1).tolist())

    def _check_split(self, split) -> None:
        active, passive = ({int(p) for p in s} for s in split)
        if active & passive or active | passive != set(range(self.n)):
            raise ValueError(f"{self.name!r}: a split must partition the peers 0..{self.n - 1} into two sets")
        for t in self._steps_to_inspect():
            for i, j in zip(*positive(self._stored(t))):
                if i != j and (i in active) == (j in active):
                    raise ValueError(f"{self.name!r} at step {t}: link {j} -> {i} does not cross the split")

    def to_networkx(self, step: int = 0):
        """W(step) as a networkx graph: an undirected Graph when W(step) is symmetric, else a DiGraph
        with an edge j -> i for each sender j of i. Edge attribute `weight` = W[i, j]; node attribute
        `self_weight` = W[i, i]."""
        import networkx as nx

        w = self._stored(step)
        graph = nx.Graph() if is_symmetric(w) else nx.DiGraph()
        graph.add_nodes_from((i, {"self_weight": float(d)}) for i, d in enumerate(w.diagonal()))
        rows, cols, values = entries(w)
        graph.add_weighted_edges_from(
            (int(j), int(i), float(v)) for i, j, v in zip(rows, cols, values) if v > 0 and i != j
        )
        return graph

    def __repr__(self) -> str:
        opts = "".join(f", {k}={v!r}" for k, v in self.options.items())
        return f"Topology({self.name!r}, n={self.n}{opts}, directed={self.directed}, period={self.period})"
