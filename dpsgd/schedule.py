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
from collections.abc import Mapping, Sequence

# each kind's options with their defaults (conf/schedule/NAME.yaml writes them out)
KINDS: dict[str, dict[str, object]] = {
    "constant": {"warmup_steps": 0},
    "step": {"warmup_steps": 0, "milestones": (0.5, 0.75), "gamma": 0.1},
    "cosine": {"warmup_steps": 0, "final": 0.0},
}


class Schedule:
    """`factor(step)` for steps 1 .. total_steps of a run of the schedule `kind` with its options (see KINDS)."""

    def __init__(
        self,
        kind: str = "constant",
        total_steps: int = 1,
        *,
        warmup_steps: int = 0,
        milestones: Sequence[float] = (0.5, 0.75),
        gamma: float = 0.1,
        final: float = 0.0,
    ):
        if kind not in KINDS:
            raise ValueError(f"unknown schedule {kind!r}; valid schedules: {', '.join(KINDS)}")
        self.kind = kind
        self.total = max(1, int(total_steps))
        self.warmup = int(warmup_steps or 0)
        if self.warmup < 0:
            raise ValueError(f"schedule.warmup_steps must be >= 0, got {self.warmup}")
        self.milestones = sorted(float(m) for m in milestones or [])
        self.gamma, self.final = float(gamma), float(final)
        if any(not 0 < m < 1 for m in self.milestones):
            raise ValueError(
                f"schedule.milestones are fractions of the run in (0, 1) (0.5: half way), got {self.milestones}"
            )
        if not 0 < self.gamma <= 1 or not 0 <= self.final <= 1:
            raise ValueError(
                f"schedule.gamma must be in (0, 1] and schedule.final in [0, 1], got {self.gamma} and {self.final}"
            )

    @classmethod
    def of(cls, name: str, options: Mapping, total_steps: int) -> Schedule:
        """The schedule a `schedule=` config names, its options checked against its kind's (one line naming an
        option the kind does not take)."""
        if name not in KINDS:
            raise ValueError(f"unknown schedule {name!r}; valid schedules: {', '.join(KINDS)}")
        unknown = [k for k in options if k not in KINDS[name]]
        if unknown:
            takes = ", ".join(KINDS[name])
            raise ValueError(f"schedule={name} takes no option {', '.join(map(repr, unknown))}; its options: {takes}")
        return cls(name, total_steps, **options)

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
