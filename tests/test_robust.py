"""Corrupt peers (dpsgd.comm.corrupt) and robust aggregation (dpsgd.comm.robust): each rule and mode against a
few lines of numpy, real peers against the fleet, bytes, the sender of a non-finite message named, and the
accuracy a corrupt peer costs D-PSGD with and without ClippedGossip."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch
from runs import experiment, load
from scipy.stats import norm as gaussian

import topologies
from dpsgd import backends, divergence
from dpsgd.comm import codecs, run_local, transport
from dpsgd.comm.corrupt import Corruption, alie_z
from dpsgd.comm.robust import Robust, Rule, make, wrap
from dpsgd.config import parse
from dpsgd.faults import FaultPlan
from dpsgd.sim.fleet import FleetCommunicator
from dpsgd.training import train

N, D = 6, 5
X = np.random.default_rng(1).normal(size=(N, D))
X[4] *= 40.0  # one far value among the honest ones


def _np_clip(v, tau):
    n = np.linalg.norm(v)
    return np.zeros_like(v) if not np.isfinite(n) else v * min(1.0, tau / n) if n > 0 else v


def _np_combine(rule: Rule, own, others, weights, self_weight):
    """The rules as the module states them, in numpy."""
    if rule.name == "none":
        return self_weight * own + sum(w * r for r, w in zip(others, weights))
    dist = sorted((np.linalg.norm(r - own) for r in others), reverse=True)
    if rule.name == "clipped_gossip":
        tau = rule.tau if rule.tau is not None else (dist[rule.byzantine] if len(dist) > rule.byzantine else 0.0)
        return self_weight * own + sum(w * (own + _np_clip(r - own, tau)) for r, w in zip(others, weights))
    values = np.stack([own, *others])
    if rule.name == "trimmed_mean":
        b = min(rule.byzantine, (len(values) - 1) // 2)
        return np.sort(values, 0)[b : len(values) - b].mean(0)
    v = own.copy()
    for _ in range(rule.iterations):
        d = sorted((np.linalg.norm(r - v) for r in others), reverse=True)
        tau = rule.tau if rule.tau is not None else (d[rule.byzantine] if len(d) > rule.byzantine else 0.0)
        v = v + sum(_np_clip(x - v, tau) for x in values) / len(values)
    return v


RULES = [
    Rule("none"),
    Rule("clipped_gossip"),
    Rule("clipped_gossip", tau=0.5),
    Rule("centered_clip"),
    Rule("trimmed_mean", byzantine=2),
    Rule("trimmed_mean", byzantine=1),
]


@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_rules_match_numpy(rule):
    weights = [0.2, 0.3, 0.1, 0.15]
    got = rule.combine(torch.tensor(X[0]), [torch.tensor(r) for r in X[1:5]], weights, 0.25)
    np.testing.assert_allclose(got.numpy(), _np_combine(rule, X[0], list(X[1:5]), weights, 0.25), rtol=1e-10)


def test_clipped_gossip_drops_a_nan_message_and_bounds_a_huge_one():
    own, honest = torch.zeros(3), torch.ones(3)
    for bad in (torch.full((3,), math.nan), torch.full((3,), 1e30)):
        out = Rule("clipped_gossip").combine(own.clone(), [honest, bad], [1 / 3, 1 / 3], 1 / 3)
        assert torch.isfinite(out).all() and float(out.norm()) <= 2 / 3 * float(honest.norm()) + 1e-6


def test_corruption_modes_match_their_definitions():
    x = torch.tensor(X[0])
    seen = [torch.tensor(r) for r in X[1:4]]
    assert torch.isnan(Corruption(frozenset({0}), "nan").alter(x, 0, 1)).all()
    assert torch.equal(Corruption(frozenset({0}), "scale").alter(x, 0, 1), x * 10)
    assert torch.equal(Corruption(frozenset({0}), "scale", -4.0).alter(x, 0, 1), x * -4)
    assert torch.equal(Corruption(frozenset({0}), "sign").alter(x, 0, 1), -x)
    noisy = Corruption(frozenset({0}), "noise", 3.0, seed=5).alter(x, 0, 7)
    assert float((noisy - x).norm()) == pytest.approx(3.0)
    assert torch.equal(noisy, Corruption(frozenset({0}), "noise", 3.0, seed=5).alter(x, 0, 7))  # seeded
    assert not torch.equal(noisy, Corruption(frozenset({0}), "noise", 3.0, seed=5).alter(x, 0, 8))
    values = np.stack([X[0], *X[1:4]])
    alie = Corruption(frozenset({0}), "alie", 1.5).alter(x, 0, 1, seen)
    np.testing.assert_allclose(alie.numpy(), values.mean(0) - 1.5 * values.std(0), rtol=1e-12)
    # Baruch et al.'s z: n = 50, b = 12: s = 26 - 12 = 14 peers, z = Phi^-1(36 / 50)
    assert alie_z(50, 12) == pytest.approx(gaussian.ppf(36 / 50))
    assert alie_z(8, 1) == 0.0 and alie_z(8, 2) == pytest.approx(statistics.NormalDist().inv_cdf(5 / 8))


def _mix_on_local(rank_fn, n=N):
    return run_local(n, rank_fn)


@pytest.mark.parametrize("rule", [Rule("none"), Rule("clipped_gossip"), Rule("trimmed_mean")], ids=repr)
@pytest.mark.parametrize("mode", ["scale", "sign", "alie"])
def test_real_peers_and_fleet_agree_with_numpy(rule, mode):
    """A mix over a ring and a mean, twice (alie imitates what it saw the first time), with peer 2 corrupt."""
    topo = topologies.make("ring", N)
    corruption = Corruption(frozenset({2}), mode, None, seed=0, n=N)

    def peer(comm):
        r = Robust(comm, rule, corruption)
        x = [torch.tensor(X[comm.rank])]
        out = [r.mix(x, topo, 0)[0], r.mix(x, topo, 0)[0], r.allreduce_mean(x)[0], r.allreduce_mean(x)[0]]
        return [t.numpy() for t in out], r.stats.bytes_sent

    real = run_local(N, peer)
    fleet = Robust(FleetCommunicator(N), rule, corruption)
    x = [torch.tensor(X)]
    stacked = [
        fleet.mix(x, topo, 0)[0],
        fleet.mix(x, topo, 0)[0],
        fleet.allreduce_mean(x)[0],
        fleet.allreduce_mean(x)[0],
    ]
    w = topo.mixing_matrix(0)
    for i in range(N):
        for k in range(4):
            np.testing.assert_allclose(real[i][0][k], stacked[k][i].numpy(), rtol=1e-12, atol=1e-12)
        if mode != "alie":  # the first exchange: alie has seen nothing yet and sends its own x
            sent = [corruption.alter(torch.tensor(X[j]), j, 1).numpy() if j == 2 else X[j] for j in range(N)]
            recv = [j for j in range(N) if j != i and w[i, j] > 0]
            want = _np_combine(rule, X[i], [sent[j] for j in recv], [w[i, j] for j in recv], w[i, i])
            np.testing.assert_allclose(real[i][0][0], want, rtol=1e-10)
    m = X[0].nbytes
    gathered = rule.name != "none" or mode == "alie"
    mean_bytes = 2 * (N - 1) * m if gathered else 2 * 2 * (N - 1) / N * m
    assert real[0][1] == pytest.approx(
        2 * 2 * m + mean_bytes, abs=2
    )  # two mixes to 2 neighbours, two means (whole bytes)
    assert float(fleet.inner.bytes_sent[0]) == pytest.approx(real[0][1], abs=2)


def test_nan_sender_is_named_as_the_diverged_peer(tmp_path):
    cfg = experiment({**load("algorithm", "dpsgd")})
    cfg["faults"] = {"corrupt_peer": 2, "corrupt_mode": "nan"}
    with pytest.raises(divergence.Diverged) as caught:
        run_local(4, train, parse(cfg), tmp_path)
    assert caught.value.peer == 2 and caught.value.step == 1
    assert "it sent non-finite values (received by peer" in str(caught.value)


def test_corrupt_mode_nan_from_the_command_line_is_the_nan_mode(hydra_config):
    """Hydra's grammar reads `faults.corrupt_mode=nan` as the float NaN (it was refused as 'got nan'): the typed
    config (a string field) makes it the word again, and a NaN given in Python still means the nan mode."""
    faults = hydra_config("faults.corrupt_peer=2", "faults.corrupt_mode=nan")["faults"]
    assert faults["corrupt_mode"] == "nan"
    assert FaultPlan.from_config(faults, 4, transport.get("local")).corrupt_mode == "nan"
    assert FaultPlan.from_config({**faults, "corrupt_mode": math.nan}, 4, transport.get("local")).corrupt_mode == "nan"
    assert Corruption(frozenset([2]), math.nan).mode == "nan"


def test_config_checks():
    local = transport.get("local")
    with pytest.raises(ValueError, match=r"corrupt_peer must be a peer rank in \[0, 4\)"):
        FaultPlan.from_config({"corrupt_peer": 4}, 4, local)
    with pytest.raises(ValueError, match="leave at least one honest"):
        FaultPlan.from_config({"corrupt_peer": [0, 1]}, 2, local)
    with pytest.raises(ValueError, match="corrupt_mode must be one of nan, scale, sign, noise, alie"):
        FaultPlan.from_config({"corrupt_peer": 1, "corrupt_mode": "evil"}, 4, local)
    assert FaultPlan.from_config({"corrupt_peer": [1, 3]}, 4, backends.get("fleet")).corrupt_peers == [1, 3]
    with pytest.raises(ValueError, match="unknown robust rule 'median'"):
        make("median")
    with pytest.raises(ValueError, match="robust takes name, byzantine, tau, iterations; got radius"):
        make({"name": "clipped_gossip", "radius": 1})
    with pytest.raises(ValueError, match="need exact messages"):
        wrap(codecs.wrap(FleetCommunicator(4), "int8"), "clipped_gossip")
    assert wrap(FleetCommunicator(4), "none").__class__ is FleetCommunicator  # off: not worn at all


@pytest.mark.slow
@pytest.mark.processes
def test_clipped_gossip_survives_a_scaling_peer_on_mpi(app, tmp_path):
    """8 MPI peers on a ring, peer 2 sending 10 x: plain D-PSGD collapses; ClippedGossip ends within 3 points of
    the clean run."""
    accuracy = {}
    for name, args in {
        "clean": [],
        "plain": ["faults.corrupt_peer=2", "faults.corrupt_mode=scale", "on_divergence=mark"],
        "clipped": ["faults.corrupt_peer=2", "faults.corrupt_mode=scale", "robust=clipped_gossip"],
    }.items():
        proc = app(["backend=mpi", "peers=8", *args], tmp_path / name, timeout=300)
        assert proc.returncode == 0, proc.stderr
        accuracy[name] = divergence.json_safe(__import__("json").loads((tmp_path / name / "summary.json").read_text()))
    assert accuracy["plain"]["test_accuracy"] < 0.3 and accuracy["plain"]["status"] == "diverged"
    assert accuracy["clipped"]["status"] == "ok"
    assert accuracy["clipped"]["test_accuracy"] >= accuracy["clean"]["test_accuracy"] - 0.03


@pytest.mark.parametrize(
    "topology, byzantine, refused",
    [("one_peer_exponential", 1, True), ("ring", 1, False), ("ring", 2, True), ("exponential", 2, False)],
)
def test_an_adaptive_radius_that_is_always_0_is_refused(topology, byzantine, refused):
    """A peer receiving no more than `byzantine` values a step would clip them all to nothing: one line, not a run
    in which no peer ever mixes (with robust.tau given, the radius is the user's: allowed)."""
    import topologies
    from dpsgd.comm import robust

    t = topologies.make(topology, 8)
    spec = {"name": "clipped_gossip", "byzantine": byzantine}
    if refused:
        with pytest.raises(ValueError, match=f"byzantine={byzantine} on {topology}.*never mixes"):
            robust.check_mixing(spec, t)
    else:
        robust.check_mixing(spec, t)
    robust.check_mixing({**spec, "tau": 1.0}, t)
    robust.check_mixing({"name": "trimmed_mean", "byzantine": byzantine}, t)


def test_a_library_users_gossip_on_a_robust_wrap_is_checked_too():
    """DPSGD built by hand on `robust.wrap(comm, ...)` refuses the radius that is always 0, as the app does."""
    from dpsgd.optim import DPSGD

    def build(comm, topology):
        base = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
        wrapped = wrap(comm, {"name": "clipped_gossip", "byzantine": 1})
        try:
            DPSGD(base, comm=wrapped, topology=topologies.make(topology, comm.size))
        except ValueError as e:
            return str(e)
        return None

    refused = run_local(4, build, "one_peer_exponential")
    assert all(r is not None and "never mixes" in r for r in refused), refused
    assert run_local(4, build, "exponential") == [None] * 4


def test_trimmed_mean_of_four_values_trims_one_per_side_whatever_byzantine_asks():
    """4 values with byzantine=2: trimming 2 per side would leave none (a mean of nothing: nan); the cap keeps the
    middle two, scipy's trim_mean with a quarter cut per side. On 4 real peers (a robust mean) with peer 3 sending
    its values scaled by 1e6, every peer holds the trimmed mean of what it holds and received."""
    from scipy.stats import trim_mean

    values = np.random.default_rng(4).normal(size=(4, D))
    got = Rule("trimmed_mean", byzantine=2).combine(
        torch.tensor(values[0]), [torch.tensor(v) for v in values[1:]], [0.25] * 3, 0.25
    )
    np.testing.assert_allclose(got.numpy(), trim_mean(values, 0.25, axis=0), rtol=1e-12)
    sent = values.copy()
    sent[3] *= 1e6
    corruption = Corruption(frozenset({3}), "scale", 1e6, n=4)

    def peer(comm):
        robust = wrap(comm, {"name": "trimmed_mean", "byzantine": 2}, corruption)
        return robust.allreduce_mean([torch.tensor(values[comm.rank])])[0].numpy()

    for r, mean in enumerate(run_local(4, peer)):
        held = np.vstack([sent[:r], values[r : r + 1], sent[r + 1 :]])  # a corrupt peer keeps its own true x
        # atol: the sum less the largest and smallest cancels the 1e6 to within 1e6 float64 ulps
        np.testing.assert_allclose(mean, trim_mean(held, 0.25, axis=0), rtol=0, atol=1e-8, err_msg=f"rank {r}")


@pytest.mark.parametrize("n, corrupt", [(5, 1), (7, 2), (9, 1), (10, 2), (11, 3), (20, 4), (50, 12)])
def test_alies_default_z_is_baruchs_where_it_is_not_zero(n, corrupt):
    """Baruch et al. 2019: s = floor(n/2 + 1) - f peers, z = Phi^-1((n - s) / n) (scipy's normal quantile), at
    sizes odd and even where z > 0; a corrupt peer with no faults.corrupt_scale sends mean - z std of what it saw."""
    s = math.floor(n / 2 + 1) - corrupt
    z = gaussian.ppf((n - s) / n)
    assert z > 0.1
    assert alie_z(n, corrupt) == pytest.approx(z, rel=1e-9)
    rng = np.random.default_rng(n)
    x, seen = rng.normal(size=D), rng.normal(size=(3, D))
    values = np.vstack([x, seen])
    got = Corruption(frozenset(range(corrupt)), "alie", None, n=n).alter(
        torch.tensor(x), 0, 2, list(torch.tensor(seen))
    )
    np.testing.assert_allclose(got.numpy(), values.mean(0) - z * values.std(0), rtol=1e-9, atol=1e-12)
