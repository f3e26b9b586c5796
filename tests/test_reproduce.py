"""experiments.reproduce: a reproduction's sweeps run over seeds, its verdict is computed from the runs, and the
same command again reads the finished sweeps instead of rerunning them."""

import json

import pytest

from experiments import reproduce
from experiments.report import load_runs

pytestmark = pytest.mark.processes  # the sweeps run as `experiments.train -m` subprocesses


@pytest.mark.slow  # soak: a whole reproduction
def test_lian2017_runs_reports_and_reuses(tmp_path, capsys):
    out = tmp_path / "lian"
    # Fashion-MNIST cut to 512 training and 200 test images: 8 steps of 4 peers
    args = ["lian2017", "--seeds", "2", "--out", str(out), "epochs=1", "peers=4", "data.num_samples=512"]
    args += ["data.test_samples=200"]
    assert reproduce.main(args) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["runs"] == 4 and result["seeds"] == 2
    # the verdict's rule applied here to the runs read back: D-PSGD's accuracy within the two 95% intervals (at least
    # 0.01) of all-reduce's (the rule on hand-made numbers: test_reproduction_verdicts.py)
    configs = {c.setting["algorithm"]: c for c in reproduce.configurations(load_runs(out / "main"))}
    gap = configs["dpsgd"].mean("test_accuracy") - configs["allreduce"].mean("test_accuracy")
    noise = max(configs["dpsgd"].ci("test_accuracy") + configs["allreduce"].ci("test_accuracy"), 0.01)
    assert result["holds"] is (abs(gap) <= noise) and result["verdict"]
    assert (out / "vs_mb_sent.png").stat().st_size > 0
    # a ring peer sends 2 models per step, a ring all-reduce 2(n-1)/n: 4/3 at 4 peers, in the measured bytes
    assert "1.333x" in (out / "result.md").read_text()
    capsys.readouterr()
    logs = sorted(p.stat().st_mtime for p in out.rglob("summary.json"))
    assert reproduce.main(args) == 0  # read again, not rerun
    assert sorted(p.stat().st_mtime for p in out.rglob("summary.json")) == logs
    again = json.loads((out / "result.json").read_text())
    assert again["sweep_seconds"] == result["sweep_seconds"] > 0  # the time it took when it ran
    assert 0 < again["sweep_cpu_seconds"] == result["sweep_cpu_seconds"]


def test_unknown_reproduction_names_the_choices(capsys):
    with pytest.raises(SystemExit):
        reproduce.main(["nosuch"])
    assert "lian2017" in capsys.readouterr().err


def test_find_needs_exactly_one_configuration():
    configs = [
        reproduce.Configuration({"algorithm": a, "data.alpha": x}, {}, []) for a in ("dpsgd", "qgm") for x in (0.1, 10)
    ]
    assert reproduce.find(configs, algorithm="qgm", data__alpha=10).setting == {"algorithm": "qgm", "data.alpha": 10}
    with pytest.raises(LookupError, match="2 configurations"):
        reproduce.find(configs, algorithm="qgm")


def test_fleet_sweeps_run_on_one_thread_unless_told():
    assert reproduce.fleet_threads(["experiment=x", "backend=fleet"]) == ["backend.threads=1"]
    assert reproduce.fleet_threads(["backend=fleet", "backend.threads=2"]) == []
    assert reproduce.fleet_threads(["backend=mpi"]) == []
