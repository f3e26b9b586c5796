"""Answers that compare algorithms: time to a target in the report (with the seeds that reached it), emulated clocks
that do not move with the machine's load, runs that stop learning ended as such, evaluation that scales, and no
option silently ignored."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import runs
import torch
from scipy import stats

from dpsgd import calibration, divergence
from dpsgd.comm import run_local
from dpsgd.config import parse
from dpsgd.metrics import Evaluation
from dpsgd.training import train
from experiments import report
from experiments.reaching import Target, over_seeds

ROOT = Path(__file__).resolve().parent.parent


# --- time to a target -------------------------------------------------------------------------------------------
def _records(accuracies: list[float], every: int = 10, clock: float | None = None) -> list[dict]:
    return [
        {
            "step": every * (i + 1),
            "samples": 32 * every * (i + 1),
            "mb_sent_per_peer": 0.5 * (i + 1),
            "wall_time_s": 1.0 * (i + 1),
            "emulated_time_s": None if clock is None else clock * (i + 1),
            "test_accuracy": a,
            "scope": "all peers",
        }
        for i, a in enumerate(accuracies)
    ]


def test_over_seeds_counts_the_seeds_that_reached_and_means_only_theirs():
    seeds = [_records([0.5, 0.86, 0.9]), _records([0.5, 0.7, 0.84]), _records([0.85, 0.9])]
    got = over_seeds(Target("test_accuracy", 0.85), seeds)
    assert got["reached"] == "2/3"  # the first record at or above 0.85: step 20, step 10; the second seed never
    steps = [20, 10]
    mean, (_lo, hi) = np.mean(steps), stats.t.interval(0.95, df=1, loc=np.mean(steps), scale=stats.sem(steps))
    assert got["steps_to_target"] == pytest.approx(mean) and got["steps_to_target_ci95"] == pytest.approx(hi - mean)
    assert got["time_to_target_s"] == pytest.approx(np.mean([2.0, 1.0]))  # the wall clock: no emulated one
    emulated = over_seeds(Target("test_accuracy", 0.85), [_records([0.9], clock=0.25)])
    assert emulated["time_to_target_s"] == 0.25 and emulated["reached"] == "1/1"  # the run's own clock
    nobody = over_seeds(Target("test_accuracy", 0.99), seeds)
    assert nobody["reached"] == "0/3" and nobody["steps_to_target"] is None


def test_a_minimised_metric_is_reached_from_above_and_rank_0_views_do_not_count():
    target = Target.parse("test_perplexity=9.5")
    assert target.minimised and str(target) == "test_perplexity <= 9.5"
    records = [
        {"step": 5, "test_perplexity": 9.4, "scope": "rank 0"},  # an asynchronous run's own view: not every peer's
        {"step": 10, "test_perplexity": 9.6, "scope": "all peers"},
        {"step": 15, "test_perplexity": 9.5, "scope": "all peers"},
    ]
    assert target.first(records)["step"] == 15
    with pytest.raises(ValueError, match="METRIC=VALUE"):
        Target.parse("test_accuracy")


def test_the_report_shows_time_to_target_with_the_reached_count(tmp_path, capsys):
    for seed, accuracies in enumerate(([0.5, 0.9], [0.5, 0.6], [0.88, 0.9])):
        run = tmp_path / str(seed)
        run.mkdir()
        config = {"algorithm": {"name": "dpsgd"}, "seed": seed, "log_every": 10}
        (run / "config.yaml").write_text(json.dumps(config))
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records(accuracies)))
        summary = {"algorithm": "dpsgd", "topology": "ring", "peers": 4, "seed": seed, "test_accuracy": accuracies[-1]}
        (run / "summary.json").write_text(json.dumps(summary))
    assert report.main([str(tmp_path), "--target", "test_accuracy=0.85"]) == 0
    out = capsys.readouterr().out
    assert "reached" in out and "2/3" in out and "steps to target" in out
    assert "To the target test_accuracy >= 0.85" in (tmp_path / "report.md").read_text()
    assert "| 15 ± " in (tmp_path / "report.md").read_text()  # steps 20 and 10: mean 15
    assert report.main([str(tmp_path), "--target", "test_perplexity=9"]) == 2  # no record has it: one line
    capsys.readouterr()
    assert report.main([str(tmp_path), "--target", "test_accuracy=0.95"]) == 0  # no seed reaches it
    header, _, row = capsys.readouterr().out.splitlines()[:3]
    assert "0/3" in row and "steps to target" in header and "MB to target" in header  # shown as "-", not left out


# --- clocks free of the machine's load -----------------------------------------------------------------------------
def _emulated(cfg: dict) -> tuple[float, str | None]:
    summaries = run_local(4, train, calibration.resolved(parse(cfg)), timeout_s=120)
    return summaries[0]["emulated_time_s"], summaries[0].get("emulated_compute")


@pytest.mark.processes
def test_the_same_run_gives_the_same_emulated_time_under_load(tmp_path, monkeypatch):
    """network=ethernet_1g (model mode) on 4 local peers, twice: alone, then beside two busy processes. The clock
    takes the workload's calibrated compute (measured once, cached), not each step's: the two times agree within
    1% (they are equal). network.compute=measured takes each step's own and says so in the summary."""
    monkeypatch.setenv("DPSGD_CACHE", str(tmp_path))
    cfg = {**runs.experiment(runs.algorithm("dpsgd")), "network": runs.load("network", "ethernet_1g")}
    quiet, words = _emulated(cfg)
    assert words is not None and "calibrated" in words
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        loaded, _ = _emulated(cfg)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert loaded == pytest.approx(quiet, rel=0.01)
    assert json.loads((tmp_path / "compute_times.json").read_text())  # measured once, kept
    measured = {**cfg, "network": {**cfg["network"], "compute": "measured"}}
    _, words = _emulated(measured)
    assert "measured each step" in words


