"""The optimizer contract on one peer: (1) every algorithm, built on a model seeded by this peer's rank,
leaves the peers holding rank 0's parameters (`broadcast_initial`); (2) a user's algorithm from outside
the package (tests/plugins.py, named by `_target_`) trains 20 steps of the experiment `config()`.

Imported by tests/test_contract.py (local backend) and run as a script under real launchers:
`python tests/peers/contract_peer.py BACKEND OUT_DIR` writes OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))  # plugins.py (the user's own module) and runs.py

import runs  # noqa: E402

import topologies  # noqa: E402
from dpsgd.build import build_peer  # noqa: E402
from dpsgd.config import parse  # noqa: E402
from dpsgd.optim import ALGORITHMS, build  # noqa: E402

STEPS = 20
TOPOLOGY = {"sgp": "directed_exponential"}  # the rest run on a ring


def config(peers: int = 4, backend: str = "local") -> dict:
    algorithm = {"name": "alternating", "_target_": "plugins.AlternatingGossip", "period": 7}
    return runs.experiment(algorithm, "ring", peers, backend)


def seeded_model(rank: int) -> torch.nn.Module:
    """A model whose parameters differ per rank, drawn from the rank's own generator: local-backend
    peers are threads, and torch's global RNG would be shared (and raced) between them."""
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    generator = torch.Generator().manual_seed(1000 + rank)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    return model


def initial_parameters(comm) -> dict:
    """Each algorithm's parameters right after construction, on a model seeded by this rank."""
    out = {}
    for name in ALGORITHMS:
        model = seeded_model(comm.rank)
        # the config's options as a run's build hands them over (a `_target_` dict made its factory)
        options = runs.own_options(name)
        topology = topologies.make(TOPOLOGY.get(name, "ring"), comm.size)
        opt = build(name, torch.optim.SGD(model.parameters(), lr=0.1), topology=topology, comm=comm, **options)
        if opt.asynchronous:
            opt.set_budget(steps=0, samples=0)
            opt.finish()  # its communication threads end with the closing handshake
        out[name] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
    return out


def plugin_parameters(comm) -> list[float]:
    peer = build_peer(comm, parse(config(comm.size, comm.backend)))
    for step in range(1, STEPS + 1):
        peer.step(step)
    return torch.cat([p.detach().reshape(-1) for p in peer.model.parameters()]).tolist()


def all_trajectories(comm) -> dict:
    return {"initial": initial_parameters(comm), "plugin": plugin_parameters(comm)}


if __name__ == "__main__":
    from runner import main

    main(all_trajectories)
