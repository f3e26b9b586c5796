"""Divergence (dpsgd.divergence): caught on the step it happens, one line naming peer and step, `status` in
summary.json, strict JSON outputs, and no checkpoint holding a non-finite value; on local, mpi, torch and fleet."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from runs import experiment, load

from dpsgd import divergence
from dpsgd.comm import run_local
from dpsgd.config import parse
from dpsgd.sim import train_fleet
from dpsgd.training import train

BLOWS_UP = ["optimizer.lr=1e6", "epochs=3"]


def _strict(text: str):
    """JSON as a strict reader takes it (no NaN or Infinity)."""

    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=refuse)


def _outputs_clean(run_dir: Path) -> dict:
    """Every output of the run is strict JSON and every checkpoint is finite; returns the summary. A run stopped
    before its first record has no metrics.jsonl (no empty file is left: dpsgd.runfiles)."""
    metrics = run_dir / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        _strict(line)
    for pt in run_dir.glob("checkpoints/*/rank*.pt"):
        state = torch.load(pt, weights_only=True)
        for name, t in state["model"].items():
            assert torch.isfinite(t).all(), f"{pt}: {name} not finite"
    return _strict((run_dir / "summary.json").read_text())


def _config(lr: float, **extra) -> dict:
    cfg = experiment(load("algorithm", "dpsgd"))
    cfg["optimizer"]["lr"] = lr
    cfg.update(epochs=3, log_every=2, **extra)
    return cfg


def test_norms_and_problems_match_numpy():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(4, 3, 2)), rng.normal(size=(4, 5))
    stacked = divergence.norms([torch.tensor(a), torch.tensor(b)], peers=4)
    want = np.sqrt((a.reshape(4, -1) ** 2).sum(1) + (b**2).sum(1))
    np.testing.assert_allclose(stacked.numpy(), want, rtol=1e-12)
    one = divergence.norms([torch.tensor(a[0]), torch.tensor(b[0])])
    assert float(one) == pytest.approx(want[0], rel=1e-12)
    assert divergence.problem(1.0, 3.0) is None
    assert "not finite" in divergence.problem(1.0, math.nan)
    assert "overflowed" in divergence.problem(1.0, math.inf)
    assert "exploding" in divergence.problem(1.0, 2 * divergence.MAX_NORM)
    assert "loss is nan" in divergence.problem(math.nan, 1.0)
    assert divergence.json_safe({"a": [math.nan, 1.0], "b": math.inf}) == {"a": [None, 1.0], "b": None}


def test_local_stop_names_peer_and_step_and_keeps_outputs_clean(tmp_path):
    cfg = _config(1e6, checkpoint={"every": 1})
    with pytest.raises(divergence.Diverged) as caught:
        run_local(4, train, parse(cfg), tmp_path)
    exc = caught.value
    assert 0 <= exc.peer < 4 and 1 <= exc.step <= 5, exc  # lr=1e6: within 5 steps of the start
    assert f"peer {exc.peer} diverged at step {exc.step}" in str(exc) and "\n" not in str(exc)
    s = _outputs_clean(tmp_path)
    assert s["status"] == "diverged" and s["diverged"] == exc.as_dict() and s["steps"] == exc.step
    saved = sorted(int(p.name.split("_")[1]) for p in tmp_path.glob("checkpoints/step_*"))
    assert all(step < exc.step for step in saved)


def test_local_mark_trains_on_marks_and_saves_no_checkpoint_after(tmp_path):
    cfg = _config(1e6, checkpoint={"every": 1}, on_divergence="mark")
    summaries = run_local(4, train, parse(cfg), tmp_path)
    s = _outputs_clean(tmp_path)
    assert s["status"] == "diverged" and s["steps"] == summaries[0]["steps"] > 5
    first = s["diverged"]
    assert 1 <= first["step"] <= 5 and 0 <= first["peer"] < 4
    saved = [int(p.name.split("_")[1]) for p in tmp_path.glob("checkpoints/step_*")]
    assert saved and max(saved) < first["step"]


def test_healthy_run_says_ok(tmp_path):
    s = train_fleet(parse(_config(0.1)), tmp_path)
    assert s["status"] == "ok" and "diverged" not in s
    assert _strict((tmp_path / "summary.json").read_text())["status"] == "ok"


def test_fleet_names_the_first_peer(tmp_path):
    # local steps only (the fleet's dense product with W would spread an inf as 0 * inf = nan to every peer)
    cfg = {**_config(0.1), "algorithm": {**load("algorithm", "local_sgd"), "period": 100}}
    with pytest.raises(divergence.Diverged) as caught:
        # peer 2's learning rate is fine, its start is not: one inf entry in its slice only
        from dpsgd.sim.run import FleetRun
        from dpsgd.training import run_loop

        run = FleetRun(parse(cfg))
        with torch.no_grad():
            run.fleet.params[0][2].view(-1)[0] = math.inf
        run_loop(run, parse(cfg), tmp_path)
    assert caught.value.peer == 2 and caught.value.step == 1
    assert _outputs_clean(tmp_path)["diverged"]["peer"] == 2


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="on_divergence must be one of stop, mark"):
        divergence.check_mode({"on_divergence": "ignore"})


@pytest.mark.processes
@pytest.mark.parametrize(
    "backend", ["fleet", *(pytest.param(b, marks=pytest.mark.slow) for b in ("local", "mpi", "torch"))]
)
def test_app_ends_with_one_line(app, tmp_path, backend):
    run_dir = tmp_path / "run"
    threads = ["backend.threads=1"] if backend == "fleet" else []  # small model: one thread is faster under load
    proc = app([f"backend={backend}", *BLOWS_UP, *threads], run_dir)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    s = _outputs_clean(run_dir)
    first = s["diverged"]
    assert f"peer {first['peer']} diverged at step {first['step']}" in lines[0]
    assert s["status"] == "diverged" and 1 <= first["step"] <= 5


def test_report_marks_and_tune_fails_diverged_runs(tmp_path, capsys):
    from omegaconf import OmegaConf

    from experiments import report, tune

    for name, lr in (("0", 0.1), ("1", 1e6)):
        cfg = _config(lr, on_divergence="mark", backend={"name": "fleet"})
        (tmp_path / name).mkdir()
        OmegaConf.save(OmegaConf.create(cfg), tmp_path / name / "config.yaml")
        train_fleet(parse(cfg), tmp_path / name)
    assert report.main([str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "status" in table and "diverged" in table and "1 of 2 runs diverged" in table
    md = (tmp_path / "report.md").read_text()
    assert "| diverged |" in md and "| ok |" in md
    found = [{**t, "config": {**t["config"], "data": {**t["config"]["data"]}}} for t in tune.trials(tmp_path)]
    for t in found:
        t["summary"]["evaluated_on"] = "validation"
    choice = tune.select(found, ["optimizer.lr"])
    assert choice["failed"] == 1 and choice["chosen"] == {"optimizer.lr": 0.1}


def test_event_simulator_is_checked_too(tmp_path):
    """AD-PSGD on the event simulator: every peer's live parameters, once per step of peer 0."""
    cfg = {**_config(1e6), "algorithm": load("algorithm", "adpsgd"), "backend": {"name": "fleet"}}
    with pytest.raises(divergence.Diverged) as caught:
        train_fleet(parse(cfg), tmp_path)
    assert 1 <= caught.value.step <= 5
    assert _outputs_clean(tmp_path)["status"] == "diverged"


