"""experiments.report on real sweeps: the table, Markdown, CSV and plots from the run files, and that they explain
themselves: captions say what was run, what ± means and which clock a time is on; legends are words; figures fit a
page; bands of quantities that cannot be negative stay at or above 0; identical runs are reported once."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from experiments import captions, plots, report
from experiments.intervals import clipped_band

ROOT = Path(__file__).resolve().parent.parent


def _report(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "experiments.report", str(folder)], cwd=ROOT, capture_output=True, text=True, timeout=180
    )


def _figure(png: Path) -> tuple[float, float, dict]:
    """A PNG's size in inches and its text (Title, Description, Legend)."""
    image = Image.open(png)
    dpi = image.info["dpi"][0]
    return image.size[0] / dpi, image.size[1] / dpi, image.info


def test_readmes_sweep_on_real_peers(app, tmp_path):
    """README's sweep `algorithm=allreduce,dpsgd topology=ring,exponential` on the local backend: all-reduce does
    not read the topology, so its two runs are one (the same numbers) and the report shows it once."""
    sweep = tmp_path / "sweep"
    args = ["-m", "algorithm=allreduce,dpsgd", "topology=ring,exponential", "backend=local", "epochs=2", "log_every=4"]
    proc = app([*args, f"hydra.sweep.dir={sweep}"])
    assert proc.returncode == 0, proc.stderr
    runs = [json.loads((sweep / str(i) / "summary.json").read_text()) for i in range(4)]
    allreduce = [r for r in runs if r["algorithm"] == "allreduce"]
    assert [r["topology"] for r in allreduce] == ["ring", "exponential"]
    assert allreduce[0]["test_loss"] == allreduce[1]["test_loss"]  # what `uses_topology = False` declares

    result = _report(sweep)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:2] == ["algorithm", "topology"]  # the swept parameters lead the table
    assert [line.split()[:2] for line in lines[2:5]] == [
        ["allreduce", "unused"],
        ["dpsgd", "ring"],
        ["dpsgd", "exponential"],
    ]
    assert "all-reduce does not read topology=ring,exponential" in result.stdout
    rows = list(csv.DictReader((sweep / "report.csv").open()))
    assert [(r["algorithm"], r["topology"]) for r in rows] == [
        ("allreduce", "unused"),
        ("dpsgd", "ring"),
        ("dpsgd", "exponential"),
    ]
    assert rows[0]["ignored"] == "topology=ring,exponential" and rows[1]["ignored"] == ""
    assert [r["optimizer.lr"] for r in rows] == ["0.1"] * 3 and rows[2]["algorithm.order"] == "cta"
    assert float(rows[0]["consensus_distance"]) == 0 and float(rows[1]["consensus_distance"]) > 0
    assert "class_histograms" not in rows[0]  # lists stay in summary.json

    md = (sweep / "report.md").read_text()
    for says in (
        "3 runs (1 more left out as copies",
        "digits (iid split), model mlp",
        "4 peers, 2 epochs of batch 32 per peer, backend local",
        "Inner optimizer of every run: sgd (lr 0.1, momentum 0.9",
        "One seed (0) per configuration",
        "One seed per row: values are single runs, with no interval.",
        "start-up (processes, imports, data loading, model building) is not included",
    ):
        assert says in md, says
    assert "simulat" not in md  # real peers: no word of a simulator
    assert "| algorithm | topology |" in md and "![vs_steps](vs_steps.png)" in md
    for name in ("vs_steps", "vs_wall_time", "vs_mb_sent"):
        width, height, text = _figure(sweep / f"{name}.png")
        assert width <= plots.PAGE_WIDTH_IN + 0.01 and height < width, (name, width, height)
        assert text["Legend"].splitlines() == ["all-reduce", "D-PSGD, ring", "D-PSGD, exponential"]
        assert "One seed per line" in text["Description"] and "all-reduce does not read" in text["Description"]
    assert "wall clock" in _figure(sweep / "vs_wall_time.png")[2]["Description"]
    assert not (sweep / "optimum_vs_steps.png").exists()  # digits has no known optimum


@pytest.mark.slow  # soak: make test keeps the README's sweep on real peers
def test_seeds_on_the_fleet(app, tmp_path):
    """Two seeds of all-reduce and D-PSGD on the fleet: ± explained, the simulator's wall clock named, the bands'
    edges in range, four panels in a 2 x 2 grid a page wide."""
    sweep = tmp_path / "sweep"
    proc = app(["seeds=2", "algorithm=allreduce,dpsgd", "backend=fleet", "epochs=2", f"hydra.sweep.dir={sweep}"])
    assert proc.returncode == 0, proc.stderr
    result = _report(sweep)
    assert result.returncode == 0, result.stderr
    md = (sweep / "report.md").read_text()
    assert "± is the half width of the 95% Student-t interval of the mean over a row's 2 seeds" in md
    assert "Seeds 0, 1." in md
    assert "Backend fleet simulates every peer in one process: its wall time is the simulator's" in md
    assert "all-reduce does not read" not in md  # nothing was collapsed
    width, height, text = _figure(sweep / "vs_steps.png")
    assert width == pytest.approx(plots.PAGE_WIDTH_IN, abs=0.01) and 0.7 < height / width < 1.1  # 2 x 2, not a strip
    assert text["Legend"].splitlines() == ["all-reduce", "D-PSGD"]
    assert (
        "the mean over 2 seeds; bands: the 95% Student-t interval, cut at 0 (and accuracies at 1)"
        in (text["Description"])
    )
    assert "simulator's" in _figure(sweep / "vs_wall_time.png")[2]["Description"]


