"""One peer's trajectories under LocalSGD / SlowMo / DiLoCo on the least-squares problem of
`quadratic.py`, one per case of CASES.

Imported by tests/test_local_sgd.py (local backend) and run as a script under real launchers:
`python tests/peers/local_sgd_peer.py BACKEND OUT_DIR` writes OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import functools

import torch

try:
    from peers import quadratic as q
except ImportError:  # run as a script: tests/peers is the script's own folder
    import quadratic as q

from dpsgd.optim import build
from dpsgd.options import factories

STEPS = 12
SGD = {"_target_": "torch.optim.SGD"}
ADAM = functools.partial(torch.optim.Adam, lr=0.02, betas=(0.8, 0.95))
# (name, base optimizer, base options, algorithm options): name is a key of dpsgd.optim.ALGORITHMS
CASES = [
    ("local_sgd", "sgd", {"lr": 0.05}, {"period": 3}),
    ("local_sgd", "sgd", {"lr": 0.05, "momentum": 0.9}, {"period": 3}),
    ("local_sgd", "sgd", {"lr": 0.05, "momentum": 0.9}, {"period": 3, "warmup_steps": 4}),
    ("local_sgd", "sgd", {"lr": 0.05, "momentum": 0.9}, {"period": 3, "inner_state": "reset"}),
    ("local_sgd", "sgd", {"lr": 0.05, "momentum": 0.9}, {"period": 3, "inner_state": "average"}),
    ("slowmo", "sgd", {"lr": 0.05, "momentum": 0.9}, {"period": 3, "outer": {**SGD, "lr": 1.2, "momentum": 0.5}}),
    ("slowmo", "sgd", {"lr": 0.05}, {"period": 2, "warmup_steps": 3, "inner_state": "average"}),
    ("diloco", "sgd", {"lr": 0.05}, {"period": 3}),
    ("diloco", "adamw", {"lr": 0.05, "weight_decay": 0.1}, {"period": 3}),
    ("diloco", "adamw", {"lr": 0.05, "weight_decay": 0.1}, {"period": 3, "inner_state": "reset"}),
    ("local_sgd", "sgd", {"lr": 0.05, "momentum": 0.9}, {"period": 2, "group_size": 2, "global_period": 4}),
    (
        "local_sgd",
        "sgd",
        {"lr": 0.05, "momentum": 0.9},
        {"period": 2, "group_size": 2, "global_period": 4, "inner_state": "average"},
    ),
    (
        "slowmo",
        "sgd",
        {"lr": 0.05, "momentum": 0.9},
        {"period": 2, "group_size": 2, "global_period": 4, "inner_state": "reset"},
    ),
    ("bmuf", "sgd", {"lr": 0.05}, {"period": 3}),
    # a user's torch optimizer as the outer one, in the library's form (a factory) and a config's (`_target_`,
    # made a factory by dpsgd.build.factories as a run's build does)
    ("local_sgd", "sgd", {"lr": 0.05, "momentum": 0.9}, {"period": 3, "outer": ADAM}),
    (
        "diloco",
        "adamw",
        {"lr": 0.05, "weight_decay": 0.1},
        {"period": 2, "outer": {"_target_": "torch.optim.Adam", "lr": 0.03}},
    ),
]


def make_base(kind: str, params, options: dict) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, **options)
    return torch.optim.AdamW(params, **options)


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


def take_steps(opt, params, loss, steps: int) -> list[list[float]]:
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss().backward()
        opt.step()
        out.append(torch.cat([p.detach() for p in params]).tolist())
    return out


def trajectory(comm, case, steps: int = STEPS) -> list[list[float]]:
    name, kind, base_options, options = case
    params, loss = model(comm)
    opt = build(
        name,
        make_base(kind, params, base_options),
        topology=None,
        comm=comm,
        broadcast_initial=False,
        **factories(options),
    )
    return take_steps(opt, params, loss, steps)


def all_trajectories(comm) -> list:
    return [trajectory(comm, case) for case in CASES]


if __name__ == "__main__":
    from runner import main

    main(all_trajectories)
