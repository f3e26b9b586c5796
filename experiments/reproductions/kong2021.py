"""Kong et al. 2021: decentralized training keeps all-reduce's accuracy while the consensus distance stays below a
critical value, and loses accuracy once it goes above."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from experiments import captions
from experiments.intervals import mean_interval
from experiments.plots import Page
from experiments.report import swept_keys
from experiments.reproduce import Configuration, Finding

PAPER = "Kong et al. 2021, Consensus Control for Decentralized Deep Learning"
CLAIM = (
    "The consensus distance (how far the peers' models lie from their average) decides what decentralized "
    "training loses: below a critical value the test accuracy matches centralized training, above it the "
    "accuracy degrades, so controlling that distance (more gossip or a denser graph where needed) recovers it."
)
# The ring's self weight slows its mixing at the same messages (spectral gap (1 - w)(1 - cos(2 pi / n))).
SELF_WEIGHTS = ("null", "0.9", "0.97", "0.99", "0.999")
SWEEPS = {
    "allreduce": ["experiment=kong2021", "backend=fleet", "algorithm=allreduce"],
    "graphs": ["experiment=kong2021", "backend=fleet", "algorithm=dpsgd", "topology=complete,exponential,torus"],
    "ring": [
        "experiment=kong2021",
        "backend=fleet",
        "algorithm=dpsgd",
        "topology=ring",
        f"topology.self_weight={','.join(SELF_WEIGHTS)}",
    ],
}
RUNS = {"allreduce": 1, "graphs": 3, "ring": len(SELF_WEIGHTS)}
NOISE_FLOOR = 0.005  # the smallest accuracy difference read as a fall, whatever the intervals say


def mean_distance(config: Configuration) -> float:
    """The consensus distance (1/n) sum_i ||x_i - x_bar||^2 averaged over a run's records, then over its seeds."""
    return float(np.mean([np.mean([m["consensus_distance"] for m in r["metrics"]]) for r in config.runs]))


def state(reference: tuple[float, float], point: tuple[float, float], floor: float = NOISE_FLOOR) -> str:
    """A setting's accuracy (mean, 95% half width) against the reference's: "fell" (below it by more than both
    intervals together, at least `floor`), "kept" (its mean inside the reference's interval, widened to `floor`) or
    "unclear" (lower, but within the intervals)."""
    drop = reference[0] - point[0]
    if drop > max(reference[1] + point[1], floor):
        return "fell"
    return "kept" if drop <= max(reference[1], floor) else "unclear"


def critical_distance(points: list[tuple[float, str]]) -> tuple[float | None, float | None, bool]:
    """From (mean consensus distance, state) per setting: the largest distance below the first fall, the smallest
    distance that fell (None if nothing fell), and whether the split is clean (no setting above the first fall
    kept the accuracy)."""
    ordered = sorted(points)
    first_fall = next((d for d, s in ordered if s == "fell"), None)
    below = [d for d, _ in ordered if first_fall is None or d < first_fall]
    last_hold = below[-1] if below else None
    clean = first_fall is None or all(s != "kept" for d, s in ordered if d > first_fall)
    return last_hold, first_fall, clean


def verdict(last_hold: float | None, first_fall: float | None, clean: bool, largest: float) -> tuple[bool | None, str]:
    """holds: the settings split at one distance, none below it losing accuracy and none above it keeping it."""
    if first_fall is None:
        return False, (
            "does not hold at this scale: no setting lost accuracy beyond the seeds' intervals, up to a mean "
            f"consensus distance of {largest:.3g}; no critical value exists in the range measured"
        )
    if not clean:
        return False, (
            f"does not hold: accuracy falls at a distance of {first_fall:.3g} but a setting with a larger distance "
            "keeps it, so the losses do not order by consensus distance"
        )
    if last_hold is None:
        return None, (
            f"partly holds: every setting lost accuracy, the smallest distance ({first_fall:.3g}) included, so a "
            "critical value, if any, lies below the range measured"
        )
    return True, (
        "holds: the accuracy stays within the intervals below a critical consensus distance between "
        f"{last_hold:.3g} (the largest below the first fall) and {first_fall:.3g} (the smallest that lost it)"
    )