def test_no_raw_overrides_in_legends():
    run = {"config": {"algorithm.name": "allreduce", "topology.name": "ring"}, "summary": {}, "dir": Path("x")}
    assert captions.legend(run, {"algorithm": "allreduce", "topology": "ring"}) == "all-reduce"
    gossip = {**run, "config": {"algorithm.name": "dpsgd"}}
    values = {"topology": "one_peer_exponential", "algorithm": "dpsgd", "peers": 16, "algorithm.overlap": "true"}
    assert captions.legend(gossip, values) == "D-PSGD, one peer exponential, overlap on, 16 peers"
    assert captions.legend(gossip, {"data.alpha": 0.1, "compression": "int8"}) == "int8 compression, alpha 0.1"
    plugin = {**run, "config": {"algorithm.name": "my_rule"}}  # not in the library: its name, and its topology
    assert captions.legend(plugin, {"algorithm": "my_rule", "topology": "ring"}) == "my_rule, ring"
    for legend in (captions.legend(gossip, values), captions.legend(plugin, {"algorithm.period": 8})):
        assert "=" not in legend


def test_declared_topology_use():
    from dpsgd.optim import ALGORITHMS

    ignoring = {name for name, cls in ALGORITHMS.items() if not cls.uses_topology}
    # NoLoCo pairs peers by a step-seeded permutation and SPARTA by its own seeded matching, not by the topology;
    # asynchronous Local-SGD's workers push to rank 0's merger; the rest average exactly
    assert ignoring == {"allreduce", "local_sgd", "slowmo", "diloco", "bmuf", "streaming_diloco", "async_local_sgd"} | {
        "noloco",
        "demo",
        "sparseloco",
        "desloc",
        "sparta",
    }


def test_bands_stay_in_range():
    """Seeds far apart near 0: the Student-t interval reaches below 0 (and above 1 for accuracy); the band drawn
    does not."""
    plt = plots.pyplot()
    runs = [
        {"metrics": [{"step": s, "wall_time_s": w * s, "test_loss": w, "test_accuracy": 1 - w} for s in (1, 2)]}
        for w in (0.01, 0.9, 0.02)
    ]
    mean, lower, upper = clipped_band([[0.01, 0.01], [0.9, 0.9], [0.02, 0.02]])
    assert lower.tolist() == [0.0, 0.0] and np.all(upper > mean)
    for y_key, low, high in (("test_loss", 0.0, None), ("wall_time_s", 0.0, None), ("test_accuracy", 0.0, 1.0)):
        fig, ax = plt.subplots()
        plots.draw_band(ax, runs, "step", y_key, "x")
        (band,) = ax.collections
        ys = np.concatenate([p.vertices[:, 1] for p in band.get_paths()])
        assert ys.min() == pytest.approx(low) and (high is None or ys.max() == pytest.approx(high)), y_key
        plt.close(fig)


def test_collapse_keeps_seeds_apart():
    """Copies are the same run at the same seed; different seeds stay seeds of one row."""

    def run(algorithm, topology, seed):
        overrides = {"algorithm": algorithm, "topology": topology, "seed": str(seed)}
        config = {"algorithm.name": algorithm, "topology.name": topology, "seed": seed}
        return {"dir": Path(f"{algorithm}-{topology}-{seed}"), "overrides": overrides, "config": config, "summary": {}}

    runs = [run(a, t, s) for a in ("allreduce", "dpsgd") for t in ("ring", "exponential") for s in (0, 1)]
    keys = report.swept_keys([{**r, "metrics": []} for r in runs])
    kept, notes = report.collapse_identical(runs, keys)
    assert [r["dir"].name for r in kept] == [
        "allreduce-ring-0",
        "allreduce-ring-1",
        "dpsgd-ring-0",
        "dpsgd-ring-1",
        "dpsgd-exponential-0",
        "dpsgd-exponential-1",
    ]
    assert notes == ["all-reduce does not read topology=ring,exponential: those runs are the same run, reported once"]
    _, groups = report.group_by_seed(kept, keys)
    assert [len(g) for g in groups] == [2, 2, 2]
    assert [report.label(g[0], keys) for g in groups] == ["all-reduce", "D-PSGD, ring", "D-PSGD, exponential"]

    only = [r for r in runs if r["config"]["algorithm.name"] == "allreduce"]  # a topology sweep of all-reduce alone
    kept, notes = report.collapse_identical(only, ["seed", "topology"])
    assert len(kept) == 2 and len(notes) == 1 and report.label(kept[0], ["seed", "topology"]) == "all-reduce"


def test_report_says_what_is_missing(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.report", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "no run under" in proc.stderr
