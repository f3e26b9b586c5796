"""logger=tensorboard / mlflow / all: the records of metrics.jsonl, read back with TensorBoard's and MLflow's own
readers, equal the file's."""

from __future__ import annotations

import json

import pytest

from dpsgd.config import LoggerConfig
from dpsgd.loggers import missing_package, scalars


def test_scalars_of_a_record():
    record = {
        "step": 4,
        "test_accuracy": 0.5,
        "scope": "rank 0",
        "emulated_time_s": None,
        "converged": True,
        "adpsgd": {"staleness_mean": 1.5, "roles": ["active"]},
    }
    assert scalars(record) == {"test_accuracy": 0.5, "adpsgd/staleness_mean": 1.5}
    assert missing_package(LoggerConfig(sinks=["tensorboard", "mlflow"])) is None  # the dev extra installs both
    assert "valid sinks: tensorboard, mlflow" in missing_package(LoggerConfig(sinks=["wandb"]))


def test_tensorboard_and_mlflow_hold_the_records(app, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    proc = app(["backend=fleet", "epochs=3", "logger=all"], run)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(records) >= 3
    steps = [r["step"] for r in records]

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    for key in ("test_accuracy", "train_loss", "consensus_distance", "mb_sent_per_peer"):
        logged = events.Scalars(key)
        assert [e.step for e in logged] == steps
        assert [e.value for e in logged] == pytest.approx([r[key] for r in records], rel=1e-6)  # float32 there

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store only when asked to
    client = MlflowClient(tracking_uri=(run / "mlruns").as_uri())
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("dpsgd").experiment_id])
    assert mlflow_run.info.status == "FINISHED" and mlflow_run.data.params["algorithm.name"] == "dpsgd"
    for key in ("test_accuracy", "train_loss", "wall_time_s"):
        history = sorted(client.get_metric_history(mlflow_run.info.run_id, key), key=lambda m: m.step)
        assert [(m.step, m.value) for m in history] == [(r["step"], r[key]) for r in records]
    artifact = client.download_artifacts(mlflow_run.info.run_id, "summary.json", str(tmp_path))
    assert json.loads(open(artifact).read()) == json.loads((run / "summary.json").read_text())
