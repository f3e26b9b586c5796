"""Runs in tests: a small experiment config from the conf/ files, and reading a run folder's outputs
(its summary, its metric records without timings: what a resumed run must reproduce exactly)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

CONF = Path(__file__).parent.parent / "conf"


def load(group: str, name: str) -> dict:
    return yaml.safe_load((CONF / group / f"{name}.yaml").read_text())


def algorithm(name: str, **options) -> dict:
    """conf/algorithm/NAME.yaml's section (its keys, without the defaults list that picks its optimizer), with
    `options` on top."""
    return {k: v for k, v in load("algorithm", name).items() if k != "defaults"} | options


def optimizer_of(name: str) -> str:
    """The optimizer option (conf/optimizer/) the algorithm's yaml picks (`override /optimizer...`), else sgd."""
    for entry in load("algorithm", name).get("defaults") or []:
        if isinstance(entry, dict):
            for key, value in entry.items():
                if "/optimizer" in key:
                    return value
    return "sgd"


def own_options(name: str) -> dict:
    """The algorithm's own options as a run's build hands them to its constructor (`_target_` dicts made
    factories): the yaml's keys but its name and class."""
    from dpsgd.options import factories

    return factories({k: v for k, v in algorithm(name).items() if k not in ("name", "_target_")})


def experiment(
    algorithm: dict, topology: str = "ring", peers: int = 4, backend: str = "local", optimizer: dict | None = None
) -> dict:
    """A resolved config: `algorithm` (stepping `optimizer`, default the one its yaml picks) on the MLP and digits,
    seed 3, one epoch of batches of 16."""
    name = algorithm.get("name")
    default = optimizer_of(name) if (CONF / "algorithm" / f"{name}.yaml").exists() else "sgd"
    return {
        "algorithm": {k: v for k, v in algorithm.items() if k != "defaults"},
        "optimizer": optimizer if optimizer is not None else load("optimizer", default),
        "topology": load("topology", topology),
        "model": load("model", "mlp"),
        "data": load("data", "digits"),
        "backend": {"name": backend},
        "network": load("network", "loopback"),
        "peers": peers,
        "seed": 3,
        "epochs": 1,
        "batch_size": 16,
        "log_every": 10,
        "device": "cpu",
        "comm": {"timeout_s": 60},
    }


# the summary keys a resumed run must reproduce bit for bit
EXACT = (
    "steps",
    "test_accuracy",
    "test_loss",
    "train_loss",
    "consensus_distance",
    "mb_sent_per_peer",
    "peer_test_accuracy_min",
)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def timeless_records(run_dir: Path) -> list[dict]:
    timings = ("wall_time_s", "comm_time_s", "comm_overlap_s")
    return [
        {k: v for k, v in json.loads(line).items() if k not in timings}
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]


def assert_same_numbers(full: Path, run_dir: Path) -> None:
    """The run in `run_dir` ended with the numbers of the uninterrupted one in `full`."""
    a, b = summary(full), summary(run_dir)
    for key in EXACT:
        assert a[key] == b[key], key
    assert timeless_records(full) == timeless_records(run_dir)
