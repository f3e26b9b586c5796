"""topologies: closed forms, exactness, weights, neighbours against the matrix, refusals."""

import math

import numpy as np
import pytest

import topologies
from topologies import analysis, weights

REQUIRED = [
    "complete",
    "ring",
    "torus",
    "hypercube",
    "exponential",
    "star",
    "erdos_renyi",
    "random_regular",
    "hierarchical",
    "one_peer_exponential",
    "random_matching",
    "base_k",
    "directed_exponential",
    "one_peer_directed_exponential",
]


def test_names_lists_every_required_topology():
    assert set(REQUIRED) <= set(topologies.names())


# --- closed forms --------------------------------------------------------------------------------


@pytest.mark.parametrize("n", range(3, 33))
def test_ring_gap_closed_form(n):
    ring = topologies.make("ring", n)
    np.testing.assert_allclose(ring.mixing_matrix()[0, [n - 1, 0, 1]], [1 / 3] * 3)
    assert analysis.spectral_gap(ring) == pytest.approx((2 / 3) * (1 - math.cos(2 * math.pi / n)), abs=1e-12)


@pytest.mark.parametrize("m", range(3, 9))
def test_torus_gap_closed_form(m):
    torus = topologies.make("torus", m * m)
    assert torus.options["rows"] == torus.options["cols"] == m
    w = torus.mixing_matrix()
    np.testing.assert_allclose(w[w > 0], 0.2)
    assert analysis.spectral_gap(torus) == pytest.approx((2 / 5) * (1 - math.cos(2 * math.pi / m)), abs=1e-12)


@pytest.mark.parametrize("d", range(1, 8))
def test_hypercube_uniform_gap_is_2_over_d_plus_1(d):
    cube = topologies.make("hypercube", 2**d, weights="uniform")
    assert analysis.spectral_gap(cube) == pytest.approx(2 / (d + 1), abs=1e-12)


@pytest.mark.parametrize("d", range(2, 8))
def test_exponential_uniform_gaps(d):
    # Ying et al. 2021: the static exponential graph, each peer sending to i + 2^k with weights
    # 1/(d+1), has gap 2/(d+1). Its symmetric version (i +- 2^k, degree 2d - 1) has gap 2/d.
    directed = topologies.make("directed_exponential", 2**d)
    assert analysis.spectral_gap(directed) == pytest.approx(2 / (d + 1), abs=1e-12)
    symmetric = topologies.make("exponential", 2**d, weights="uniform")
    assert analysis.spectral_gap(symmetric) == pytest.approx(2 / d, abs=1e-12)


def test_complete_is_the_averaging_matrix():
    for n in (1, 2, 7):
        np.testing.assert_allclose(topologies.make("complete", n).mixing_matrix(), np.full((n, n), 1 / n))


def test_exponential_links_i_plus_minus_powers_of_two():
    topo = topologies.make("exponential", 12)
    assert set(topo.neighbors(0).recv) == {1, 2, 4, 8, 11, 10}  # +-1, +-2, +-4, +8 (= -4), -8 (= +4)
    np.testing.assert_allclose(topo.mixing_matrix(), topo.mixing_matrix().T)


@pytest.mark.parametrize("n", [2, 5, 9])
def test_star_closed_form(n):
    """Metropolis-Hastings on the star: hub 0 (degree n - 1) and each leaf (degree 1) share 1 / n; a leaf
    keeps 1 - 1 / n, the hub 1 / n. max_degree: 1 / n on each link too, the same matrix."""
    want = np.zeros((n, n))
    want[0, :] = want[:, 0] = 1 / n
    want[np.arange(1, n), np.arange(1, n)] = 1 - 1 / n
    np.testing.assert_allclose(topologies.make("star", n).mixing_matrix(), want, rtol=0, atol=1e-15)
    np.testing.assert_allclose(topologies.make("star", n, weights="max_degree").mixing_matrix(), want, atol=1e-15)


