"""Douillard et al. 2023 (DiLoCo) rerun on a real language: the H sweep of douillard2023 on data=shakespeare.

Its DiLoCo runs are sparseloco2025's (the same sweep: H = 15, 30, 50 on the same workload and seeds), read from
that reproduction's folder beside this one's (and run there first if it is not complete)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from experiments.report import load_runs
from experiments.reproduce import (
    Configuration,
    Finding,
    _children_cpu_s,
    configurations,
    fleet_threads,
)
from experiments.reproductions import sparseloco2025
from experiments.reproductions._text import INNER, WORDS, WORKLOAD, curves
from experiments.reproductions._verdicts import compare, overall
from experiments.reproductions.douillard2023 import bytes_fall_as_1_over_h, near_synchronous
from experiments.sweeps import finished, run_sweep

PAPER = "Douillard et al. 2023, DiLoCo (rerun on text: next-character prediction on Shakespeare)"
CLAIM = (
    "Workers that take H inner AdamW steps alone and then one outer Nesterov step on the averaged change reach about "
    "the loss of fully synchronous data-parallel training, while they communicate H times less; plain model "
    "averaging in the outer step does worse."
)
PERIODS = sparseloco2025.PERIODS
SWEEPS = {
    "synchronous": [*WORKLOAD, *INNER, "algorithm=allreduce"],
    "averaging": [*WORKLOAD, *INNER, "algorithm=local_sgd", f"++algorithm.period={PERIODS[-1]}"],
}
RUNS = {"synchronous": 1, "averaging": 1}


def shared_diloco(out: Path, seeds: int) -> list[Configuration]:
    """sparseloco2025's DiLoCo sweep (OUT/../sparseloco2025/diloco), run there first if it is not complete."""
    folder = out.parent / "sparseloco2025" / "diloco"
    if not finished(folder, len(PERIODS) * seeds):
        overrides = sparseloco2025.SWEEPS["diloco"]
        print(f"douillard2023_text: sparseloco2025's sweep 'diloco' ({len(PERIODS) * seeds} runs) ...", flush=True)
        started, load, cpu = time.perf_counter(), os.getloadavg()[0], _children_cpu_s()
        run_sweep([*overrides, *fleet_threads(overrides), f"seed=range({seeds})"], folder)
        timing = {
            "seconds": time.perf_counter() - started,
            "cpu_seconds": _children_cpu_s() - cpu,
            "load_average": [load, os.getloadavg()[0]],
        }
        folder.with_suffix(".timing.json").write_text(json.dumps(timing) + "\n")
    return configurations(load_runs(folder))


def period(c: Configuration) -> int:
    return int(c.runs[0]["config"]["algorithm.period"])


def analyze(configs: dict[str, list[Configuration]], out: Path) -> Finding:
    (sync,) = configs["synchronous"]
    diloco = sorted(configs.get("diloco") or shared_diloco(out, int(sync.summary["seeds"])), key=period)
    (averaging,) = configs["averaging"]
    steps, peers, seeds = int(sync.summary["steps"]), int(sync.summary["peers"]), int(sync.summary["seeds"])
    periods, mb = [period(c) for c in diloco], [c.mean("mb_sent_per_peer") for c in diloco]
    near = [
        near_synchronous(c.mean("test_loss"), c.ci("test_loss"), sync.mean("test_loss"), sync.ci("test_loss"))
        for c in diloco
    ]
    bytes_ok = bytes_fall_as_1_over_h(periods, mb)
    outer_helps = compare(averaging, diloco[-1], "test_loss") > 0  # averaging's loss wholly above DiLoCo's
    gap = lambda c: (c.mean("test_loss") - sync.mean("test_loss")) / sync.mean("test_loss")  # noqa: E731
    table = "\n".join(
        [
            "| | paper (paraphrased) | ours |",
            "|---|---|---|",
            "| loss as H grows | about synchronous training's up to H = 500, worsening slowly | "
            + "; ".join(f"H = {h}: {gap(c):+.1%}" for h, c in zip(periods, diloco))
            + " test loss against synchronous |",
            "| communication | H times less | "
            + ", ".join(f"{m / mb[0]:.4f} (H_min / H = {periods[0] / h:.4f})" for h, m in zip(periods, mb))
            + " |",
            "| plain averaging | worse than the outer Nesterov step | "
            f"{averaging.mean('test_loss'):.4f} against DiLoCo's {diloco[-1].mean('test_loss'):.4f} at H = "
            f"{periods[-1]} |",
            "",
            f"Ours: {peers} peers on {WORDS}, {steps} steps, inner AdamW for all, {seeds} seeds.",
            "",
            "| method | test loss (vs synchronous) | test perplexity | MB sent per peer |",
            "|---|---|---|---|",
            f"| synchronous (all-reduce every step) | {sync.text('test_loss')} | {sync.text('test_perplexity', 3)} | "
            f"{sync.mean('mb_sent_per_peer'):.2f} |",
            *(
                f"| DiLoCo H = {h} | {c.text('test_loss')} ({gap(c):+.1%}) | {c.text('test_perplexity', 3)} | "
                f"{c.mean('mb_sent_per_peer'):.3f} |"
                for h, c in zip(periods, diloco)
            ),
            f"| plain averaging H = {period(averaging)} | {averaging.text('test_loss')} ({gap(averaging):+.1%}) | "
            f"{averaging.text('test_perplexity', 3)} | {averaging.mean('mb_sent_per_peer'):.3f} |",
        ]
    )
    parts = [all(near), bytes_ok, outer_helps]
    far = [h for h, ok in zip(periods, near) if not ok]
    verdict = (
        {True: "holds", False: "does not hold", None: "partly holds"}[overall(parts)]
        + ": DiLoCo's test loss is "
        + ("near synchronous training's at every H" if not far else f"more than 5% above it at H = {far}")
        + " ("
        + ", ".join(f"H = {h}: {gap(c):+.1%}" for h, c in zip(periods, diloco))
        + f"); the bytes {'fall' if bytes_ok else 'do not fall'} as 1/H; plain averaging at H = {periods[-1]} ends "
        + f"at {averaging.mean('test_loss'):.4f} against DiLoCo's {diloco[-1].mean('test_loss'):.4f} "
        + ("(worse beyond the intervals)." if outer_helps else "(not worse beyond the intervals).")
    )

    def label(c: Configuration) -> str:
        name = c.runs[0]["config"]["algorithm.name"]
        if name == "allreduce":
            return "synchronous"
        return f"{'DiLoCo' if name == 'diloco' else 'averaging'}, H = {period(c)}"

    every = [sync, *diloco, averaging]
    title = f"{peers} peers, shakespeare, {seeds} seeds, 95% bands"
    plots = list(curves(every, ("test_loss", "test loss (averaged model)"), out, title, label))
    return Finding(table, verdict, overall(parts), plots)
