"""NoLoCo, DeMo, SparseLoCo and DES-LOC on a least-squares problem: one peer's trajectory (float64), for the
numpy references of tests/test_frontier_references.py. The model is a matrix (8 x 6) and a vector (12), so
the chunked codes cut tiles and chunks; `fleet_trajectories` runs every peer at once on stacked tensors.

Run as a script under real launchers: `python tests/peers/frontier_peer.py BACKEND OUT_DIR` writes
OUT_DIR/rank{r}.json (each case's trajectory and bytes sent).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from dpsgd.optim import build

SHAPES, ROWS, STEPS, LR = ((8, 6), (12,)), 20, 12, 0.05
DIM = sum(int(np.prod(s)) for s in SHAPES)
CASES = {  # name -> (algorithm, base optimizer, options)
    "noloco": ("noloco", "sgd", {"period": 3, "outer": functools.partial(torch.optim.SGD, lr=0.7, momentum=0.5)}),
    "noloco-gamma": (
        "noloco",
        "sgd",
        {"period": 2, "gamma": 0.2, "outer": functools.partial(torch.optim.SGD, lr=0.9, momentum=0.3)},
    ),
    "demo": ("demo", "sgd", {"decay": 0.9, "topk": 3, "chunk": 4}),
    "demo-mean": ("demo", "sgd_decay", {"decay": 0.9, "topk": 3, "chunk": 4, "aggregate": "mean"}),
    "sparseloco": (
        "sparseloco",
        "sgd_momentum",
        {
            "period": 3,
            "decay": 0.9,
            "topk": 3,
            "chunk": 4,
            "bits": 2,
            "outer": functools.partial(torch.optim.SGD, lr=1.0),
        },
    ),
    "sparseloco-fp": (
        "sparseloco",
        "sgd",
        {
            "period": 2,
            "decay": 0.5,
            "topk": 2,
            "chunk": 4,
            "bits": None,
            "outer": functools.partial(torch.optim.SGD, lr=0.8),
        },
    ),
    "desloc": ("desloc", "adam", {"param_period": 2, "momentum_period": 3, "variance_period": 5}),
}


def problem(n: int, seed: int = 0):
    """Peer i: f_i(x) = 1/(2 ROWS) ||A_i x - b_i||^2, starting at x0 (the same for every peer)."""
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, ROWS, DIM)), rng.normal(size=(n, ROWS)), rng.normal(size=DIM)


WEIGHT_DECAY = 0.5  # of the "sgd_decay" base


def base(kind: str, params):
    if kind == "adam":
        return torch.optim.Adam(params, lr=LR)
    decay = WEIGHT_DECAY if kind == "sgd_decay" else 0.0
    return torch.optim.SGD(params, lr=LR, momentum=0.9 if kind == "sgd_momentum" else 0.0, weight_decay=decay)


def _params(x0: np.ndarray, lead: tuple[int, ...]) -> list[torch.nn.Parameter]:
    out, at = [], 0
    for shape in SHAPES:
        size = int(np.prod(shape))
        value = torch.tensor(x0[at : at + size]).reshape(shape)
        out.append(torch.nn.Parameter(value.expand(*lead, *shape).clone()))
        at += size
    return out


def trajectory(comm, case: str) -> tuple[list, int]:
    """x_i after each step, and the bytes this peer sent."""
    name, kind, options = CASES[case]
    A, b, x0 = problem(comm.size)
    A_i, b_i = torch.tensor(A[comm.rank]), torch.tensor(b[comm.rank])
    params = _params(x0, ())
    sent = comm.stats.bytes_sent
    opt = build(name, base(kind, params), comm=comm, **options)
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        x = torch.cat([p.reshape(-1) for p in params])
        (0.5 / ROWS * (A_i @ x - b_i).pow(2).sum()).backward()
        opt.step()
        out.append(torch.cat([p.detach().reshape(-1) for p in params]).tolist())
    return out, comm.stats.bytes_sent - sent


def fleet_trajectory(n: int, case: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, n, DIM) on the fleet's stacked tensors, and each peer's bytes sent."""
    from dpsgd.sim.fleet import FleetCommunicator

    name, kind, options = CASES[case]
    comm = FleetCommunicator(n)
    A, b, x0 = (torch.tensor(v) for v in problem(n))
    params = _params(x0.numpy(), (n,))
    opt = build(name, base(kind, params), comm=comm, **options)
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        x = torch.cat([p.reshape(n, -1) for p in params], 1)
        residual = torch.einsum("nrd,nd->nr", A, x) - b
        (0.5 / ROWS * residual.pow(2).sum()).backward()
        opt.step()
        out.append(torch.cat([p.detach().reshape(n, -1) for p in params], 1).numpy())
    return np.array(out), comm.bytes_sent.numpy()


def all_trajectories(comm) -> dict:
    return {case: trajectory(comm, case) for case in CASES}


if __name__ == "__main__":
    from runner import main

    main(all_trajectories)
