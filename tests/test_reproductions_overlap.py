"""kale2025 and muloco2025: every sweep composes into a run the typed config accepts (fast), and, in `make soak`, each
reproduction end to end at a small size (their verdicts on hand-made numbers: tests/test_frontier_verdicts.py)."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from dpsgd.config import parse
from experiments import reproduce
from experiments.reproductions import kale2025, muloco2025
from experiments.validate import compose


@pytest.mark.parametrize("module", [kale2025, muloco2025], ids=["kale2025", "muloco2025"])
def test_every_sweep_composes_into_the_run_it_names(module):
    runs = {name: parse(OmegaConf.to_container(compose(o), resolve=True)) for name, o in module.SWEEPS.items()}
    assert {r.algorithm.options.get("period") for r in runs.values()} == {module.PERIOD}
    if module is kale2025:
        assert {r.backend.name for r in runs.values()} == {"fleet", "local"}
        assert (
            runs["eager_emulated"].algorithm.options["eager"] and runs["delayed"].algorithm.options["outer_delay"] == 1
        )
        assert runs["synchronous_emulated"].network.compute_time == kale2025.COMPUTE_S
    else:
        assert {(r.optimizer.name, r.algorithm.name) for r in runs.values()} == {
            (o, a) for o in ("muon", "adamw") for a in ("diloco", "sparseloco")
        }
        assert runs["muon_2bit"].algorithm.options["bits"] == 2


SMALL = ["data.num_samples=800"]  # 25 steps an epoch: 50 on the fleet (2 rounds of 25), 25 emulated (1 round)


def finished_sweep(out, sweep: str, ran_with: list[str]) -> None:
    (out / sweep / "0").mkdir(parents=True)
    (out / sweep / "0" / "summary.json").write_text("{}")
    (out / f"{sweep}.chosen.json").write_text(json.dumps(ran_with))


def test_finished_sweeps_are_reused_only_with_the_values_picked_now_and_refused_all_at_once(tmp_path):
    lr = "algorithm.outer.lr="
    expected = {"synchronous": 1, "delayed": 1, "eager": 1}
    finished_sweep(tmp_path, "synchronous", [])
    finished_sweep(tmp_path, "delayed", [lr + "0.35"])
    reproduce._refuse_stale(tmp_path, expected, {"delayed": [lr + "0.35"]})  # as picked: read, not rerun
    with pytest.raises(SystemExit) as refused:
        reproduce._refuse_stale(tmp_path, expected, {"synchronous": [lr + "0.7"], "delayed": [lr + "0.2"]})
    words = str(refused.value)
    assert "synchronous (ran with its own settings, now picked: algorithm.outer.lr=0.7)" in words
    assert "delayed (ran with algorithm.outer.lr=0.35, now picked: algorithm.outer.lr=0.2)" in words
    assert "eager" not in words and "Delete them" in words
    with pytest.raises(SystemExit, match="a search still to run picks their values"):
        reproduce._refuse_stale(tmp_path, expected, None)


def test_a_search_does_not_start_beside_sweeps_run_without_it(tmp_path, capsys):
    """kale2025 into a folder of --no-search runs: refused at once, before the search's 36 runs."""
    for sweep in kale2025.SWEEPS:
        finished_sweep(tmp_path, sweep, [])
    with pytest.raises(SystemExit, match="a search still to run"):
        reproduce.main(["kale2025", "--seeds", "1", "--out", str(tmp_path)])
    assert not (tmp_path / "search").exists() and "sweep" not in capsys.readouterr().out


def test_search_seeds_without_a_search_is_refused(capsys):
    for argv in (["kale2025", "--no-search", "--search-seeds", "2"], ["lian2017", "--search-seeds", "2"]):
        with pytest.raises(SystemExit) as exc:
            reproduce.main(argv)
        assert exc.value.code == 2 and "runs no search" in capsys.readouterr().err


@pytest.mark.slow  # soak: kale2025 at a small size, a 2-point search (12 runs, about 3 minutes on 2 loaded cores)
@pytest.mark.processes
def test_kale2025_runs_end_to_end(tmp_path, monkeypatch):
    grid = ["algorithm.outer.lr=0.35,0.7", "algorithm.outer.momentum=0.6"]
    small = {n: [o for o in s if not o.startswith(tuple(kale2025.GRID))] + grid for n, s in kale2025.SEARCH.items()}
    monkeypatch.setattr(kale2025, "SEARCH", small)
    monkeypatch.setattr(kale2025, "SEARCH_RUNS", dict.fromkeys(small, 2))
    out = tmp_path / "kale2025"
    assert reproduce.main(["kale2025", "--seeds", "1", "--out", str(out), *SMALL]) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["runs"] == 6 + 3 * 2 and result["holds"] in (True, False, None)
    assert "ms synchronous against 0.0 ms delayed and 0.0 ms eager (hidden" in result["verdict"]
    assert set(result["chosen"]) == set(kale2025.SWEEPS)
    assert all(p[0] in ("algorithm.outer.lr=0.35", "algorithm.outer.lr=0.7") for p in result["chosen"].values())
    assert "The search (validation loss" in (out / "result.md").read_text()


@pytest.mark.slow  # soak: four runs of muloco2025 at a small size (Muon's runs are the slow ones)
@pytest.mark.processes
def test_muloco2025_runs_end_to_end(tmp_path):
    out = tmp_path / "muloco2025"
    assert reproduce.main(["muloco2025", "--seeds", "1", "--out", str(out), *SMALL]) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["runs"] == 4 and "inner Muon moves" in result["verdict"]
