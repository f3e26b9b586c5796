"""Peng et al. 2024 (DeMo): sending only the fast DCT components of each peer's momentum, and stepping on the
sign of their mean, reaches the loss of AdamW with an all-reduce of the gradients for far fewer bytes."""

from __future__ import annotations

import statistics
from pathlib import Path

from experiments.reproduce import Configuration, Finding
from experiments.reproductions._text import INNER, WORDS, WORKLOAD, curves, mb_to_reach
from experiments.reproductions._verdicts import overall

PAPER = "Peng, Quesnelle & Kingma 2024, DeMo: Decoupled Momentum Optimization"
CLAIM = (
    "DeMo, which keeps each accelerator's momentum local and all-gathers only its fast components (the top-k DCT "
    "coefficients of each chunk), trains to a loss comparable to AdamW with all-reduce while communicating up to "
    "85x fewer bytes."
)
SWEEPS = {
    # DeMo's sign step at AdamW's lr, no weight decay (the reference's settings: decay 0.999, topk 32, chunk 64)
    "demo": [*WORKLOAD, "algorithm=demo", "optimizer.lr=0.003"],
    "adamw": [*WORKLOAD, *INNER, "algorithm=allreduce"],
}
RUNS = {"demo": 1, "adamw": 1}
COMPARABLE = 0.05  # "comparable": a final perplexity within 5% of AdamW's


def analyze(configs: dict[str, list[Configuration]], out: Path) -> Finding:
    (demo,) = configs["demo"]
    (adamw,) = configs["adamw"]
    steps, peers, seeds = int(adamw.summary["steps"]), int(adamw.summary["peers"]), int(adamw.summary["seeds"])
    # the highest perplexity any run ends at: every seed of both reaches it, at its last record at the latest
    target = max(r["summary"]["test_perplexity"] for c in (demo, adamw) for r in c.runs)
    reached = {name: mb_to_reach(c, target * 1.0000001) for name, c in (("demo", demo), ("adamw", adamw))}

    def mean_mb(name: str) -> float | None:
        values = reached[name]
        return None if any(v is None for v in values) else statistics.mean(v for v in values if v is not None)

    demo_mb, adamw_mb = mean_mb("demo"), mean_mb("adamw")
    ratio = adamw.mean("mb_sent_per_peer") / demo.mean("mb_sent_per_peer")
    to_target = adamw_mb / demo_mb if demo_mb and adamw_mb else None
    gap = (demo.mean("test_perplexity") - adamw.mean("test_perplexity")) / adamw.mean("test_perplexity")
    table = "\n".join(
        [
            "| | paper (paraphrased) | ours |",
            "|---|---|---|",
            "| loss | comparable to AdamW with all-reduce (OLMo 300M and 1B) | "
            f"DeMo {demo.text('test_perplexity', 3)}, AdamW {adamw.text('test_perplexity', 3)} test perplexity "
            f"({gap:+.1%}) |",
            f"| bytes | up to 85x fewer than AdamW's all-reduce | {ratio:.1f}x fewer over the whole run; to the "
            f"perplexity both reach ({target:.3f}): "
            + (f"{to_target:.1f}x fewer" if to_target else "not reached by every seed")
            + " |",
            "",
            f"Ours: {peers} peers on {WORDS}, {steps} steps, {seeds} seeds. DeMo: its sign step "
            "(lr 0.003), local momentum decay 0.999, top 32 DCT coefficients of each 64-chunk (tiles of up to "
            "64 x 64), a kept coefficient sent as its position and 32-bit value (all-gather). AdamW: lr 0.003, "
            "weight decay 0.1, gradients all-reduced every step.",
            "",
            f"| method | test perplexity | MB sent per peer | MB to reach perplexity {target:.3f} (per seed) |",
            "|---|---|---|---|",
            *(
                f"| {name} | {c.text('test_perplexity', 3)} | {c.mean('mb_sent_per_peer'):.2f} | "
                + ", ".join("never" if v is None else f"{v:.2f}" for v in reached[key])
                + " |"
                for name, key, c in (("DeMo", "demo", demo), ("AdamW, all-reduce", "adamw", adamw))
            ),
        ]
    )
    parts = [abs(gap) <= COMPARABLE or gap < 0, to_target is not None and to_target >= 10]
    verdict = (
        {True: "holds", False: "does not hold", None: "partly holds"}[overall(parts)]
        + f": DeMo ends at test perplexity {demo.mean('test_perplexity'):.3f} against AdamW's "
        + f"{adamw.mean('test_perplexity'):.3f} ({gap:+.1%}; comparable means within {COMPARABLE:.0%} or better), "
        + f"sending {ratio:.1f}x fewer bytes over the run"
        + (
            f" and {to_target:.1f}x fewer to reach perplexity {target:.3f}"
            if to_target
            else f"; perplexity {target:.3f} was not reached by every seed"
        )
        + " (an order of magnitude or more is what 'far fewer' is taken to mean; the paper's 85x is for its "
        "models' tensor shapes and topk)."
    )
    title = f"{peers} peers, shakespeare, {seeds} seeds, 95% bands"

    def label(c: Configuration) -> str:
        return "DeMo" if c.runs[0]["config"]["algorithm.name"] == "demo" else "AdamW, all-reduce"

    by_steps, by_bytes = curves([demo, adamw], ("test_perplexity", "test perplexity"), out, title, label)
    plots = [by_bytes, by_steps]
    return Finding(table, verdict, overall(parts), plots)