def test_hierarchical_links_peer_r_of_each_group_to_peer_r_of_the_next_groups():
    # 8 peers in 4 groups of 2, a ring over the groups: peer 0 (group 0, slot 0) links to its group mate 1 and
    # to slot 0 of groups 1 and 3 (peers 2 and 6); peer 3 (group 1, slot 1) to 2 and to peers 1 and 5;
    # every peer has degree 3, so each weight is 1 / 4
    topo = topologies.make("hierarchical", 8, group_size=2, across="ring")
    assert topo.neighbors(0).recv == {1: 0.25, 2: 0.25, 6: 0.25} and topo.neighbors(0).self_weight == 0.25
    assert topo.neighbors(3).recv == {1: 0.25, 2: 0.25, 5: 0.25}


@pytest.mark.parametrize(
    ("n", "group_size", "across", "group_hops"),
    [
        (12, 3, "ring", {1, 3}),
        (24, 3, "exponential", {1, 2, 4, 6, 7}),
        (12, 2, "exponential", {1, 2, 4, 5}),
        (8, 4, "ring", {1}),
    ],
)
def test_hierarchical_closed_form(n, group_size, across, group_hops):
    """W from the definition: i ~ j when they share a group, or hold the same slot in groups whose
    distance (mod the group count) is a hop of `across`; the graph is regular (degree d), so
    Metropolis-Hastings gives 1 / (d + 1) on every link and on the diagonal."""
    groups = n // group_size
    group, slot = np.divmod(np.arange(n), group_size)
    same_group = group[:, None] == group[None, :]
    linked_groups = np.isin((group[:, None] - group[None, :]) % groups, list(group_hops))
    links = (same_group | (linked_groups & (slot[:, None] == slot[None, :]))) & ~np.eye(n, dtype=bool)
    d = group_size - 1 + len(group_hops)
    assert (links.sum(axis=1) == d).all()
    want = np.where(links, 1 / (d + 1), 0.0) + np.eye(n) / (d + 1)
    topo = topologies.make("hierarchical", n, group_size=group_size, across=across)
    np.testing.assert_allclose(topo.mixing_matrix(), want, rtol=0, atol=1e-15)


@pytest.mark.parametrize(("n", "self_weight"), [(6, 0.5), (8, 0.3), (5, 0.7)])
def test_one_peer_directed_exponential_closed_form(n, self_weight):
    """At step t, peer j keeps s and sends 1 - s to j + 2^(t mod tau), tau = ceil(log2 n):
    W(t)[j, j] = s, W(t)[(j + 2^(t mod tau)) mod n, j] = 1 - s, every other entry 0."""
    topo = topologies.make("one_peer_directed_exponential", n, self_weight=self_weight)
    tau = math.ceil(math.log2(n))
    assert topo.period == tau and topo.directed
    j = np.arange(n)
    for t in range(2 * tau + 1):
        want = self_weight * np.eye(n)
        want[(j + 2 ** (t % tau)) % n, j] += 1 - self_weight
        np.testing.assert_allclose(topo.mixing_matrix(t), want, rtol=0, atol=1e-15, err_msg=f"step {t}")
    nb = topologies.make("one_peer_directed_exponential", 8).neighbors(3, 1)  # hop 2: 3 sends to 5, hears from 1
    assert nb.send == {5: 0.5} and nb.recv == {1: 0.5} and nb.self_weight == 0.5


# --- time-varying --------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32, 64])
def test_one_peer_exponential_exact_after_log2_n_steps(n):
    topo = topologies.make("one_peer_exponential", n)
    tau = int(math.log2(n))
    assert topo.period == tau
    assert analysis.exact_averaging_steps(topo) == tau
    assert analysis.degree(topo) == 1
    product = np.eye(n)
    for t in range(tau):
        product = topo.mixing_matrix(t) @ product
    np.testing.assert_allclose(product, np.full((n, n), 1 / n), atol=1e-12)


@pytest.mark.parametrize("n", [6, 12])
def test_one_peer_exponential_not_exact_otherwise(n):
    topo = topologies.make("one_peer_exponential", n)
    assert topo.period == math.ceil(math.log2(n))
    assert analysis.exact_averaging_steps(topo) is None
    assert 0 < analysis.spectral_gap(topo) < 1


