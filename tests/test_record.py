"""One record schema: every kind of run (real peers taking global steps, real asynchronous peers, the fleet,
the event simulator) writes metrics.jsonl records with exactly the keys of dpsgd.metrics.Record (the last
one also an asynchronous algorithm's block of totals), and summary.json with those of its last record; a key
outside the schema is refused."""

from __future__ import annotations

import copy
import json

import pytest
import runs

from dpsgd import metrics
from dpsgd.comm import run_local
from dpsgd.config import parse
from dpsgd.sim import train_fleet
from dpsgd.training import train

REQUIRED = {k for k in metrics.Record.__annotations__ if k in metrics.Record.__required_keys__}


def config(algorithm: str) -> dict:
    cfg = runs.experiment(runs.load("algorithm", algorithm), "ring", 4, "fleet")
    cfg["epochs"], cfg["log_every"] = 1, 4
    return cfg


def records(folder) -> tuple[list[dict], dict]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [json.loads(r) for r in lines], json.loads((folder / "summary.json").read_text())


@pytest.mark.parametrize("algorithm", ["dpsgd", "adpsgd"])
def test_real_peers_fleet_and_simulator_write_exactly_the_schemas_keys(algorithm, tmp_path):
    cfg = config(algorithm)  # digits: no perplexity, no known optimum, so the required keys only
    real = copy.deepcopy(cfg)
    real["backend"] = {"name": "local"}
    (tmp_path / "real").mkdir()
    run_local(4, train, parse(real), tmp_path / "real", timeout_s=60)
    (tmp_path / "sim").mkdir()
    train_fleet(parse(cfg), tmp_path / "sim")  # the fleet, or the event simulator for adpsgd
    for kind in ("real", "sim"):
        lines, summary = records(tmp_path / kind)
        assert len(lines) >= 2
        for line in lines:  # and on the last one, an asynchronous algorithm's block of totals (its summary's)
            keys = {k for k, v in line.items() if not isinstance(v, dict)}
            assert keys == REQUIRED, (kind, keys ^ REQUIRED)
            assert {k for k, v in line.items() if isinstance(v, dict)} <= ({"adpsgd"} if line is lines[-1] else set())
        assert REQUIRED - {"step", "scope"} <= set(summary), kind
    if algorithm == "adpsgd":  # rank 0's own view while its peers train, then every peer's
        assert {r["scope"] for r in records(tmp_path / "real")[0]} == {"rank 0", "all peers"}


def test_workload_keys_join_only_where_they_apply():
    assert set(metrics.record(step=1, test_perplexity=3.0)) == REQUIRED | {"test_perplexity"}
    assert metrics.record(step=1)["test_loss"] is None
    with pytest.raises(KeyError, match="not keys of dpsgd.metrics.Record"):
        metrics.record(step=1, grad_norm=0.5)
