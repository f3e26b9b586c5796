"""Large topologies keep sparse mixing matrices (topologies.matrices): built without an (n, n) dense array, and
the same mixing as the dense form where both exist (small n, the sparse form forced)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

import topologies
from dpsgd.sim.fleet import mixing
from topologies import analysis, matrices
from topologies.base import check_matrix

DENSE_BYTES_8192 = 8192 * 8192 * 8  # one dense float64 W at 8,192 peers: 512 MiB

CASES = [
    ("ring", {}),
    ("ring", {"weights": "uniform"}),
    ("ring", {"self_weight": 0.4}),
    ("exponential", {}),
    ("torus", {"weights": "max_degree"}),
    ("hypercube", {}),
    ("star", {}),
    ("hierarchical", {"group_size": 4, "across": "ring"}),
    ("random_regular", {}),
    ("erdos_renyi", {}),
    ("one_peer_exponential", {}),
    ("random_matching", {}),
    ("random_matching", {"bipartite": True}),
    ("directed_exponential", {}),
    ("one_peer_directed_exponential", {}),
]


@pytest.mark.parametrize("name", ["one_peer_exponential", "ring"])
def test_a_large_topology_is_built_without_a_dense_matrix(name):
    tracemalloc.start()
    try:
        topo = topologies.make(name, 8192)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < DENSE_BYTES_8192 / 16, f"building {name} at 8,192 peers peaked at {peak / 2**20:.0f} MiB"
    for t in range(topo.period):
        w = topo.sparse_mixing_matrix(t)
        assert matrices.is_sparse(topo._stored(t)) and w.shape == (8192, 8192)
        assert w.nnz == (2 if name == "one_peer_exponential" else 3) * 8192
        assert analysis.is_doubly_stochastic(w)
    nb = topo.neighbors(5, topo.period - 1)
    hop = 4096 if name == "one_peer_exponential" else 1
    assert nb.recv == {(5 + hop) % 8192: 0.5} if hop > 1 else nb.recv == {4: 1 / 3, 6: 1 / 3}
    if name == "one_peer_exponential":  # exact average after one period at a power of 2: gap 1, from ARPACK
        assert analysis.spectral_gap(topo) == 1.0
        assert analysis.degree(topo) == 1


def test_the_spectral_gap_of_a_large_ring_matches_its_formula():
    n = 2048  # sparse: ARPACK on W - J
    assert analysis.spectral_gap(topologies.make("ring", n)) == pytest.approx(
        (2 / 3) * (1 - np.cos(2 * np.pi / n)), rel=1e-6
    )


def both(name, n, options, monkeypatch):
    """The topology as its dense form and as the sparse one (builders forced sparse from 5 peers up)."""
    dense = topologies.make(name, n, **options)
    monkeypatch.setattr(matrices, "DENSE_UP_TO", 4)
    sparse = topologies.make(name, n, **options)
    monkeypatch.setattr(matrices, "DENSE_UP_TO", 1024)
    return dense, sparse


@pytest.mark.parametrize("name,options", CASES, ids=[f"{n}-{'-'.join(o)}" for n, o in CASES])
def test_sparse_and_dense_forms_mix_alike(name, options, monkeypatch):
    dense, sparse = both(name, 16, options, monkeypatch)
    assert not matrices.is_sparse(dense._stored(0)) and matrices.is_sparse(sparse._stored(0))
    for t in range(6):
        w = dense.mixing_matrix(t)
        # the self weights are 1 - (a row's other weights): summed in another order, the last bit may differ
        np.testing.assert_allclose(sparse.mixing_matrix(t), w, rtol=0, atol=1e-15)
        np.testing.assert_allclose(sparse.sparse_mixing_matrix(t).toarray(), w, rtol=0, atol=1e-15)
        for rank in (0, 3, 15):
            a, b = sparse.neighbors(rank, t), dense.neighbors(rank, t)
            assert list(a.recv) == list(b.recv) and list(a.send) == list(b.send)
            assert a.self_weight == pytest.approx(b.self_weight, abs=1e-15)
            assert list(a.recv.values()) == pytest.approx(list(b.recv.values()), abs=1e-15)
    assert analysis.spectral_gap(sparse) == pytest.approx(analysis.spectral_gap(dense), abs=1e-9)
    assert analysis.degree(sparse) == analysis.degree(dense)
    graphs = sparse.to_networkx(), dense.to_networkx()
    assert type(graphs[0]) is type(graphs[1]) and list(graphs[0].edges) == list(graphs[1].edges)
    try:
        split = dense.bipartite()
    except ValueError as err:
        with pytest.raises(ValueError, match=str(err).split(":")[0]):
            sparse.bipartite()
    else:
        assert sparse.bipartite() == split


@pytest.mark.parametrize("lazy", [False, True])
def test_the_fleet_gossips_the_same_from_either_form(lazy, monkeypatch):
    from dpsgd.sim.fleet import FleetCommunicator

    dense, sparse = both("one_peer_exponential", 12, {}, monkeypatch)
    x = torch.randn(12, 5, 3)
    for t in range(dense.period):
        got = FleetCommunicator(12).mixing(sparse, t, x, lazy).apply(x)
        want = FleetCommunicator(12).mixing(dense, t, x, lazy).apply(x)
        assert torch.equal(got, want)
        w = dense.mixing_matrix(t)
        if lazy:
            w = (w + np.eye(12)) / 2
        np.testing.assert_allclose(got.numpy(), np.einsum("ij,jkl->ikl", w, x.double().numpy()), atol=1e-6)
        m = mixing(sparse.sparse_mixing_matrix(t), torch.float32, torch.device("cpu"))
        assert torch.equal(m.sends, torch.ones(12, dtype=torch.float64)) and torch.equal(m.recvs, m.sends)


def test_a_sparse_matrix_is_validated_like_a_dense_one():
    from scipy import sparse

    w = topologies.make("ring", 6).mixing_matrix()
    heavy = w.copy()
    heavy[0, 1] += 0.1
    for bad, match in ((heavy, "not doubly stochastic: row 0"), (-w, "not non-negative: W\\[0, 0\\]")):
        for form in (bad, sparse.csr_array(bad)):
            with pytest.raises(ValueError, match=match):
                check_matrix(form, directed=False)
    split = w.copy()
    split[:3, :3], split[3:, 3:], split[:3, 3:], split[3:, :3] = 1 / 3, 1 / 3, 0, 0
    with pytest.raises(ValueError, match="not connected"):
        topologies.Topology("split", [sparse.csr_array(split)])
    one = topologies.from_matrix(sparse.csr_array(w))
    two = topologies.from_matrix([sparse.coo_array(w), sparse.coo_array(w)])
    for got, period in ((one, 1), (two, 2)):
        np.testing.assert_array_equal(got.mixing_matrix(1), w)
        assert matrices.is_sparse(got._stored(0)) and got.period == period