def test_one_peer_exponential_step_structure():
    topo = topologies.make("one_peer_exponential", 8)
    for t in range(6):
        hop = 2 ** (t % 3)
        nb = topo.neighbors(5, t)
        assert nb.recv == {(5 + hop) % 8: 0.5} and nb.send == {(5 - hop) % 8: 0.5} and nb.self_weight == 0.5
    np.testing.assert_allclose(topologies.make("one_peer_exponential", 2).mixing_matrix(), np.full((2, 2), 0.5))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_base_k_exact_for_every_n(k):
    for n in range(2, 41):
        topo = topologies.make("base_k", n, k=k)
        steps = analysis.exact_averaging_steps(topo)
        assert steps is not None and steps <= topo.period, (n, k)
        assert analysis.degree(topo) <= k, (n, k)
        # the paper's bound on the schedule's length
        assert topo.period <= 2 * math.log(n, k + 1) + 2, (n, k)


def test_base_k_is_the_hypercube_schedule_for_powers_of_k_plus_1():
    assert topologies.make("base_k", 16).period == 4
    assert topologies.make("base_k", 27, k=2).period == 3
    assert topologies.make("base_k", 5, k=4).period == 1


def test_random_matching_is_a_function_of_seed_and_step():
    a = topologies.make("random_matching", 10, seed=3)
    b = topologies.make("random_matching", 10, seed=3)
    c = topologies.make("random_matching", 10, seed=4)
    assert a.period is None
    for t in (0, 5, 1000):
        np.testing.assert_array_equal(a.mixing_matrix(t), b.mixing_matrix(t))
        assert analysis.degree(a) == 1
        assert sorted(len(a.neighbors(i, t).recv) for i in range(10)) == [1] * 10
    assert any(not np.array_equal(a.mixing_matrix(t), c.mixing_matrix(t)) for t in range(5))
    assert analysis.consensus_steps(a, 1e-3) is not None


def test_directed_topologies_are_column_stochastic():
    for name in ("directed_exponential", "one_peer_directed_exponential"):
        for n in (3, 6, 10):
            topo = topologies.make(name, n)
            assert topo.directed
            for t in range(topo.period):
                assert analysis.is_column_stochastic(topo.mixing_matrix(t))
    topo = topologies.make("directed_exponential", 6)  # j sends to j + 1, j + 2, j + 4
    assert topo.neighbors(0).send == {1: 0.25, 2: 0.25, 4: 0.25}
    assert analysis.consensus_steps(topologies.make("directed_exponential", 6)) is not None


# --- weights -------------------------------------------------------------------------------------


def _star(n):
    links = np.zeros((n, n), dtype=bool)
    links[0, 1:] = links[1:, 0] = True
    return links


def test_weight_schemes():
    mh = weights.metropolis_hastings(_star(5))
    assert analysis.is_doubly_stochastic(mh) and mh[0, 1] == pytest.approx(1 / 5)
    md = weights.max_degree(_star(5))
    assert analysis.is_doubly_stochastic(md) and md[1, 1] == pytest.approx(1 - 1 / 5)
    un = weights.uniform(_star(5))
    np.testing.assert_allclose(un.sum(axis=1), 1)
    assert un[0, 0] == pytest.approx(1 / 5) and un[1, 1] == pytest.approx(1 / 2)
    assert not analysis.is_doubly_stochastic(un)
    with pytest.raises(ValueError, match="doubly stochastic"):
        topologies.make("star", 5, weights="uniform")
    ring = topologies.make("ring", 6, self_weight=0.5)
    assert ring.neighbors(0).self_weight == 0.5 and ring.neighbors(0).recv == {1: 0.25, 5: 0.25}
    with pytest.raises(ValueError, match="same degree"):
        topologies.make("star", 5, self_weight=0.5)
    assert topologies.make("one_peer_exponential", 8, self_weight=0.25).neighbors(0).recv == {1: 0.75}


