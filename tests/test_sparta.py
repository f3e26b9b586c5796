"""SPARTA (dpsgd.optim.SPARTA) against a numpy statement of its rule on real peers (local backend), the fleet
against real peers, what travels, and its refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from peers import local_sgd_peer as peer
from peers import quadratic as q
from reference import grads
from test_fleet import assert_fleet_equals_local, config

import topologies
from dpsgd.comm import run_local
from dpsgd.optim import SPARTA

torch.set_num_threads(1)
N, STEPS, LR, P = 4, 12, 0.05, 0.3


def reference(fraction: float, partners: str, seed: int = 0, n: int = N) -> np.ndarray:
    """(steps, n, d): x_i <- x_i - lr g_i; then the entries with u_e < p (u: torch.rand over the d entries from
    the generator seeded seed * 1000003 + k, the rule's documented draw) averaged with the partner of random
    matching k, (x_i + x_j) / 2, or over all peers."""
    A, b, x = q.problem(n)
    matching = topologies.make("random_matching", n, seed=seed)
    out = []
    for k in range(STEPS):
        x = x - LR * grads(A, b, x)
        u = torch.rand(x.shape[1], generator=torch.Generator().manual_seed(seed * 1_000_003 + k)).numpy()
        chosen = u < fraction
        if partners == "one":
            partner = {i: j for i in range(n) for j in range(n) if j != i and matching.mixing_matrix(k)[i, j] > 0}
            mixed = x.copy()
            for i, j in partner.items():
                mixed[i, chosen] = (x[i, chosen] + x[j, chosen]) / 2
            x = mixed
        else:
            x[:, chosen] = x[:, chosen].mean(0)
        out.append(x.copy())
    return np.array(out)


def trajectory(comm, fraction, partners, seed=0):
    params, loss = peer.model(comm)
    opt = SPARTA(
        torch.optim.SGD(params, lr=LR),
        comm=comm,
        fraction=fraction,
        partners=partners,
        seed=seed,
        broadcast_initial=False,
    )
    return peer.take_steps(opt, params, loss, STEPS)


@pytest.mark.parametrize("partners, n", [("one", 4), ("one", 5), ("all", 4)], ids=["pairs", "pairs-odd", "all"])
def test_real_peers_follow_the_rule(partners, n):
    got = np.stack(run_local(n, trajectory, P, partners, 1), axis=1)
    want = reference(P, partners, 1, n)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    alone = reference(1e-9, partners, 1, n)  # nothing averaged: each peer's own SGD
    assert np.abs(want - alone).max() > 1e-3


def test_fleet_equals_real_peers():
    assert_fleet_equals_local(config("sparta", "ring", 4, fraction=0.05), 10)


def test_only_the_selected_values_travel_to_one_partner():
    """A peer sends the p D selected values a step to its one partner (the mask's indices never travel)."""

    def sent(comm):
        params = [torch.nn.Parameter(torch.zeros(10_000))]
        opt = SPARTA(torch.optim.SGD(params, lr=0.1), comm=comm, fraction=0.005)
        for _ in range(4):
            params[0].grad = torch.ones(10_000)
            opt.step()
        chosen = sum(len(opt.mask(k, 10_000)) for k in range(4))
        return comm.stats.bytes_sent, chosen

    for got, chosen in run_local(4, sent):
        assert 4 * 30 < chosen < 4 * 70  # about 0.5% of 10,000 a step
        assert got == 4 * chosen  # float32 values, one partner (n = 4: everyone paired)


def test_bad_options_are_refused_in_one_line():
    def build(comm, **options):
        params, _ = peer.model(comm)
        return SPARTA(torch.optim.SGD(params, lr=LR), comm=comm, **options)

    for options, words in (
        ({"fraction": 0.0}, "must be in \\(0, 1\\]"),
        ({"fraction": 2}, "must be in"),
        ({"partners": "two"}, "'one'"),
        ({"seed": -1}, "seed must be"),
    ):
        with pytest.raises(ValueError, match=words):
            run_local(1, build, **options)


@pytest.mark.slow  # 54 s at load 11 on 2 cores (4 MPI processes starting torch)
@pytest.mark.processes
def test_mpi_processes_follow_both_references(tmp_path):
    """4 MPI processes: SPARTA (pairs and all) and DiLoCo's delayed and eager outer steps, each case against its
    numpy reference (tests/peers/issue39_peer.py), in one launch."""
    import json

    from peers import issue39_peer
    from test_delayed_outer import reference as delayed_reference

    from dpsgd.backends import spawn

    code = spawn("mpi", N, [issue39_peer.__file__, "mpi", str(tmp_path)], timeout_s=180)
    assert code == 0, f"mpi peers exited with {code}"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(N)]
    wants = [delayed_reference(1, False), delayed_reference(1, True), reference(P, "one", 1), reference(P, "all", 1)]
    for c, want in enumerate(wants):
        got = np.stack([np.array(ranks[r][c]) for r in range(N)], axis=1)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-10, err_msg=str(issue39_peer.CASES[c]))
