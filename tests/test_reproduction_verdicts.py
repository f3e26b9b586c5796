"""Reproductions' analyses on hand-made measurements whose verdict is known: each one's `analyze` must say
holds, does not hold or partly holds as its rule does, and decide on the quantity its claim is about (fast; the
end-to-end runs are in test_reproduce.py and test_reproductions_repro_*.py)."""

import pytest

from experiments.reproduce import Configuration
from experiments.reproductions import kong2021, lian2017, lin2021

OPENING = {True: "holds", False: "does not hold", None: "partly holds"}


def config(setting: dict, runs: list[dict] | None = None, **summary) -> Configuration:
    """One setting's measurements: the summary's means and 95% half widths (KEY_ci95), no curves unless given."""
    summary = {"steps": 100, "seeds": 3, "peers": 4, **summary}
    # a run as experiments.report.load_runs reads one: its flat config, no recorded overrides, a one-point curve
    one = {"dir": "run", "summary": summary, "config": dict(setting), "overrides": None}
    return Configuration(setting, summary, [{**one, **r} for r in runs or [{"metrics": [{"step": 100, **summary}]}]])


@pytest.mark.parametrize(("dpsgd_accuracy", "holds"), [(0.905, True), (0.895, True), (0.85, False), (0.95, False)])
def test_lian2017_holds_when_dpsgd_is_within_the_intervals_of_allreduce(tmp_path, dpsgd_accuracy, holds):
    runs = [
        config({"algorithm": "allreduce"}, test_accuracy=0.9, test_accuracy_ci95=0.006, mb_sent_per_peer=1.5),
        config({"algorithm": "dpsgd"}, test_accuracy=dpsgd_accuracy, test_accuracy_ci95=0.006, mb_sent_per_peer=2.0),
    ]
    finding = lian2017.analyze({"main": runs}, tmp_path)
    assert finding.holds is holds  # |gap| against the intervals' 0.012
    assert finding.verdict.startswith("the accuracy holds" if holds else "the accuracy does not hold")
    assert "1.333x" in finding.verdict  # the measured byte ratio, 2.0 / 1.5


def lin_configs(mnist_drops: dict[str, float], peer_drops: dict[str, float] | None = None) -> dict:
    """lin2021's four sweeps with no drop on digits and the given accuracy drops (alpha 10 -> 0.1) on Fashion-MNIST;
    the peers' own models drop by `peer_drops` (default the same)."""
    peer_drops = peer_drops or mnist_drops

    def cell(algorithm: str, alpha: str, drops: dict[str, float]) -> Configuration:
        low = alpha == "0.1"
        setting = {"data.alpha": alpha} if algorithm == "allreduce" else {"algorithm": algorithm, "data.alpha": alpha}
        return config(
            setting,
            test_accuracy=0.9 - (drops[algorithm] if low else 0.0),
            test_accuracy_ci95=0.002,
            peer_test_accuracy_mean=0.9 - (peer_drops[algorithm] if low and drops is mnist_drops else 0.0),
            peer_test_accuracy_mean_ci95=0.002,
            consensus_distance=0.1,
        )

    none = dict.fromkeys(("allreduce", "dpsgd", "qgm"), 0.0)
    return {
        "allreduce": [cell("allreduce", a, none) for a in lin2021.ALPHAS],
        "gossip": [cell(g, a, none) for g in ("dpsgd", "qgm") for a in lin2021.ALPHAS],
        "fashion_allreduce": [cell("allreduce", a, mnist_drops) for a in ("10", "0.1")],
        "fashion_gossip": [cell(g, a, mnist_drops) for g in ("dpsgd", "qgm") for a in ("10", "0.1")],
    }


@pytest.mark.parametrize(
    ("drops", "holds"),
    [
        ({"allreduce": 0.01, "dpsgd": 0.1, "qgm": 0.02}, True),  # QGM avoids 8 of D-PSGD's 9 extra points
        ({"allreduce": 0.01, "dpsgd": 0.1, "qgm": 0.09}, None),  # it avoids 1 of 9
        ({"allreduce": 0.01, "dpsgd": 0.012, "qgm": 0.0}, False),  # D-PSGD's extra 0.2 points: noise
    ],
)
def test_lin2021_decides_on_the_harder_tasks_averaged_model(tmp_path, drops, holds):
    # the peers' own models tell the opposite story: a verdict read from them would differ
    opposite = {"allreduce": 0.01, "dpsgd": 0.012, "qgm": 0.0} if holds is not False else {**drops, "dpsgd": 0.1}
    finding = lin2021.analyze(lin_configs(drops, opposite), tmp_path)
    assert finding.holds is holds
    assert finding.verdict.startswith(f"{OPENING[holds]} on the harder task")


def kong_configs(points: list[tuple[float, float, float]]) -> dict:
    """kong2021's sweeps: all-reduce at accuracy 0.9 (± 0.002) and one gossip setting per (consensus distance,
    averaged model's accuracy, peers' own accuracy)."""
    reference = config(
        {},
        [{"metrics": [], "summary": {"test_accuracy": 0.9, "peer_test_accuracy_mean": 0.9}}],
        test_accuracy=0.9,
        test_accuracy_ci95=0.002,
        peer_test_accuracy_mean=0.9,
        peer_test_accuracy_mean_ci95=0.002,
    )
    gossip = [
        config(
            {"topology": "ring", "topology.self_weight": f"0.{k + 1}"},
            [{"metrics": [{"step": 100, "consensus_distance": d}]}],
            test_accuracy=acc,
            test_accuracy_ci95=0.002,
            peer_test_accuracy_mean=own,
            peer_test_accuracy_mean_ci95=0.002,
        )
        for k, (d, acc, own) in enumerate(points)
    ]
    return {"allreduce": [reference], "graphs": gossip[:1], "ring": gossip[1:]}


@pytest.mark.parametrize(
    ("points", "holds", "says"),
    [
        # kept below 0.1, fell from 1.0 on (the peers' own models fall from the start: not what decides)
        ([(0.01, 0.9, 0.8), (0.1, 0.899, 0.8), (1.0, 0.85, 0.8), (10.0, 0.8, 0.8)], True, "between 0.1"),
        ([(0.01, 0.9, 0.8), (0.1, 0.899, 0.8), (1.0, 0.9, 0.8)], False, "no critical value"),  # nothing fell
        ([(0.01, 0.85, 0.9), (0.1, 0.9, 0.9), (1.0, 0.8, 0.9)], False, "do not order"),  # a fall below a keep
        ([(0.01, 0.85, 0.9), (0.1, 0.8, 0.9)], None, "every setting lost"),
    ],
)
def test_kong2021_reads_the_averaged_models_accuracy_against_the_distance(tmp_path, points, holds, says):
    finding = kong2021.analyze(kong_configs(points), tmp_path)
    assert finding.holds is holds
    averaged = finding.verdict.split(". For the peers' own models")[0]
    assert averaged.startswith(f"for the averaged model's accuracy, {OPENING[holds]}") and says in averaged
