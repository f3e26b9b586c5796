"""Sarfi et al. 2025 (SparseLoCo): DiLoCo's outer delta as chunked top-k (1-3% density) at 2 bits, with error
feedback in place of the outer momentum, reaches DiLoCo's loss or better for two orders of magnitude fewer bytes."""

from __future__ import annotations

from pathlib import Path

from experiments.reproduce import Configuration, Finding
from experiments.reproductions._text import INNER, WORDS, WORKLOAD, curves
from experiments.reproductions._verdicts import compare, overall

PAPER = "Sarfi, Thérien, Lidin & Belilovsky 2025, Communication Efficient LLM Pre-training with SparseLoCo"
CLAIM = (
    "SparseLoCo (error feedback in place of DiLoCo's outer momentum, chunked top-k at 1-3% density, 2-bit values) "
    "reaches a loss at or below DiLoCo's at every number of inner steps H tried, while compressing its messages "
    "more than 97x."
)
PERIODS = (15, 30, 50)
_H = f"++algorithm.period={','.join(map(str, PERIODS))}"  # ++: the sweep is composed with the default algorithm first
SWEEPS = {
    "sparseloco": [*WORKLOAD, *INNER, "algorithm=sparseloco", _H],
    "diloco": [*WORKLOAD, *INNER, "algorithm=diloco", _H],
}
RUNS = {"sparseloco": len(PERIODS), "diloco": len(PERIODS)}
CLAIMED_RATIO = 97


def period(c: Configuration) -> int:
    return int(c.runs[0]["config"]["algorithm.period"])


def analyze(configs: dict[str, list[Configuration]], out: Path) -> Finding:
    sparse = sorted(configs["sparseloco"], key=period)
    dense = sorted(configs["diloco"], key=period)
    steps, peers, seeds = int(dense[0].summary["steps"]), int(dense[0].summary["peers"]), int(dense[0].summary["seeds"])
    order = [compare(s, d, "test_perplexity") for s, d in zip(sparse, dense)]  # +1: SparseLoCo wholly above
    ratios = [d.mean("mb_sent_per_peer") / s.mean("mb_sent_per_peer") for s, d in zip(sparse, dense)]
    words = {1: "worse beyond the intervals", 0: "intervals overlap", -1: "better beyond the intervals"}
    table = "\n".join(
        [
            "| | paper (paraphrased) | ours |",
            "|---|---|---|",
            "| loss against DiLoCo | at or below DiLoCo's at every H in {15, 30, 50, 100, 250} (512M model) | "
            + "; ".join(
                f"H = {period(s)}: {s.mean('test_perplexity'):.3f} vs {d.mean('test_perplexity'):.3f}"
                for s, d in zip(sparse, dense)
            )
            + " |",
            "| compression | over 97x (1-3% density, 2-bit values) | "
            + ", ".join(f"{r:.1f}x" for r in ratios)
            + " fewer bytes than DiLoCo's all-reduce |",
            "",
            f"Ours: {peers} peers on {WORDS}, {steps} steps, inner AdamW for both, {seeds} "
            "seeds. SparseLoCo: error feedback decay 0.95, 64 kept per tile of up to 64 x 64 (1.6% of a 64 x 64 "
            "matrix; vectors of 64 and fewer entries go whole), 2-bit values, outer SGD lr 1. DiLoCo: outer "
            "Nesterov, lr 0.7, momentum 0.9, exact 32-bit all-reduce.",
            "",
            "| H | SparseLoCo test perplexity | DiLoCo test perplexity | SparseLoCo vs DiLoCo | SparseLoCo MB | "
            "DiLoCo MB | bytes ratio |",
            "|---|---|---|---|---|---|---|",
            *(
                f"| {period(s)} | {s.text('test_perplexity', 3)} | {d.text('test_perplexity', 3)} | {words[o]} | "
                f"{s.mean('mb_sent_per_peer'):.3f} | {d.mean('mb_sent_per_peer'):.3f} | {r:.1f}x |"
                for s, d, o, r in zip(sparse, dense, order, ratios)
            ),
        ]
    )
    parts = [all(o <= 0 for o in order), all(r >= CLAIMED_RATIO for r in ratios)]
    verdict = (
        {True: "holds", False: "does not hold", None: "partly holds"}[overall(parts)]
        + ": SparseLoCo's test perplexity against DiLoCo's is "
        + "; ".join(
            f"{s.mean('test_perplexity'):.3f} vs {d.mean('test_perplexity'):.3f} at H = {period(s)} ({words[o]})"
            for s, d, o in zip(sparse, dense, order)
        )
        + "; its messages are "
        + ", ".join(f"{r:.1f}x" for r in ratios)
        + f" smaller than DiLoCo's (the claim: over {CLAIMED_RATIO}x; a small model's vectors go whole and each "
        "kept entry costs 12 index bits beside its 2 value bits)."
    )

    def label(c: Configuration) -> str:
        name = "SparseLoCo" if c.runs[0]["config"]["algorithm.name"] == "sparseloco" else "DiLoCo"
        return f"{name}, H = {period(c)}"

    title = f"{peers} peers, shakespeare, {seeds} seeds, 95% bands"
    by_steps, by_bytes = curves([*sparse, *dense], ("test_perplexity", "test perplexity"), out, title, label)
    plots = [by_bytes, by_steps]
    return Finding(table, verdict, overall(parts), plots)
