"""Learning-rate schedules of the app (`schedule=` configs): the factor on the configured rate at each step.

The factor is a pure function of the step and the run's length, so a resumed run (which restores its step)
continues the schedule exactly where it stopped, on every backend and the fleet alike. Kinds:

- `constant`: 1.
- `step`: multiplied by `gamma` at each of `milestones`, fractions of the run (0.5: half of its steps),
  the decay of Goyal et al. 2017 and the decentralized papers that follow it.
- `cosine`: half a cosine from 1 towards `final` (a fraction of the rate) over the steps after warm-up
  (Loshchilov & Hutter 2017, without restarts; torch's CosineAnnealingLR with T_max those steps).

Each kind may begin with `warmup_steps` of linear warm-up: step k (1-based) of them uses k / warmup_steps of
the rate the schedule gives there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

KINDS = ("constant", "step", "cosine")


class Schedule:
    """`factor(step)` for steps 1 .. total_steps of a run, from a `schedule` config (None: constant)."""

    def __init__(self, cfg: Mapping | None, total_steps: int):
        cfg = dict(cfg or {"name": "constant"})
        self.kind = cfg.get("name", "constant")
        if self.kind not in KINDS:
            raise ValueError(f"unknown schedule {self.kind!r}; valid schedules: {', '.join(KINDS)}")
        self.total = max(1, int(total_steps))
        self.warmup = int(cfg.get("warmup_steps") or 0)
        if self.warmup < 0:
            raise ValueError(f"schedule.warmup_steps must be >= 0, got {self.warmup}")
        self.milestones = sorted(float(m) for m in cfg.get("milestones") or [])
        self.gamma = float(cfg.get("gamma", 0.1))
        self.final = float(cfg.get("final", 0.0))
        if any(not 0 < m < 1 for m in self.milestones):
            raise ValueError(
                f"schedule.milestones are fractions of the run in (0, 1) (0.5: half way), got {self.milestones}"
            )
        if not 0 < self.gamma <= 1 or not 0 <= self.final <= 1:
            raise ValueError(
                f"schedule.gamma must be in (0, 1] and schedule.final in [0, 1], got {self.gamma} and {self.final}"
            )

    def factor(self, step: int) -> float:
        """The factor on the configured rate for step `step` (1-based; the step about to be taken)."""
        if self.kind == "step":
            value = self.gamma ** sum(step > m * self.total for m in self.milestones)
        elif self.kind == "cosine":
            span = max(1, self.total - self.warmup)
            done = min(max(step - self.warmup - 1, 0), span) / span
            value = self.final + (1 - self.final) * 0.5 * (1 + math.cos(math.pi * done))
        else:
            value = 1.0
        if step <= self.warmup:
            value *= step / self.warmup
        return value
