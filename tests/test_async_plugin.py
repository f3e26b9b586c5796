"""Asynchrony as a contract: a user's asynchronous algorithm written in one file outside the package
(tests/plugins.py's PartialGossip, plugged in with `algorithm._target_`) runs on the event simulator, whose
parameters equal a numpy replay of its event log with the plug-in's own averaging rule, and under mpiexec
(the app with backend=mpi), each run writing the plug-in's own summary block."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from test_sim_events import config, replay

from dpsgd.comm.netem import Link
from dpsgd.config import parse
from dpsgd.sim import train_fleet
from dpsgd.sim.events import ComputeTimes, Simulation

TESTS = Path(__file__).parent
PLUGIN = {"_target_": "plugins.PartialGossip", "name": "partial_gossip", "weight": 0.25}


def test_the_simulator_runs_the_plugins_own_rule():
    cfg = config(peers=6, momentum=0.0)
    cfg["algorithm"].update(PLUGIN)
    sim = Simulation(parse(cfg), link=Link(latency_s=0.004), compute=ComputeTimes(6, 0.01, seed=1))
    x0 = sim.live[0].double().numpy().copy()
    sim.run()
    assert type(sim.opts[0]).__name__ == "PartialGossip" and any(e[0] == "avg" for e in sim.log)
    expected = replay(cfg, sim, x0, weight=0.25)
    np.testing.assert_allclose(sim.live.double().numpy(), expected, rtol=0, atol=2e-5)
    halves = replay(cfg, sim, x0, weight=0.5)  # AD-PSGD's rule on the same log: far from what ran
    assert np.abs(halves - expected).max() > 1e-3


def test_the_simulator_writes_the_plugins_summary_block(tmp_path):
    cfg = config(peers=4)
    cfg["algorithm"].update(PLUGIN)
    summary = train_fleet(parse(cfg), tmp_path)
    block = summary["partial_gossip"]
    assert "adpsgd" not in summary and block["averagings"] > 0
    assert block["averagings"] == sum(block["averagings_served_per_peer"])
    assert sum(block["staleness_histogram"]) == sum(block["steps_per_peer"])
    assert summary["steps"] == round(sum(block["steps_per_peer"]) / 4)
    assert summary["test_accuracy"] > 0.5


@pytest.mark.slow  # soak: make test keeps the plugin on local peers
@pytest.mark.processes
def test_the_plugin_runs_under_mpiexec(app, tmp_path):
    run_dir = tmp_path / "run"
    # adpsgd's yaml names its class: the plugin's replaces it; its own option is new to the config (+)
    args = ["algorithm=adpsgd", f"algorithm._target_={PLUGIN['_target_']}", f"+algorithm.weight={PLUGIN['weight']}"]
    args += ["algorithm.name=partial_gossip", "backend=mpi", "peers=2", "epochs=2", "log_every=10"]
    env = {**app.env(), "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    import subprocess

    proc = subprocess.run(
        app.command(args, run_dir), cwd=app.root, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    block = summary["partial_gossip"]
    assert summary["algorithm"] == "partial_gossip" and summary["backend"] == "mpi" and summary["peers"] == 2
    assert block["averagings"] > 0 and block["averagings"] == sum(block["averagings_served_per_peer"])
    assert block["roles"] == ["active", "passive"] and summary["test_accuracy"] > 0.5
