"""Where a run's records go beside metrics.jsonl: TensorBoard event files and MLflow's store (`logger=` config group).

How it works: docs/guide/internals.md#loggers.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Protocol

from dpsgd.config import LoggerConfig

SINKS = ("tensorboard", "mlflow")
INSTALL_HINT = "pip install 'dpsgd[logging]' (or the package itself), or leave logger=none"


class Sink(Protocol):
    def write(self, record: dict) -> None: ...
    def close(self, summary: dict | None) -> None: ...


def scalars(record: dict) -> dict[str, float]:
    """The record's numbers by name; nested dicts as `block/key`; None, text and lists left out."""
    return {
        key: float(value)
        for key, value in dotted_keys(record, "/").items()
        if isinstance(value, int | float) and not isinstance(value, bool) and key.rpartition("/")[2] != "step"
    }


class TensorBoardSink:
    """Scalars in RUN/tensorboard/ (torch.utils.tensorboard's SummaryWriter); a resumed run purges what came after
    its checkpoint, as metrics.jsonl does."""

    def __init__(self, out_dir: Path, resumed_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out_dir / "tensorboard"), purge_step=resumed_step + 1 if resumed_step else None)

    def write(self, record: dict) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, global_step=int(record["step"]))
        self.writer.flush()

    def close(self, summary: dict | None) -> None:
        self.writer.close()


class MLflowSink:
    """One MLflow run per run folder (a resumed run continues it): the resolved config as parameters, the records
    as metrics, summary.json as an artifact. Through MlflowClient, so runs in one process (sweeps on the fleet or
    the local backend) never share MLflow's global active run."""

    def __init__(self, params: dict, out_dir: Path, logger: LoggerConfig):
        uri = logger.mlflow_uri or (out_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3: the file store is opt-in
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        name = logger.experiment or "dpsgd"
        found = self.client.get_experiment_by_name(name)
        experiment = found.experiment_id if found else self.client.create_experiment(name)
        run_dir = str(out_dir.resolve())
        runs = self.client.search_runs([experiment], filter_string=f"tags.dpsgd_run_dir = '{run_dir}'")
        if runs:  # resumed: the same MLflow run goes on
            self.run_id = runs[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            return
        self.run_id = self.client.create_run(
            experiment, run_name=out_dir.name, tags={"dpsgd_run_dir": run_dir}
        ).info.run_id
        logged = [Param(k, str(v)[:6000]) for k, v in sorted(dotted_keys(params).items())]
        for i in range(0, len(logged), 100):  # MLflow takes at most 100 parameters per call
            self.client.log_batch(self.run_id, params=logged[i : i + 100])

    def write(self, record: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        step = int(record["step"])
        metrics = [Metric(k, v, now, step) for k, v in scalars(record).items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def close(self, summary: dict | None) -> None:
        if summary is not None:
            self.client.log_dict(self.run_id, summary, "summary.json")
        self.client.set_terminated(self.run_id, status="FINISHED" if summary is not None else "KILLED")


def open_sinks(logger: LoggerConfig, params: dict, out_dir: Path, resumed_step: int = 0) -> list[Sink]:
    """The sinks `logger` names, opened in `out_dir`; `params`: the resolved config, an MLflow run's parameters
    (ValueError: a sink it does not know or cannot open)."""
    problem = missing_package(logger)
    if problem:
        raise ValueError(problem)
    return [
        TensorBoardSink(out_dir, resumed_step) if name == "tensorboard" else MLflowSink(params, out_dir, logger)
        for name in logger.sinks
    ]


def missing_package(logger: LoggerConfig) -> str | None:
    """What the configured sinks need and is not installed, or an unknown sink, as one line (None: all there)."""
    import importlib.util

    for name in logger.sinks:
        if name not in SINKS:
            return f"unknown logger sink {name!r}; valid sinks: {', '.join(SINKS)}"
        if importlib.util.find_spec(name) is None:  # each sink's package has its name
            return f"logger sink {name} needs the {name} package, which is not installed: {INSTALL_HINT}"
    return None


def dotted_keys(tree: dict, separator: str = ".", prefix: str = "") -> dict[str, Any]:
    """A nested config as one level of dotted keys (`optimizer.lr`)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(dotted_keys(value, separator, f"{prefix}{key}{separator}"))
        else:
            out[f"{prefix}{key}"] = value
    return out
