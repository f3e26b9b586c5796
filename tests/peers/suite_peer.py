"""One peer's trajectories under SGP / Choco / D2 / GradientTracking / QGM on the least-squares
problem of `quadratic.py`, one per case of CASES.

Imported by tests/test_algorithms.py (local backend) and run as a script under real launchers:
`python tests/peers/suite_peer.py BACKEND OUT_DIR` writes OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import torch

try:
    from peers import quadratic as q
except ImportError:  # run as a script: tests/peers is the script's own folder
    import quadratic as q

import topologies
from dpsgd.optim import build

STEPS = 12
# (algorithm, topology, base SGD options, algorithm options): algorithm is a key of ALGORITHMS
CASES = [
    ("sgp", "directed_exponential", {"lr": 0.05}, {}),
    ("sgp", "one_peer_directed_exponential", {"lr": 0.05, "momentum": 0.9}, {}),
    ("sgp", "ring", {"lr": 0.05, "momentum": 0.5}, {}),
    ("choco", "ring", {"lr": 0.05}, {"compressor": "top_k", "ratio": 0.4, "gamma": 0.5}),
    ("choco", "exponential", {"lr": 0.05, "momentum": 0.9}, {"compressor": "top_k", "ratio": 0.6, "gamma": 0.3}),
    ("d2", "exponential", {"lr": 0.05}, {}),
    ("d2", "ring", {"lr": 0.05, "momentum": 0.5}, {"lazy_mixing": "auto"}),
    ("gradient_tracking", "ring", {"lr": 0.05}, {}),
    ("gradient_tracking", "one_peer_exponential", {"lr": 0.05, "momentum": 0.9}, {}),
    ("qgm", "ring", {"lr": 0.05}, {"order": "atc", "beta": 0.9}),
    ("qgm", "one_peer_exponential", {"lr": 0.05, "weight_decay": 0.1}, {"order": "cta", "beta": 0.8, "mu": 0.5}),
    ("dpsgd", "ring", {"lr": 0.05}, {"order": "atc", "qgm": True, "qgm_beta": 0.7}),
]


def model(comm):
    """x_i split in two tensors (to exercise flattening), and the peer's loss."""
    A, b, x0 = q.problem(comm.size)
    A_i, b_i = torch.tensor(A[comm.rank]), torch.tensor(b[comm.rank])
    head = torch.nn.Parameter(torch.tensor(x0[comm.rank][:3]))
    tail = torch.nn.Parameter(torch.tensor(x0[comm.rank][3:]))

    def loss():
        x = torch.cat([head, tail])
        return 0.5 / q.ROWS * (A_i @ x - b_i).pow(2).sum()

    return [head, tail], loss


def optimizer(case, params, comm):
    name, topology, base_options, options = case
    base = torch.optim.SGD(params, **base_options)
    return build(
        name, base, topology=topologies.make(topology, comm.size), comm=comm, broadcast_initial=False, **options
    )


def run(opt, params, loss, steps: int) -> list[list[float]]:
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss().backward()
        opt.step()
        out.append(torch.cat([p.detach() for p in params]).tolist())
    return out


def trajectory(comm, case, steps: int = STEPS) -> list[list[float]]:
    params, loss = model(comm)
    return run(optimizer(case, params, comm), params, loss, steps)


def all_trajectories(comm) -> list:
    return [trajectory(comm, case) for case in CASES]


if __name__ == "__main__":
    from runner import main

    main(all_trajectories)
