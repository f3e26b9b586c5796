"""Property tests (hypothesis): every topology `make` accepts is valid at every step and size, and its
`neighbors()` agree with its matrices; custom matrices are accepted exactly when they are valid."""

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from scipy.sparse.csgraph import connected_components

import topologies
from topologies import analysis

OPTIONS = {  # options worth varying per topology (defaults otherwise)
    "erdos_renyi": {"seed": st.integers(0, 2**16), "p": st.floats(0.2, 1.0)},
    "random_regular": {"seed": st.integers(0, 2**16), "d": st.integers(2, 6)},
    "random_matching": {"seed": st.integers(0, 2**16), "bipartite": st.booleans()},
    "base_k": {"k": st.integers(1, 4), "inner_edges": st.booleans()},
    "hierarchical": {"group_size": st.integers(1, 8), "across": st.sampled_from(["ring", "exponential"])},
    "torus": {"rows": st.integers(1, 8)},
    "ring": {"weights": st.sampled_from(["metropolis_hastings", "uniform", "max_degree"])},
    "star": {"weights": st.sampled_from(["metropolis_hastings", "max_degree"])},
    "one_peer_exponential": {"self_weight": st.floats(0.05, 0.95)},
    "one_peer_directed_exponential": {"self_weight": st.floats(0.05, 0.95)},
    "directed_exponential": {"self_weight": st.floats(0.05, 0.95)},
}


@st.composite
def built(draw):
    name = draw(st.sampled_from(topologies.names()))
    n = draw(st.integers(1, 40))
    strategies = OPTIONS.get(name, {})
    chosen = draw(st.lists(st.sampled_from(sorted(strategies)), unique=True)) if strategies else []
    options = {key: draw(strategies[key]) for key in chosen}
    try:
        topo = topologies.make(name, n, **options)
    except ValueError as err:  # an impossible size or option: refused in one line, never built
        assert "\n" not in str(err)
        assume(False)
    return topo


def _steps(topo):
    return range(topo.period) if topo.period is not None else [0, 1, 2, 97, 10**6]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(built())
def test_every_topology_is_valid_at_every_step(topo):
    union = np.zeros((topo.n, topo.n), dtype=bool)
    for t in _steps(topo):
        w = topo.mixing_matrix(t)
        assert w.shape == (topo.n, topo.n) and w.dtype == np.float64
        assert (w >= 0).all()
        np.testing.assert_allclose(w.sum(axis=0), 1.0, atol=1e-12)
        if topo.directed:
            assert analysis.is_column_stochastic(w)
        else:
            assert analysis.is_doubly_stochastic(w)
            if topo.period == 1:
                np.testing.assert_array_equal(w, w.T)
        for i in range(topo.n):
            nb = topo.neighbors(i, t)
            assert nb.recv == {j: w[i, j] for j in np.flatnonzero(w[i] > 0) if j != i}
            assert nb.send == {j: w[j, i] for j in np.flatnonzero(w[:, i] > 0) if j != i}
            assert nb.self_weight == w[i, i]
        union |= w > 0
    if topo.period is not None:  # jointly (strongly) connected over the period
        assert connected_components(union, directed=True, connection="strong")[0] == 1
    assert analysis.degree(topo) <= topo.n - 1


@st.composite
def doubly_stochastic(draw):
    """A random doubly stochastic matrix: a convex combination of permutation matrices (Birkhoff)."""
    n = draw(st.integers(2, 8))
    count = draw(st.integers(1, 4))
    perms = [draw(st.permutations(range(n))) for _ in range(count)]
    coeffs = np.array(draw(st.lists(st.floats(0.05, 1.0), min_size=count + 1, max_size=count + 1)))
    coeffs /= coeffs.sum()
    w = coeffs[0] * np.eye(n)
    for c, perm in zip(coeffs[1:], perms, strict=True):
        w += c * np.eye(n)[list(perm)]
    return w


@settings(max_examples=100, deadline=None)
@given(doubly_stochastic(), st.integers(0, 7), st.floats(1e-9, 0.5))
def test_custom_matrices_accepted_exactly_when_valid(w, row, delta):
    connected = connected_components(w > 0, directed=True, connection="strong")[0] == 1
    if connected:
        topo = topologies.from_matrix(w)
        assert topo.n == w.shape[0]
    else:
        with pytest.raises(ValueError, match="not connected"):
            topologies.from_matrix(w)
    bad = w.copy()
    bad[row % w.shape[0], 0] += delta  # breaks the row sum and column 0
    with pytest.raises(ValueError, match=f"not doubly stochastic: row {row % w.shape[0]} sums to"):
        topologies.from_matrix(bad)
    with pytest.raises(ValueError, match="not column stochastic: column 0 sums to"):
        topologies.from_matrix(bad, directed=True)
