"""A least-squares problem split over peers, and one peer's trajectory under each optimizer.

Imported by the tests (local backend) and run as a script under real launchers:
`python tests/peers/quadratic.py BACKEND OUT_DIR` writes OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import numpy as np
import torch

import topologies
from dpsgd.optim import DPSGD, AllReduce

DIM, ROWS, STEPS = 5, 6, 12
CASES = [  # (algorithm, topology, order, momentum)
    ("allreduce", "ring", None, 0.0),
    ("allreduce", "ring", None, 0.9),
    ("dpsgd", "ring", "cta", 0.0),
    ("dpsgd", "ring", "atc", 0.0),
    ("dpsgd", "one_peer_exponential", "cta", 0.9),
    ("dpsgd", "one_peer_exponential", "atc", 0.9),
    ("dpsgd", "exponential", "cta", 0.5),
]
LR = 0.05


def problem(n: int, seed: int = 0):
    """Peer i holds f_i(x) = 1/(2 ROWS) ||A_i x - b_i||^2 and starts at its own x0_i."""
    rng = np.random.default_rng(seed)
    A = rng.normal(size=(n, ROWS, DIM))
    b = rng.normal(size=(n, ROWS))
    x0 = rng.normal(size=(n, DIM))
    return A, b, x0


def make_optimizer(algorithm, topology_name, order, momentum, params, comm):
    base = torch.optim.SGD(params, lr=LR, momentum=momentum)
    if algorithm == "allreduce":
        return AllReduce(base, comm=comm, topology=None, broadcast_initial=False)
    return DPSGD(
        base, topology=topologies.make(topology_name, comm.size), comm=comm, order=order, broadcast_initial=False
    )


def trajectory(comm, case) -> list[list[float]]:
    """x_i after each step; the parameter is split in two tensors to exercise flattening."""
    A, b, x0 = problem(comm.size)
    A_i, b_i = torch.tensor(A[comm.rank]), torch.tensor(b[comm.rank])
    head = torch.nn.Parameter(torch.tensor(x0[comm.rank][:3]))
    tail = torch.nn.Parameter(torch.tensor(x0[comm.rank][3:]))
    opt = make_optimizer(*case, [head, tail], comm)
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        x = torch.cat([head, tail])
        loss = 0.5 / ROWS * (A_i @ x - b_i).pow(2).sum()
        loss.backward()
        opt.step()
        out.append(torch.cat([head, tail]).tolist())
    return out


def all_trajectories(comm) -> list:
    return [trajectory(comm, case) for case in CASES]


if __name__ == "__main__":
    from runner import main

    main(all_trajectories)
