"""he2022's verdict on hand-made measurements (fast); the end-to-end run is `python -m experiments.reproduce he2022`."""

import pytest
from test_reproduction_verdicts import OPENING, config

from experiments.reproductions import he2022


def configs(plain: dict[str, float], clipped: dict[str, float]) -> dict:
    def cell(accuracy: float, **setting):
        return config(setting, test_accuracy=accuracy, test_accuracy_ci95=0.004, peers=12)

    return {
        "clean": [cell(0.95)],
        "clean_clipped": [cell(0.948)],
        "plain": [cell(plain[a], **{"faults.corrupt_mode": a}) for a in he2022.ATTACKS],
        "clipped": [cell(clipped[a], **{"faults.corrupt_mode": a}) for a in he2022.ATTACKS],
    }


@pytest.mark.parametrize(
    ("plain", "clipped", "holds"),
    [
        ((0.6, 0.1, 0.94), (0.94, 0.945, 0.93), True),  # plain fails on two attacks, ClippedGossip keeps all
        ((0.6, 0.1, 0.94), (0.94, 0.80, 0.93), None),  # ClippedGossip loses one
        ((0.94, 0.94, 0.94), (0.80, 0.80, 0.80), False),  # no attack hurts plain gossip, ClippedGossip loses all
    ],
)
def test_verdict(tmp_path, plain, clipped, holds):
    finding = he2022.analyze(configs(dict(zip(he2022.ATTACKS, plain)), dict(zip(he2022.ATTACKS, clipped))), tmp_path)
    assert finding.holds is holds
    assert finding.verdict.startswith(OPENING[holds])
    assert "costs 0.0020 of accuracy" in finding.verdict  # the honest-peer cost, 0.948 - 0.95
