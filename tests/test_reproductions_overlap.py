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


@pytest.mark.slow  # soak: six runs of kale2025 at a small size (about 2 minutes on 2 loaded cores)
@pytest.mark.processes
def test_kale2025_runs_end_to_end(tmp_path):
    out = tmp_path / "kale2025"
    assert reproduce.main(["kale2025", "--seeds", "1", "--out", str(out), *SMALL]) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["runs"] == 6 and result["holds"] in (True, False, None)
    assert "ms synchronous against 0.0 ms delayed and 0.0 ms eager (hidden" in result["verdict"]


@pytest.mark.slow  # soak: four runs of muloco2025 at a small size (Muon's runs are the slow ones)
@pytest.mark.processes
def test_muloco2025_runs_end_to_end(tmp_path):
    out = tmp_path / "muloco2025"
    assert reproduce.main(["muloco2025", "--seeds", "1", "--out", str(out), *SMALL]) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["runs"] == 4 and "inner Muon moves" in result["verdict"]
