"""Reading a run folder's outputs in tests: its summary, and its metric records without timings
(what a resumed run must reproduce exactly)."""

from __future__ import annotations

import json
from pathlib import Path

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