def test_a_calibrated_compute_is_measured_once_per_workload(tmp_path, monkeypatch):
    monkeypatch.setenv("DPSGD_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(calibration, "measure", lambda run: calls.append(run.batch_size) or 0.004 * run.batch_size)
    run = parse({**runs.experiment(runs.algorithm("dpsgd")), "network": runs.load("network", "ethernet_1g")})
    first = calibration.resolved(run)
    assert first.network.calibrated_s == pytest.approx(0.064) and calibration.resolved(first) == first
    assert calibration.resolved(run).network.calibrated_s == first.network.calibrated_s and calls == [16]
    other = calibration.resolved(run.replace(batch_size=8))  # another workload: its own measurement
    assert other.network.calibrated_s == pytest.approx(0.032) and calls == [16, 8]
    given = run.replace(network=run.network.__class__(**{**run.network.__dict__, "compute_time": 0.02}))
    assert calibration.resolved(given) == given and "given" in calibration.compute_words(given)
    loopback = parse(runs.experiment(runs.algorithm("dpsgd")))  # sleep mode, nothing emulated: the real clock
    assert calibration.resolved(loopback) == loopback and calibration.compute_words(loopback) is None


# --- runs that do not learn ---------------------------------------------------------------------------------------
class _Run:
    """What the guard reads of a run: none of its parameters here (the fleet's check is elsewhere)."""

    comm = None


def test_a_loss_far_above_its_start_is_divergence_after_the_warm_up():
    guard = divergence.Guard(_Run(), "mark")
    guard._params, guard._rank = [], 3
    start = 2.3
    guard.check(1, start)
    guard.check(2, divergence.BLOWUP * start * 2)  # within the warm-up: the first steps of a stable run may rise
    assert guard.first is None
    guard.check(3, divergence.BLOWUP * start * 0.99)  # below the threshold
    assert guard.first is None
    guard.check(4, divergence.BLOWUP * start * 1.01)
    assert guard.first is not None and (guard.first.peer, guard.first.step) == (3, 4)
    assert "more than 10x its first step's 2.3" in guard.first.what


def test_at_chance_after_the_stated_epochs_is_not_learning():
    classes = 10
    early = {"step": 40, "epoch": divergence.NOT_LEARNING_EPOCHS - 0.1, "test_accuracy": 0.1, "scope": "all peers"}
    assert divergence.not_learning(early, classes) is None
    at_chance = {**early, "epoch": divergence.NOT_LEARNING_EPOCHS, "test_accuracy": divergence.CHANCE / classes}
    assert "at chance (0.1 for 10 classes)" in divergence.not_learning(at_chance, classes)
    assert divergence.not_learning({**at_chance, "test_accuracy": 0.16}, classes) is None
    assert divergence.not_learning({**at_chance, "test_accuracy": None}, classes) is None  # not evaluated
    assert divergence.not_learning(at_chance, 0) is None  # regression: no chance to be at
    guard = divergence.Guard(_Run(), "stop")
    with pytest.raises(divergence.NotLearning) as caught:
        guard.check_record(at_chance, classes)
    assert caught.value.status == "not_learning" and caught.value.peer is None and "step 40" in str(caught.value)


@pytest.mark.processes
@pytest.mark.parametrize("lr", ["10000", pytest.param("50", marks=pytest.mark.slow)])  # soak: the slower blow-up
def test_an_exploding_run_ends_in_one_line_exit_1(app, tmp_path, lr):
    proc = app(["backend=fleet", f"optimizer.lr={lr}"], tmp_path / "run", timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "diverged at step" in lines[0] and "exploding" in lines[0], proc.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "diverged"


def test_a_run_at_chance_is_marked_not_learning(tmp_path):
    cfg = {**runs.experiment(runs.algorithm("dpsgd"), backend="fleet"), "epochs": 6, "on_divergence": "mark"}
    cfg["optimizer"] = {"name": "sgd", "lr": 1e-7}
    from dpsgd.sim import train_fleet

    summary = train_fleet(parse(cfg), tmp_path)
    assert summary["status"] == "not_learning" and summary["diverged"]["peer"] is None


@pytest.mark.parametrize("period, said", [(50, True), (5, False)])
def test_a_period_longer_than_the_run_is_said(tmp_path, capsys, period, said):
    """NoLoCo at H=50 on a run of fewer steps never combines: its peers' independent models would pass for the
    algorithm's in a comparison, so the run says so in one note (and says nothing where it combines)."""
    cfg = {**runs.experiment(runs.algorithm("noloco"), backend="fleet"), "epochs": 2, "peers": 4}
    cfg["algorithm"] = {**cfg["algorithm"], "period": period}
    from dpsgd.sim import train_fleet

    summary = train_fleet(parse(cfg), tmp_path)
    notes = [line for line in capsys.readouterr().err.splitlines() if "never combine" in line]
    assert len(notes) == (1 if said else 0), notes
    if said:
        assert f"algorithm.period={period} is more than the run's {summary['steps']} steps" in notes[0]


# --- evaluation that scales ---------------------------------------------------------------------------------------
def test_a_sampled_evaluation_is_one_seeded_subset_and_the_last_record_scores_all():
    x, y = torch.arange(100.0).reshape(50, 2), torch.arange(50)
    a = Evaluation.sampled(x, y, 64, 20, 8, seed=3)
    b = Evaluation.sampled(x, y, 64, 20, 8, seed=3)
    assert torch.equal(a.x, b.x) and a.peers == b.peers and len(a.x) == 20 and len(a.peers) == 8
    assert len(set(a.y.tolist())) == 20 and torch.equal(a.x[:, 0] / 2, a.y.double().float())  # rows kept whole
    assert not torch.equal(Evaluation.sampled(x, y, 64, 20, 8, seed=4).x, a.x)
    whole = Evaluation.sampled(x, y, 4, None, None, seed=3)
    assert torch.equal(whole.x, x) and whole.peers is None and whole.scores(3)


def test_records_between_evaluations_carry_no_test_figures_and_the_last_the_whole_split(tmp_path):
    cfg = {**runs.experiment(runs.algorithm("dpsgd"), backend="fleet"), "log_every": 5, "eval_every": 20}
    cfg["epochs"], cfg["eval"] = 2, {"samples": 100, "peers": 2}
    from dpsgd.sim import train_fleet

    summary = train_fleet(parse(cfg), tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    last = steps[-1]
    assert [r["step"] for r in records if r["test_accuracy"] is not None] == [
        s for s in steps if s % 20 == 0 or s == last
    ]
    assert all(r["train_loss"] is not None for r in records)
    sampled = next(r for r in records if r["test_accuracy"] is not None and r["step"] != last)
    assert sampled["test_accuracy"] * 100 == pytest.approx(round(sampled["test_accuracy"] * 100))  # 100 samples
    split_size = 360  # digits' test split (20% of 1797)
    assert summary["test_accuracy"] * split_size == pytest.approx(round(summary["test_accuracy"] * split_size))


def test_the_fleet_and_real_peers_score_the_same_sample(tmp_path):
    cfg = {**runs.experiment(runs.algorithm("dpsgd")), "eval": {"samples": 50, "peers": 2}, "eval_every": 5}
    cfg["log_every"] = 5
    from dpsgd.sim import train_fleet

    (tmp_path / "local").mkdir()
    (tmp_path / "fleet").mkdir()
    run_local(4, train, parse(cfg), tmp_path / "local", timeout_s=60)
    train_fleet(parse({**cfg, "backend": {"name": "fleet"}}), tmp_path / "fleet")
    local, fleet = (
        [json.loads(line) for line in (tmp_path / k / "metrics.jsonl").read_text().splitlines()]
        for k in ("local", "fleet")
    )
    for a, b in zip(local, fleet):
        for key in ("test_accuracy", "peer_test_accuracy_mean", "peer_test_accuracy_min"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)


# --- nothing silently ignored -------------------------------------------------------------------------------------
def test_the_fleet_refuses_an_emulated_network_for_a_synchronous_algorithm(hydra_config):
    from experiments.validate import ConfigError, validate

    with pytest.raises(ConfigError, match="network=wan on backend=fleet: the fleet steps a synchronous") as caught:
        validate(hydra_config("backend=fleet", "network=wan"))
    assert "\n" not in str(caught.value)
    validate(hydra_config("backend=fleet", "network=wan", "algorithm=adpsgd"))  # the event simulator prices it
    validate(hydra_config("backend=fleet"))  # loopback: nothing emulated


def test_a_sweep_of_different_inner_optimizers_says_so_in_one_line(capsys):
    from experiments import train as app

    app.check_sweep(["-m", "algorithm=dpsgd,qgm", "backend=fleet"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("note: the sweep's runs step 2 different inner optimizers")
    app.check_sweep(["-m", "algorithm=dpsgd,diloco,noloco", "backend=fleet"])  # one inner optimizer: no word
    assert capsys.readouterr().err == ""


def test_a_users_algorithm_config_may_carry_its_own_name(tmp_path):
    """`name` is a label; the class comes from `_target_`, which a base config (defaults: [noloco]) hands on."""
    (tmp_path / "algorithm").mkdir()
    (tmp_path / "algorithm" / "noloco8.yaml").write_text(
        "defaults:\n  - noloco\n  - _self_\nname: noloco8\nperiod: 8\n"
    )
    from experiments.overrides import _compose

    composed = _compose([f"hydra.searchpath=[file://{tmp_path}]", "algorithm=noloco8"])
    run = parse({k: v for k, v in composed.items() if k != "hydra"})
    assert (run.algorithm.name, run.algorithm.target, run.algorithm.options["period"]) == (
        "noloco8",
        "dpsgd.optim.NoLoCo",
        8,
    )
    from experiments.validate import validate

    validate(run.replace(backend=run.backend.__class__("local")))
    assert not math.isnan(run.optimizer.options["lr"])