# --- neighbours agree with the matrix --------------------------------------------------------------


def check_neighbors(topo, steps):
    for t in steps:
        w = topo.mixing_matrix(t)
        for i in range(topo.n):
            nb = topo.neighbors(i, t)
            assert nb.recv == {j: w[i, j] for j in range(topo.n) if j != i and w[i, j] > 0}
            assert nb.send == {j: w[j, i] for j in range(topo.n) if j != i and w[j, i] > 0}
            assert list(nb.recv) == sorted(nb.recv) and list(nb.send) == sorted(nb.send)
            assert nb.self_weight == w[i, i]


@pytest.mark.parametrize("name", REQUIRED)
def test_neighbors_agree_with_matrix(name):
    topo = topologies.make(name, 16 if name == "hypercube" else 12)
    check_neighbors(topo, range(topo.period or 3))


def test_single_peer():
    for name in topologies.names():
        topo = topologies.make(name, 1)
        assert topo.mixing_matrix().tolist() == [[1.0]]
        assert topo.neighbors(0) == topologies.Neighbors(recv={}, send={}, self_weight=1.0)


def test_mixing_matrix_returns_a_copy():
    topo = topologies.make("ring", 5)
    w = topo.mixing_matrix()
    w[0, 0] = 7.0
    assert topo.mixing_matrix()[0, 0] == pytest.approx(1 / 3)


# --- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: topologies.make("ringg", 4), "unknown topology 'ringg'; choose one of: complete, ring"),
        (lambda: topologies.make("ring", 0), "integer >= 1"),
        (lambda: topologies.make("ring", 2.5), "integer >= 1"),
        (lambda: topologies.make("hypercube", 6), r"power of 2 \(1, 2, 4, 8"),
        (lambda: topologies.make("torus", 12, rows=5), "valid rows or cols"),
        (lambda: topologies.make("torus", 12, rows=3, cols=5), "rows x cols must equal n"),
        (lambda: topologies.make("torus", 7), "prime"),
        (lambda: topologies.make("ring", 4, degree=2), "unknown option.*valid options: weights, self_weight"),
        (lambda: topologies.make("ring", 4, weights="magic"), "choose one of metropolis_hastings"),
        (
            lambda: topologies.make("hierarchical", 12, group_size=5),
            r"valid group sizes: \[1, 2, 3, 4, 6, 12\]",
        ),
        (lambda: topologies.make("random_regular", 5, d=3), "n \\* d even"),
        (lambda: topologies.make("erdos_renyi", 8, p=0), "p must be a number in"),
        (lambda: topologies.make("base_k", 8, k=0), "k .* >= 1"),
        (lambda: topologies.make("one_peer_exponential", 8, self_weight=1.0), r"\[0, 1\)"),
        (lambda: topologies.make("ring", 8, self_weight="half"), r"ring: self_weight must be a number"),
        (lambda: topologies.make("torus", 12, rows=3.0), "rows must be an integer"),
        (lambda: topologies.make("random_matching", 8, seed=-1), "seed must be an integer >= 0"),
    ],
)
def test_refusals_are_one_line_value_errors(call, match):
    with pytest.raises(ValueError, match=match) as err:
        call()
    assert "\n" not in str(err.value)


def test_bad_steps_and_ranks():
    topo = topologies.make("ring", 4)
    with pytest.raises(ValueError, match="rank"):
        topo.neighbors(4)
    with pytest.raises(ValueError, match="step"):
        topo.mixing_matrix(-1)


# --- bipartite splits ----------------------------------------------------------------------------


def _crosses(topo, active, passive, steps):
    assert active | passive == set(range(topo.n)) and not active & passive and 0 in active
    for t in steps:
        w = topo.mixing_matrix(t)
        for i, j in np.argwhere(w > 0):
            if i != j:
                assert (i in active) != (j in active), (t, i, j)


