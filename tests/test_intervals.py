"""Seeds and intervals: the Student-t arithmetic against scipy.stats, `seeds=N` on the command line, and the
report's rows and bands for a real sweep over seeds."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from experiments.intervals import band, describe, half_width, mean_interval, summarize
from experiments.train import expand_seeds
from experiments.validate import ConfigError

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "values",
    [
        [0.961, 0.964],
        [1.0, 2.0, 3.0, 4.0, 5.0],
        list(np.random.default_rng(7).normal(0.9, 0.02, size=10)),
        list(np.random.default_rng(8).exponential(3.0, size=31)),
    ],
)
@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_interval_equals_scipy(values, confidence):
    mean, half = mean_interval(values, confidence)
    low, high = stats.t.interval(confidence, len(values) - 1, loc=np.mean(values), scale=stats.sem(values))
    assert mean == pytest.approx((low + high) / 2, rel=1e-12)
    assert half == pytest.approx((high - low) / 2, rel=1e-12)


def test_interval_on_a_worked_example():
    # 1..5: mean 3, s = sqrt(2.5), t(0.975, 4) = 2.776445 (printed tables): half width 2.776445 * sqrt(2.5 / 5)
    assert mean_interval([1, 2, 3, 4, 5]) == pytest.approx((3.0, 1.963243), abs=1e-6)
    assert np.isnan(half_width([0.5]))  # one seed: a mean, no interval
    with pytest.raises(ValueError, match="at least one run"):
        mean_interval([])


def test_summary_of_seeds_and_band():
    runs = [
        {"algorithm": "dpsgd", "peers": 8, "seed": s, "test_accuracy": a, "converged": True}
        for s, a in enumerate([0.90, 0.94, 0.95])
    ]
    row = summarize(runs)
    assert row["seeds"] == 3 and "seed" not in row and row["converged"] is True
    assert row["peers"] == 8 and "peers_ci95" not in row  # the same in every run: a setting, not a measurement
    assert row["test_accuracy"] == pytest.approx(0.93)
    assert row["test_accuracy_ci95"] == pytest.approx(half_width([0.90, 0.94, 0.95]))
    means, halves = band([[1.0, 2.0, 3.0], [3.0, 4.0], [2.0, 3.0, 9.0]])  # over the common length
    assert means.tolist() == [2.0, 3.0]
    assert halves[0] == pytest.approx(stats.t.ppf(0.975, 2) * 1 / np.sqrt(3))


def test_what_plus_minus_means():
    assert describe([3, 3]).startswith("± is the half width of the 95% Student-t interval of the mean over a row's 3 ")
    assert describe([1, 1]) == "One seed per row: values are single runs, with no interval."
    assert "2 or 5 seeds" in describe([1, 2, 5]) and describe([1, 2, 5]).endswith("rows of one seed have no interval.")


def test_seeds_is_one_override():
    assert expand_seeds(["seeds=3", "algorithm=dpsgd"]) == ["-m", "seed=range(3)", "algorithm=dpsgd"]
    assert expand_seeds(["-m", "seeds=2"]) == ["-m", "seed=range(2)"]
    assert expand_seeds(["seed=1"]) == ["seed=1"]
    for bad, says in ((["seeds=0"], "positive whole number"), (["seeds=3", "seed=1"], "once")):
        with pytest.raises(ConfigError, match=says):
            expand_seeds(bad)


@pytest.mark.slow  # soak: make test keeps test_report's seed sweeps
def test_report_of_a_seed_sweep(app, tmp_path):
    sweep = tmp_path / "sweep"
    args = ["seeds=3", "algorithm=allreduce,dpsgd", "backend=fleet", "epochs=2", f"hydra.sweep.dir={sweep}"]
    proc = app(args)
    assert proc.returncode == 0, proc.stderr
    report = subprocess.run(
        [sys.executable, "-m", "experiments.report", str(sweep)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert report.returncode == 0, report.stderr
    header = report.stdout.splitlines()[0].split()
    assert header[0] == "algorithm" and "seeds" in header and "seed" not in header
    rows = list(csv.DictReader((sweep / "report.csv").open()))
    assert [r["algorithm"] for r in rows] == ["allreduce", "dpsgd"] and [r["seeds"] for r in rows] == ["3", "3"]
    runs = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))]
    for row in rows:
        accs = [r["test_accuracy"] for r in runs if r["algorithm"] == row["algorithm"]]
        assert sorted(r["seed"] for r in runs if r["algorithm"] == row["algorithm"]) == [0, 1, 2]
        low, high = stats.t.interval(0.95, 2, loc=np.mean(accs), scale=stats.sem(accs))
        assert float(row["test_accuracy"]) == pytest.approx(np.mean(accs))
        assert float(row["test_accuracy_ci95"]) == pytest.approx((high - low) / 2)
    assert "± " in (sweep / "report.md").read_text()
    assert (sweep / "vs_steps.png").stat().st_size > 10_000
