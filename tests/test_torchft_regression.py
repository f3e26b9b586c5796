"""Streaming DiLoCo against torchft's DiLoCo regression values (pytorch/torchft, test_fixtures/
torchft.diloco_regression_test.DiLoCoMockedUpdateTest.test_diloco_mocked_updates_{0..5}.json): 2 replicas, a
model of two 1 x 1 weights starting at 1 (one fragment each), every gradient 2, inner SGD lr 1, outer SGD lr 2,
sync_every 6, fragment_sync_delay 0 or 1, fragment_update_alpha 0, 0.5 or 1. The values below are the
fixtures' own: each weight after k = 0 .. 15 inner steps, and the outer (global) weights at k = 0, 3, 6, 9, 12.
They are checked on the local backend and on the fleet."""

from __future__ import annotations

import functools

import pytest
import torch

from dpsgd.comm import run_local
from dpsgd.optim import StreamingDiLoCo

# (delay, alpha) -> (weight 0 after each step, weight 1 after each step, {k: (global 0, global 1)})
FIXTURES = {
    (0, 0.0): (
        [1, -1, -3, -11, -13, -15, -17, -19, -21, -35, -37, -39, -41, -43, -45, -59],
        [1, -1, -3, -5, -7, -9, -23, -25, -27, -29, -31, -33, -47, -49, -51, -53],
        {0: (1, 1), 3: (-11, 1), 6: (-11, -23), 9: (-35, -23), 12: (-35, -47)},
    ),
    (0, 0.5): (
        [1, -1, -3, -8, -10, -12, -14, -16, -18, -24.5, -26.5, -28.5, -30.5, -32.5, -34.5, -40.25],
        [1, -1, -3, -5, -7, -9, -17, -19, -21, -23, -25, -27, -32, -34, -36, -38],
        {0: (1, 1), 3: (-11, 1), 6: (-11, -23), 9: (-29, -23), 12: (-29, -35)},
    ),
    (0, 1.0): (
        [1, -1, -3, -5, -7, -9, -11, -13, -15, -17, -19, -21, -23, -25, -27, -29],
        [1, -1, -3, -5, -7, -9, -11, -13, -15, -17, -19, -21, -23, -25, -27, -29],
        {0: (1, 1), 3: (-11, 1), 6: (-11, -23), 9: (-23, -23), 12: (-23, -23)},
    ),
    (1, 0.0): (
        [1, -1, -3, -7, -9, -11, -13, -15, -17, -27, -29, -31, -33, -35, -37, -47],
        [1, -1, -3, -5, -7, -9, -19, -21, -23, -25, -27, -29, -39, -41, -43, -45],
        {0: (1, 1), 3: (-7, 1), 6: (-7, -19), 9: (-27, -19), 12: (-27, -39)},
    ),
    (1, 0.5): (
        [1, -1, -3, -6, -8, -10, -12, -14, -16, -21.5, -23.5, -25.5, -27.5, -29.5, -31.5, -35.75],
        [1, -1, -3, -5, -7, -9, -15, -17, -19, -21, -23, -25, -29, -31, -33, -35],
        {0: (1, 1), 3: (-7, 1), 6: (-7, -19), 9: (-25, -19), 12: (-25, -31)},
    ),
    (1, 1.0): (
        [1, -1, -3, -5, -7, -9, -11, -13, -15, -17, -19, -21, -23, -25, -27, -29],
        [1, -1, -3, -5, -7, -9, -11, -13, -15, -17, -19, -21, -23, -25, -27, -29],
        {0: (1, 1), 3: (-7, 1), 6: (-7, -19), 9: (-23, -19), 12: (-23, -23)},
    ),
}


def history(comm, delay: int, alpha: float, lead: tuple[int, ...] = ()) -> tuple[list, list]:
    """Both weights after k = 0 .. 15 steps, and the outer weights (the anchor) after k steps."""
    weights = [torch.nn.Parameter(torch.ones(*lead, 1, 1)) for _ in range(2)]
    opt = StreamingDiLoCo(
        torch.optim.SGD(weights, lr=1.0),
        comm=comm,
        period=6,
        fragments=2,
        delay=delay,
        alpha=alpha,
        outer=functools.partial(torch.optim.SGD, lr=2.0),
    )
    params, anchors = [], []
    for _ in range(16):
        params.append([float(w.detach().reshape(-1)[0]) for w in weights])
        anchors.append([float(a.reshape(-1)[0]) for a in opt._outer.anchors] if opt._outer.anchored else [1.0, 1.0])
        for w in weights:
            w.grad = torch.full_like(w, 2.0)
        opt.step()
    return params, anchors


def check(params: list, anchors: list, delay: int, alpha: float) -> None:
    first, second, outer = FIXTURES[(delay, alpha)]
    assert [p[0] for p in params] == first
    assert [p[1] for p in params] == second
    assert {k: tuple(anchors[k]) for k in outer} == outer


@pytest.mark.parametrize(("delay", "alpha"), list(FIXTURES))
def test_local_backend_matches_torchft(delay, alpha):
    for params, anchors in run_local(2, history, delay, alpha):  # both replicas
        check(params, anchors, delay, alpha)


@pytest.mark.parametrize(("delay", "alpha"), list(FIXTURES))
def test_fleet_matches_torchft(delay, alpha):
    from dpsgd.sim.fleet import FleetCommunicator

    params, anchors = history(FleetCommunicator(2), delay, alpha, lead=(2,))
    check(params, anchors, delay, alpha)