@pytest.mark.parametrize(("name", "n"), [("ring", 8), ("torus", 16), ("hypercube", 8), ("star", 5), ("base_k", 6)])
def test_bipartite_split_crosses_every_link(name, n):
    topo = topologies.make(name, n)
    active, passive = topo.bipartite()
    _crosses(topo, active, passive, range(topo.period))


def test_bipartite_random_matching_uses_its_declared_split():
    topo = topologies.make("random_matching", 9, bipartite=True, seed=1)
    active, passive = topo.bipartite()
    assert active == set(range(0, 9, 2)) and passive == set(range(1, 9, 2))
    _crosses(topo, active, passive, range(50))
    with pytest.raises(ValueError, match="no fixed active/passive split"):
        topologies.make("random_matching", 8).bipartite()


@pytest.mark.parametrize(("name", "n"), [("ring", 5), ("complete", 3), ("one_peer_exponential", 8), ("torus", 9)])
def test_bipartite_refused_with_an_odd_cycle(name, n):
    with pytest.raises(ValueError, match=r"no active/passive split.*odd cycle"):
        topologies.make(name, n).bipartite()


# --- custom topologies ---------------------------------------------------------------------------


def test_from_matrix_static_and_periodic():
    w = topologies.make("ring", 6).mixing_matrix()
    topo = topologies.from_matrix(w)
    assert topo.period == 1 and topo.name == "custom"
    np.testing.assert_array_equal(topo.mixing_matrix(), w)
    schedule = [topologies.make("one_peer_exponential", 8).mixing_matrix(t) for t in range(3)]
    periodic = topologies.from_matrix(schedule, name="mine")
    assert periodic.period == 3 and analysis.exact_averaging_steps(periodic) == 3
    push = topologies.from_matrix(topologies.make("directed_exponential", 5).mixing_matrix(), directed=True)
    assert push.directed


@pytest.mark.parametrize(
    ("matrix", "kwargs", "match"),
    [
        ([[0.5, 0.5], [0.5, 0.4]], {}, r"not doubly stochastic: row 1 sums to 0.9"),
        ([[0.6, 0.5], [0.4, 0.5]], {}, r"not doubly stochastic: row 0 sums to 1.1"),
        ([[0.5, 0.5], [0.6, 0.5]], {"directed": True}, r"not column stochastic: column 0 sums to 1.1"),
        ([[1.5, -0.5], [-0.5, 1.5]], {}, r"not non-negative: W\[0, 1\] = -0.5"),
        (np.eye(3), {}, r"not connected: .* peer 1 and 1 other peer"),
        ([[1.0, 0.5], [0.0, 0.5]], {"directed": True}, "not strongly connected"),
        (
            [[[1.0, 0.0], [0.0, 1.0]], [[1.0, 0.0], [0.0, 1.0]]],
            {},
            r"not connected \(jointly, over 2 steps\)",
        ),
        ([[1.0, 0.0]], {}, "must be square"),
        ([[np.nan, 1.0], [1.0, 0.0]], {}, "not finite"),
    ],
)
def test_from_matrix_refusals_name_the_property(matrix, kwargs, match):
    with pytest.raises(ValueError, match=match):
        topologies.from_matrix(matrix, **kwargs)