@pytest.mark.parametrize("name", ["adpsgd", "async_local_sgd"])
def test_a_diverged_event_simulation_keeps_its_asynchronous_figures(tmp_path, name):
    """The summary of an asynchronous run that diverged on the simulator still has its block (goodput, staleness,
    steps per peer): the figures wanted most when diagnosing one."""
    cfg = {**_config(1e6), "algorithm": load("algorithm", name), "backend": {"name": "fleet"}}
    with pytest.raises(divergence.Diverged):
        train_fleet(parse(cfg), tmp_path)
    saved = _outputs_clean(tmp_path)
    assert saved["status"] == "diverged" and sum(saved[name]["steps_per_peer"]) >= 1, saved.keys()


def test_mark_names_the_first_peer_to_diverge_not_a_later_one():
    """on_divergence=mark over 4 real peers: peer 1 diverges at step 4, peer 2 at step 2 (its loss), peer 3 at
    step 5; each stays diverged afterwards. The summary every peer writes names peer 2 at step 2: the earliest
    step (not the latest, nor the lowest or highest rank among the diverged), and that peer's first step."""
    from types import SimpleNamespace

    diverges = {1: 4, 2: 2, 3: 5}

    def peer(comm):
        model = torch.nn.Linear(3, 1)
        run = SimpleNamespace(peer=SimpleNamespace(model=model, optimizer=SimpleNamespace(comm=comm)), comm=comm)
        guard = divergence.Guard(run, "mark")
        for step in range(1, 8):
            loss = 0.5
            if comm.rank in diverges and step >= diverges[comm.rank]:
                if comm.rank == 2:
                    loss = math.nan
                else:
                    with torch.no_grad():
                        model.weight[0, comm.rank - 1] = math.inf
            guard.check(step, loss)
        return guard.summary()

    summaries = run_local(4, peer, timeout_s=60)
    for r, s in enumerate(summaries):
        assert s["status"] == "diverged", f"rank {r}: {s}"
        assert (s["diverged"]["peer"], s["diverged"]["step"]) == (2, 2), f"rank {r} names {s['diverged']}"
        assert "training loss is nan" in s["diverged"]["what"]
