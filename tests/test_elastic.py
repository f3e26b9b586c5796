"""Elastic runs (dpsgd.elastic): a world that re-forms with another peer count continues from the newest
complete checkpoint. In process (local peers, the real training loop and checkpoints): what survivors and
added peers start from against a numpy reference, the budget of samples, the membership record; the config
checks; and the app's own relaunch of the survivors when an MPI peer is killed (a real process)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from runs import experiment

from dpsgd import checkpoint, elastic
from dpsgd.comm import run_local
from dpsgd.config import parse
from dpsgd.training import train
from experiments.validate import ConfigError, validate


def elastic_config(algorithm: str = "dpsgd", epochs: int = 2) -> dict:
    from runs import load

    cfg = experiment(load("algorithm", algorithm), peers=3)  # the base steps SGD with momentum 0.9
    return {**cfg, "elastic": True, "epochs": epochs, "log_every": 5, "checkpoint": {"every": 10}}


def trained(tmp_path: Path, peers: int, cfg: dict) -> list[dict]:
    return run_local(peers, lambda comm: train(comm, parse(cfg), tmp_path))


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_survivors_keep_their_state_and_an_added_peer_takes_their_average_with_zero_momentum(tmp_path):
    cfg = elastic_config()
    trained(tmp_path, 3, cfg)
    step, written_by = checkpoint.newest(tmp_path)
    assert written_by == 3
    saved = [checkpoint.load(tmp_path, step, r) for r in range(3)]
    grown = [elastic.resume_state(tmp_path, r, 4) for r in range(4)]
    for r in range(3):  # survivors: their own model and momentum; a new share (no batch state)
        for key, value in saved[r]["model"].items():
            assert np.array_equal(grown[r]["model"][key].numpy(), value.numpy())
        assert grown[r]["optimizer"]["state"].keys() == saved[r]["optimizer"]["state"].keys() != set()
        assert "batches" not in grown[r] and grown[r]["elastic_from"] == 3
    added = grown[3]
    for key in saved[0]["model"]:
        reference = np.mean([s["model"][key].numpy().astype(np.float64) for s in saved], axis=0)
        np.testing.assert_allclose(added["model"][key].numpy(), reference, rtol=1e-6, atol=1e-7)
    assert added["optimizer"]["state"] == {} and added["comm_stats"] == {}
    assert added["optimizer"]["dpsgd"]["step_count"] == saved[0]["optimizer"]["dpsgd"]["step_count"] == step
    shrunk = [elastic.resume_state(tmp_path, r, 2) for r in range(2)]  # old rank 2's model is lost
    for r in range(2):
        assert all(np.array_equal(shrunk[r]["model"][k], saved[r]["model"][k]) for k in saved[r]["model"])
    torn = tmp_path / "checkpoints" / f"step_{step:08d}" / "rank2.pt"  # a peer died while writing the newest
    torn.write_bytes(torn.read_bytes()[:100])
    assert elastic.resume_state(tmp_path, 3, 4)["step"] == checkpoint.complete_steps(tmp_path)[-1] == step - 10


@pytest.mark.parametrize("algorithm, grow", [("dpsgd", 4), ("local_sgd", 2)])
def test_a_reformed_world_finishes_the_sample_budget_and_records_the_change(tmp_path, algorithm, grow):
    cfg = elastic_config(algorithm, epochs=3)
    # the first world of 3 is stopped after its checkpoint at step 20 (as if a peer was lost at step 23)
    short = {**cfg, "epochs": 2}
    trained(tmp_path, 3, short)
    first = records(tmp_path)
    step, _ = checkpoint.newest(tmp_path)
    summaries = trained(tmp_path, grow, cfg)
    recs = records(tmp_path)
    change = [r for r in recs if r.get("event") == elastic.EVENT]
    assert [(c["step"], c["old_peers"], c["new_peers"]) for c in change] == [(step, 3, grow)]
    assert [r for r in recs if r["step"] <= step and "event" not in r] == [r for r in first if r["step"] <= step]
    per_step_before, per_step_after = 16 * 3, 16 * grow
    budget = 3 * (1437 // per_step_before) * per_step_before  # epochs x samples of an epoch at the configured 3 peers
    final = summaries[0]
    assert final["peers"] == grow
    assert final["samples"] == step * per_step_before + (final["steps"] - step) * per_step_after
    assert budget <= final["samples"] < budget + per_step_after
    assert final["test_accuracy"] > 0.8


def test_elastic_config_checks(hydra_config):
    def check(*overrides):
        validate(hydra_config("elastic=true", "checkpoint.every=10", *overrides))

    with pytest.raises(ConfigError, match=r"elastic=true supports algorithm allreduce, dpsgd, local_sgd.*; sgp keeps"):
        check("backend=torch", "algorithm=sgp", "topology=directed_exponential")
    with pytest.raises(ConfigError, match=r"elastic=true needs peers that are processes .*got backend=local"):
        check()
    with pytest.raises(ConfigError, match=r"needs checkpoint.every > 0"):
        check("backend=torch", "checkpoint.every=0")
    with pytest.raises(ValueError, match=r"re-formed with 5 peers, but topology 'hypercube' cannot be built"):
        elastic.check_world(parse(hydra_config("topology=hypercube", "peers=8")).topology, 5)


@pytest.mark.slow  # soak: a kill, a timeout and a relaunch of 4 processes
@pytest.mark.processes
@pytest.mark.timeout(120)
def test_mpi_peer_killed_the_driver_relaunches_the_survivors(app, tmp_path):
    args = ["backend=mpi", "peers=4", "elastic=true", "epochs=4", "log_every=5", "checkpoint.every=10"]
    args += ["comm.timeout_s=10", "faults.kill_peer=2", "faults.at_step=25"]
    proc = app(args, tmp_path, timeout=110)
    assert proc.returncode == 0, proc.stderr
    assert (
        "peer 2 died at step 25" in proc.stderr
        and "elastic: relaunching 3 peers from the checkpoint of step 20" in (proc.stderr)
    )
    change = [r for r in records(tmp_path) if r.get("event") == elastic.EVENT]
    assert [(c["step"], c["old_peers"], c["new_peers"]) for c in change] == [(20, 4, 3)]
    killed_at = (tmp_path / "logs" / "world0" / "rank2.log").stat().st_mtime  # its last words: the fault's line
    print(f"\nmpi peer 2 of 4 killed: the world of 3 began {change[0]['unix_time'] - killed_at:.1f} s later")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["peers"] == 3 and summary["test_accuracy"] > 0.8
    assert (tmp_path / "logs" / "world0" / "rank2.log").exists()
    assert all(checkpoint.torn(f) is None for f in (tmp_path / "checkpoints").glob("step_*"))


@pytest.mark.slow  # 81 s, the suite's longest: make soak (the mpi relaunch above keeps elasticity in make test)
@pytest.mark.processes
@pytest.mark.timeout(400)
def test_chaos_short_one_of_3_torchrun_nodes_killed_and_one_added(tmp_path, capsys):
    """make chaos in short: 3 peers as torchrun elastic nodes, one killed (agent and worker, SIGKILL) at a
    seeded random step and one added back; the run finishes by itself, within the tolerance of the
    undisturbed run, with both membership changes recorded, no torn checkpoint and no process left."""
    from experiments.bench import chaos

    args = ["--peers", "3", "--kill", "1", "--add", "1", "--algorithms", "dpsgd", "--epochs", "20"]
    code = chaos.main([*args, "--step-delay-s", "0.02", "--out", str(tmp_path / "chaos.json")])
    print(capsys.readouterr().out)
    assert code == 0
