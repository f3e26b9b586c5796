"""The optimizer contract, checked on every backend: a user's algorithm written in one file outside the
package (tests/plugins.py, plugged in with `_target_`) gives the same parameters after 20 steps on the
local backend, real mpi and torch processes and the fleet; under mpiexec and torch.distributed, ranks
whose models were seeded differently hold rank 0's parameters once any optimizer is built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peers import contract_peer as peer

from dpsgd.backends import spawn
from dpsgd.comm import run_local
from dpsgd.config import parse
from dpsgd.optim import ALGORITHMS
from dpsgd.sim import Fleet

N = 4
SCRIPT = str(Path(__file__).parent / "peers" / "contract_peer.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """Every rank's result on each real backend."""
    out = {"local": run_local(N, peer.all_trajectories, timeout_s=60)}
    for backend in ("mpi", "torch"):
        folder = tmp_path_factory.mktemp(backend)
        code = spawn(backend, N, [SCRIPT, backend, str(folder)], timeout_s=180)
        assert code == 0, f"{backend} peers exited with {code}"
        out[backend] = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(N)]
    return out


def test_a_users_algorithm_gives_the_same_parameters_on_every_backend(results):
    fleet = Fleet(parse(peer.config(N, "fleet")))
    for step in range(1, peer.STEPS + 1):
        fleet.step(step)
    expected = fleet.flat()
    assert (expected - expected.mean(0)).abs().max() > 1e-4  # gossip left the peers apart: not trivially equal
    for backend, ranks in results.items():
        got = torch.tensor([r["plugin"] for r in ranks])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=lambda m, b=backend: f"{b}: {m}")


@pytest.mark.parametrize("backend", ["local", "mpi", "torch"])
def test_peers_seeded_differently_start_from_rank_0s_parameters(results, backend):
    ranks = results[backend]
    for name in ALGORITHMS:
        first = ranks[0]["initial"][name]
        assert all(r["initial"][name] == first for r in ranks[1:]), f"{backend}: {name} left the peers apart"
    seeded = [peer.seeded_model(r)[0].weight.reshape(-1)[0].item() for r in range(N)]
    assert len(set(seeded)) == N and ranks[0]["initial"]["dpsgd"][0] == pytest.approx(seeded[0])