def test_from_networkx_and_back():
    import networkx as nx

    topo = topologies.from_networkx(nx.cycle_graph(7))
    np.testing.assert_allclose(topo.mixing_matrix(), topologies.make("ring", 7).mixing_matrix())
    lollipop = topologies.from_networkx(nx.lollipop_graph(4, 3), weights="max_degree")
    assert analysis.is_doubly_stochastic(lollipop.mixing_matrix())
    with pytest.raises(ValueError, match="doubly stochastic"):
        topologies.from_networkx(nx.path_graph(4), weights="uniform")
    with pytest.raises(ValueError, match="not connected"):
        topologies.from_networkx(nx.empty_graph(3))
    with pytest.raises(ValueError, match="convert_node_labels_to_integers"):
        topologies.from_networkx(nx.Graph([("a", "b")]))
    custom = topologies.from_networkx(nx.cycle_graph(4), weights=lambda a: (np.eye(4) + a) / 3)
    assert custom.neighbors(0).recv == {1: 1 / 3, 3: 1 / 3}

    directed = topologies.from_networkx(nx.DiGraph([(0, 1), (1, 2), (2, 0), (0, 2)]))
    assert directed.directed and directed.neighbors(0).send == {
        1: pytest.approx(1 / 3),
        2: pytest.approx(1 / 3),
    }

    back = topologies.make("torus", 9).to_networkx()
    assert isinstance(back, nx.Graph) and not back.is_directed() and back.number_of_edges() == 18
    assert back.nodes[0]["self_weight"] == pytest.approx(0.2) and back[0][1]["weight"] == pytest.approx(0.2)
    one_peer = topologies.make("one_peer_exponential", 8).to_networkx(step=1)
    assert one_peer.is_directed() and set(one_peer.successors(2)) == {0}  # 2 sends to 2 - 2
    again = topologies.from_networkx(back)
    np.testing.assert_allclose(again.mixing_matrix(), topologies.make("torus", 9).mixing_matrix())


# --- analysis ------------------------------------------------------------------------------------


def _distance_factor(topo, t):
    p = np.eye(topo.n)
    for s in range(t):
        p = topo.mixing_matrix(s) @ p
    return np.linalg.norm(p - 1 / topo.n, 2)


@pytest.mark.parametrize(("name", "n"), [("ring", 9), ("ring", 40), ("one_peer_exponential", 12), ("star", 6)])
def test_consensus_steps_is_the_first_step_within_eps(name, n):
    topo = topologies.make(name, n)
    t = analysis.consensus_steps(topo, 1e-2)
    assert _distance_factor(topo, t) <= 1e-2 < _distance_factor(topo, t - 1)
    curve = analysis.consensus_curve(topo, t)
    assert curve[0] == pytest.approx(1) and curve[-1] <= 1e-2 < curve[-2]


def test_consensus_steps_matches_the_ring_closed_form():
    gap = (2 / 3) * (1 - math.cos(2 * math.pi / 64))
    assert analysis.consensus_steps(topologies.make("ring", 64), 1e-3) == math.ceil(math.log(1e-3) / math.log(1 - gap))


def test_consensus_steps_none_when_it_never_mixes():
    flip = topologies.make("ring", 2, self_weight=0.0)  # W = [[0, 1], [1, 0]]: valid but periodic
    assert analysis.spectral_gap(flip) == pytest.approx(0)
    assert analysis.consensus_steps(flip, max_steps=1000) is None
    assert analysis.exact_averaging_steps(flip) is None


def test_exact_averaging_is_not_fooled_by_fast_asymptotic_mixing():
    # (2/3)^t crosses 1e-10 near t = 57 < n: geometric decay, not exactness
    assert analysis.exact_averaging_steps(topologies.make("exponential", 64)) is None
    assert analysis.exact_averaging_steps(topologies.make("complete", 64)) == 1
    assert analysis.exact_averaging_steps(topologies.make("hierarchical", 8)) == 1
    assert analysis.exact_averaging_steps(topologies.make("ring", 1)) == 0


def test_spectral_gap_of_a_matrix_and_degree():
    assert analysis.spectral_gap(np.full((4, 4), 0.25)) == pytest.approx(1)
    assert analysis.spectral_gap(np.eye(3)) == pytest.approx(0)
    assert analysis.degree(topologies.make("star", 6)) == 5
    assert analysis.degree(topologies.make("hypercube", 16)) == 4
    assert analysis.degree(topologies.make("base_k", 23, k=3)) <= 3


def test_describe_record():
    d = analysis.describe(topologies.make("torus", 16))
    assert d == {
        "name": "torus",
        "n": 16,
        "options": {"rows": 4, "cols": 4},
        "directed": False,
        "period": 1,
        "degree": 4,
        "spectral_gap": pytest.approx(0.4),
        "eps": 1e-3,
        "consensus_steps": 14,
        "exact_averaging_steps": None,
        "bipartite": True,
    }