def _name(config: Configuration) -> str:
    if "topology.self_weight" not in config.setting:
        return config.setting["topology"]
    weight = config.setting["topology.self_weight"]
    return f"ring, W[i,i]={'1/3' if weight == 'null' else weight}"


def analyze(configs: dict[str, list[Configuration]], out: Path) -> Finding:
    reference = configs["allreduce"][0]
    gossip = sorted(configs["graphs"] + configs["ring"], key=mean_distance)
    distances = [mean_distance(c) for c in gossip]
    states, texts, holds = {}, {}, None
    for key in ("test_accuracy", "peer_test_accuracy_mean"):
        ref = (reference.mean(key), reference.ci(key))
        states[key] = [state(ref, (c.mean(key), c.ci(key))) for c in gossip]
        found = verdict(*critical_distance(list(zip(distances, states[key]))), distances[-1])
        texts[key] = found[1]
        if key == "test_accuracy":
            holds = found[0]
    text = (
        f"for the averaged model's accuracy, {texts['test_accuracy']}. For the peers' own "
        f"models, {texts['peer_test_accuracy_mean']}."
    )
    table = [
        "Paper (paraphrased, ResNet-20 on CIFAR-10 and others, rings of 16-64): as long as the consensus distance "
        "stays below a critical value (tied to the gradients' size), decentralized training reaches the "
        "centralized accuracy; above it, accuracy falls, most in the early phase of training.\n",
        f"Ours ({reference.summary['peers']} peers, iid digits, MLP, {int(reference.summary['steps'])} steps, "
        "D-PSGD with lr 0.1 and "
        f"momentum 0.9; mean ± 95% interval over {int(reference.summary['seeds'])} seeds; against all-reduce: "
        "fell = below by more than both intervals, kept = inside all-reduce's interval):\n",
        "| graph | mean consensus distance | test accuracy (averaged model) | | peers' own accuracy | |",
        "|---|---|---|---|---|---|",
        f"| all-reduce | 0 | {reference.text('test_accuracy')} | | {reference.text('peer_test_accuracy_mean')} | |",
    ]
    table += [
        f"| {_name(c)} | {d:.3g} | {c.text('test_accuracy')} | {avg} | {c.text('peer_test_accuracy_mean')} | {own} |"
        for c, d, avg, own in zip(gossip, distances, states["test_accuracy"], states["peer_test_accuracy_mean"])
    ]
    return Finding("\n".join(table), text, holds=holds, plots=[_plot(reference, gossip, distances, out)])


def _plot(reference: Configuration, gossip: list[Configuration], distances: list[float], out: Path) -> Path:
    configs = [reference, *gossip]
    runs = [r for c in configs for r in c.runs]
    seeds = [len(c.runs) for c in configs]
    caption = captions.figure_caption(runs, swept_keys(runs), seeds, None, "cut at 0 and 1", marks=("point", "bar"))
    title = f"D-PSGD at {reference.summary['peers']} peers: final accuracy against the run's consensus distance"
    page = Page(2, title, caption, len(configs))
    for ax, (key, label) in zip(
        page.axes,
        [("test_accuracy", "test accuracy (averaged model)"), ("peer_test_accuracy_mean", "peers' own accuracy")],
    ):
        ref_mean, ref_ci = mean_interval([r["summary"][key] for r in reference.runs])
        ax.axhline(ref_mean, color="black", label="all-reduce (distance 0)")
        if ref_ci == ref_ci:  # nan with one seed
            ax.axhspan(max(ref_mean - ref_ci, 0), min(ref_mean + ref_ci, 1), color="black", alpha=0.12, linewidth=0)
        for config, distance in zip(gossip, distances):
            mean, ci = config.mean(key), config.ci(key)
            yerr = [[min(ci, mean)], [min(ci, 1 - mean)]]  # an accuracy's interval, cut at 0 and 1
            ax.errorbar(distance, mean, yerr=yerr, marker="o", capsize=3, label=_name(config))
        ax.set_xscale("log")
        ax.set_xlabel("mean consensus distance (1/n) sum ||x_i - x_bar||^2")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    return page.save(out / "accuracy_vs_consensus.png")
