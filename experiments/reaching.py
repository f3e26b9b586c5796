"""Reaching a target: `METRIC=VALUE` (an accuracy to reach, or a perplexity or loss to get under), the first record
of a run that reaches it, and over a configuration's seeds how many did and how long they took.

The report (`experiments.report DIR --target test_accuracy=0.85`) and the map read targets through here, so a
target means the same everywhere: a record reaches it when its value is at or above it (at or under it for a
minimised metric), and only records that describe every peer count (not an asynchronous run's rank-0 view).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from experiments.intervals import mean_interval

MINIMISED = ("test_perplexity", "test_loss", "train_loss")  # reached from above (lower is better); others from below
# what "to the target" is measured in: a column of the report each, from the first record that reaches it
MEASURES = {
    "steps_to_target": "step",
    "samples_to_target": "samples",
    "mb_to_target": "mb_sent_per_peer",
    "time_to_target_s": None,  # the run's clock: emulated where its network is emulated, else the wall clock
}


@dataclass(frozen=True)
class Target:
    metric: str
    value: float

    @classmethod
    def parse(cls, text: str) -> Target:
        """`test_accuracy=0.85`, or a one-line ValueError saying what is expected."""
        metric, equals, value = text.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not equals or not metric or not math.isfinite(number):
            raise ValueError(
                f"--target takes METRIC=VALUE, a record's metric and the value to reach (e.g. test_accuracy=0.85, "
                f"test_perplexity=9.5), got {text!r}"
            )
        return cls(metric, number)

    def __str__(self) -> str:
        return f"{self.metric} {'<=' if self.minimised else '>='} {self.value:g}"

    @property
    def minimised(self) -> bool:
        return self.metric in MINIMISED

    def meets(self, value: float | None) -> bool:
        """Whether a record's value of the metric has reached the target."""
        if value is None or not math.isfinite(value):
            return False
        return value <= self.value if self.minimised else value >= self.value

    def first(self, records: list[dict]) -> dict | None:
        """The first record (of every peer: not an asynchronous run's rank-0 view) that reaches the target."""
        return next((r for r in records if r.get("scope") != "rank 0" and self.meets(r.get(self.metric))), None)


def reached(record: dict | None) -> dict:
    """The MEASURES of a run at its first record at the target (all None where it never reached it)."""
    if record is None:
        return dict.fromkeys(MEASURES)
    out = {key: record.get(field) for key, field in MEASURES.items() if field is not None}
    emulated = record.get("emulated_time_s")
    out["time_to_target_s"] = emulated if emulated is not None else record.get("wall_time_s")
    return out


def over_seeds(target: Target, runs: list[list[dict]]) -> dict:
    """A configuration's seeds (each run's records) to the target: `reached` ("2/3"), and each MEASURE's mean over
    the seeds that reached it with `KEY_ci95` its 95% interval's half width (none where a single seed did, or none)."""
    hits = [reached(target.first(records)) for records in runs]
    done = [h for h in hits if h["steps_to_target"] is not None]
    out: dict = {"reached": f"{len(done)}/{len(runs)}"}
    for key in MEASURES:
        values = [h[key] for h in done if h[key] is not None]
        if not values:
            out[key] = None
            continue
        out[key], ci = mean_interval(values)
        if not math.isnan(ci):
            out[f"{key}_ci95"] = ci
    return out
