"""One peer's trajectories of DiLoCo's delayed and eager outer steps and of SPARTA on the least-squares problem of
`quadratic.py`, one per case of CASES.

Imported by tests/test_sparta.py and run as a script under real launchers:
`python tests/peers/issue39_peer.py BACKEND OUT_DIR` writes OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import torch

try:
    from peers import local_sgd_peer as peer
except ImportError:  # run as a script: tests/peers is the script's own folder
    import local_sgd_peer as peer

from dpsgd.optim import build

LR = 0.05
# (algorithm, its options, steps): the cases of tests/test_delayed_outer.py and tests/test_sparta.py
CASES = [
    ("diloco", {"period": 3, "outer_delay": 1}, 13),
    ("diloco", {"period": 3, "outer_delay": 1, "eager": True}, 13),
    ("sparta", {"fraction": 0.3, "seed": 1}, 12),
    ("sparta", {"fraction": 0.3, "partners": "all", "seed": 1}, 12),
]


def trajectory(comm, name: str, options: dict, steps: int) -> list[list[float]]:
    params, loss = peer.model(comm)
    opt = build(name, torch.optim.SGD(params, lr=LR), topology=None, comm=comm, broadcast_initial=False, **options)
    out = peer.take_steps(opt, params, loss, steps)
    opt.state_dict()  # completes the outer exchange still in flight before the next case reuses its stream
    return out


def all_trajectories(comm) -> list:
    return [trajectory(comm, *case) for case in CASES]


if __name__ == "__main__":
    from runner import main

    main(all_trajectories)
