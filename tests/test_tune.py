"""Fair tuning: the validation split lies inside the training split and never touches the test split, and
experiments.tune selects on it alone, then runs the chosen setting over seeds on the test split."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from dpsgd import data
from dpsgd.build import load_data
from dpsgd.config import parse
from dpsgd.optim import ALGORITHMS

ROOT = Path(__file__).resolve().parent.parent


def _rows(x) -> Counter:
    return Counter(bytes(r.numpy()) for r in x)


@pytest.mark.parametrize("name", ["digits", "synthetic_regression"])  # stratified by class, and not
def test_validation_split_is_carved_from_training_data(name):
    options = {"num_samples": 300} if name == "synthetic_regression" else {}
    full = data.load(name, 0.2, 3, **options)
    tuned = data.load(name, 0.2, 3, validation_fraction=0.25, **options)
    validation, rest, test = _rows(tuned.x_test), _rows(tuned.x_train), _rows(full.x_test)
    assert validation + rest == _rows(full.x_train)  # train = validation + what the model trains on
    assert not validation & test and not rest & test  # the test split is in neither
    assert len(tuned.x_test) == pytest.approx(0.25 * len(full.x_train), abs=1)
    if name == "digits":  # stratified: every class in the validation split
        assert set(tuned.y_test.tolist()) == set(range(10))


def test_fixed_split_seed_keeps_one_test_split_across_seeds(hydra_config):
    def split(*overrides):
        run = parse(hydra_config(*overrides))
        return load_data(run.data, run.seed, run.peers)

    tests = [split(f"seed={s}", "data.split_seed=0").x_test for s in range(3)]
    assert all(t.equal(tests[0]) for t in tests)
    validation = split("seed=2", "data.split_seed=0", "data.validation_fraction=0.2").x_test
    assert not _rows(validation) & _rows(tests[0])
    assert not split("seed=1").x_test.equal(tests[0])  # by default the seed moves the split


@pytest.mark.slow  # soak: a whole tuning sweep
def test_tune_selects_on_validation_then_runs_seeds(tmp_path):
    out = tmp_path / "tune"
    args = ["--algorithms", "local_sgd", "--lr-factors", "0.3,3", "--knob-values", "2,8", "--seeds", "2"]
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.tune", *args, "--out", str(out), "backend=fleet", "epochs=2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr

    def runs(folder: Path) -> list[tuple[dict, dict]]:
        return [
            (OmegaConf.to_container(OmegaConf.load(s.parent / "config.yaml")), json.loads(s.read_text()))
            for s in sorted(folder.rglob("summary.json"))
        ]

    search = runs(out / "search" / "local_sgd")
    assert len(search) == 4  # lr 0.03, 0.3 x period 2, 8
    assert {(c["optimizer"]["lr"], c["algorithm"]["period"]) for c, _ in search} == {
        (0.03, 2),
        (0.03, 8),
        (0.3, 2),
        (0.3, 8),
    }
    for config, summary in search:
        assert summary["evaluated_on"] == "validation" and config["data"]["validation_fraction"] == 0.2
    best_config = max(search, key=lambda r: (r[1]["test_accuracy"], -r[1]["test_loss"]))[0]
    best = {"lr": best_config["optimizer"]["lr"], "period": best_config["algorithm"]["period"]}
    chosen = json.loads((out / "tuned.json").read_text())["algorithms"]["local_sgd"]["chosen"]
    assert chosen == {"optimizer.lr": best["lr"], "algorithm.period": best["period"]}
    final = runs(out / "final" / "local_sgd")
    assert sorted(s["seed"] for _, s in final) == [0, 1]
    for config, summary in final:
        assert summary["evaluated_on"] == "test" and config["data"]["split_seed"] == 0
        assert (config["optimizer"]["lr"], config["algorithm"]["period"]) == (best["lr"], best["period"])
    tuned_md = (out / "tuned.md").read_text()
    assert f"lr {best['lr']:g}, period {best['period']}" in tuned_md and "| 2 |" in tuned_md


@pytest.mark.parametrize("algorithm", [name for name, cls in ALGORITHMS.items() if cls.knobs])
def test_each_knob_names_a_setting_of_its_algorithms_config(algorithm):
    """A searched knob (what the algorithm's class declares) is a key the algorithm's config holds (a renamed
    option would search nothing: Hydra refuses an override of a key that is not there)."""
    from experiments import tune

    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "algorithm" / f"{algorithm}.yaml"))
    for name, values in tune.knobs(algorithm).items():
        assert isinstance(tune._get({"algorithm": cfg}, f"algorithm.{name}"), (int, float)), (algorithm, name)
        assert len(values) > 1


def test_knob_values_refuse_an_algorithm_with_several_knobs_in_one_line(monkeypatch, tmp_path, capsys):
    from dpsgd.optim import LocalSGD
    from experiments import tune

    class TwoKnobs(LocalSGD):
        label, knobs, cost_form = "two knobs", {"period": (2, 4), "warmup_steps": (0, 8)}, None

    monkeypatch.setitem(ALGORITHMS, "local_sgd", TwoKnobs)
    with pytest.raises(SystemExit):
        tune.main(["--algorithms", "local_sgd", "--knob-values", "2,8", "--out", str(tmp_path / "tune")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("but local_sgd (period, warmup_steps) has several: tune it without --knob-values"), err
    assert not (tmp_path / "tune").exists()


def test_schedule_is_a_searched_setting():
    from experiments import tune

    space = tune.search_space("allreduce", [0.1], None, ["constant", "cosine"])
    assert tune.sweep_args(space, "basic", None) == ["optimizer.lr=0.1", "schedule=constant,cosine"]
    assert "schedule=choice(constant,cosine)" in tune.sweep_args(space, "grid", None)
    assert tune._get({"schedule": {"name": "cosine", "warmup_steps": 0}}, "schedule") == "cosine"


@pytest.mark.slow  # about 40 s on 2 loaded cores: three runs through Hydra's Optuna sweeper
def test_tune_searches_the_schedule(tmp_path):
    """--schedules adds the schedule (a config group) to the search; the final runs take the chosen one."""
    out = tmp_path / "tune"
    args = ["--algorithms", "allreduce", "--lr-factors", "1", "--schedules", "constant,cosine", "--seeds", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.tune", *args, "--out", str(out), "backend=fleet", "epochs=1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    configs = [OmegaConf.load(s.parent / "config.yaml") for s in sorted((out / "search").rglob("summary.json"))]
    assert sorted(c.schedule.name for c in configs) == ["constant", "cosine"]
    chosen = json.loads((out / "tuned.json").read_text())["algorithms"]["allreduce"]["chosen"]
    (final,) = [OmegaConf.load(s.parent / "config.yaml") for s in (out / "final").rglob("summary.json")]
    assert chosen["schedule"] in ("constant", "cosine") and final.schedule.name == chosen["schedule"]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--algorithms", "dpsgd,dpsgdd"], "unknown algorithm dpsgdd; valid algorithm options: adpsgd, allreduce"),
        (["--schedules", "constant,cosin"], "unknown schedule cosin; valid schedule options: constant, cosine"),
        (["epochz=3"], "unknown key 'epochz' (the config has no such key); did you mean epochs?"),
    ],
)
def test_bad_names_and_overrides_end_in_one_error_line_before_any_run(argv, words, tmp_path, capsys):
    """A typo in --algorithms, --schedules or an override was a Hydra traceback from inside the search."""
    from experiments import tune

    with pytest.raises(SystemExit) as exited:
        tune.main([*argv, "--out", str(tmp_path / "tune")])
    assert exited.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and words in errors[0], errors
    assert not (tmp_path / "tune").exists()
