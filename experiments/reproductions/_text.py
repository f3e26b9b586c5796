"""The workload the text reproductions share: data=text_corpus (next-character prediction on the King James
Version, the test split its held-out last 2.5%) with the small transformer (dim 64, 2 layers), 8 peers on the
fleet, 4 windows of 64 characters per peer per step, 250 steps (2 passes over 4000 windows); one inner
optimizer (AdamW, lr 0.003, weight decay 0.1) wherever the method has one. A run takes about a minute of CPU."""

from __future__ import annotations

from pathlib import Path

from experiments.reproduce import Configuration, plot_curves

WORKLOAD = [
    "backend=fleet",
    "peers=8",
    "data=text_corpus",
    "model=transformer",
    "batch_size=4",
    "epochs=2",
    "log_every=25",
    "data.test_fraction=0.025",
    "data.split_seed=0",
]
INNER = ["optimizer=adamw", "optimizer.lr=0.003", "optimizer.weight_decay=0.1"]  # one inner optimizer for all


def mb_to_reach(config: Configuration, target: float, key: str = "test_perplexity") -> list[float | None]:
    """Per seed, the MB a peer had sent at the first record whose `key` is at or below `target` (None: never)."""
    out: list[float | None] = []
    for run in config.runs:
        hits = [r["mb_sent_per_peer"] for r in run["metrics"] if r.get(key) is not None and r[key] <= target]
        out.append(hits[0] if hits else None)
    return out


def setting(config: Configuration, key: str):
    return config.runs[0]["config"][key]


def curves(configs: list[Configuration], metric: tuple[str, str], out: Path, title: str, label) -> tuple[Path, Path]:
    """The text reproductions' two figures of `metric` (key, axis label): against steps (vs_steps.png) and against
    the MB a peer sent, on a log axis (vs_mb_sent.png)."""
    by_steps = plot_curves(configs, "step", [metric], out / "vs_steps.png", title, label=label)
    by_bytes = plot_curves(
        configs, "mb_sent_per_peer", [metric], out / "vs_mb_sent.png", title, x_label="MB sent per peer", label=label,
        log_x=True,
    )  # fmt: skip
    return by_steps, by_bytes
