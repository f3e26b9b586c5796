"""Lin et al. 2021: on a ring under heterogeneous data, D-PSGD with momentum falls behind all-reduce and
quasi-global momentum (QGM) recovers much of the loss."""

from __future__ import annotations

from pathlib import Path

from experiments.reproduce import Configuration, Finding, find, plot_curves
from experiments.reproductions._fashion import FASHION

PAPER = "Lin et al. 2021, Quasi-Global Momentum: Accelerating Decentralized Deep Learning on Heterogeneous Data"
CLAIM = (
    "On a ring of 16 peers, as the Dirichlet concentration of the data partition falls from 10 to 1 to 0.1, "
    "decentralized SGD with local heavy-ball momentum loses far more test accuracy than all-reduce, and "
    "replacing its momentum buffer with the quasi-global one (QG-DSGDm) recovers a large part of that loss "
    "without extra communication."
)
# D-PSGD in the paper's order (mix after the local step), like QGM: the two differ only in the momentum buffer.
SWEEPS = {
    "allreduce": ["experiment=lin2021", "backend=fleet", "algorithm=allreduce"],
    "gossip": ["experiment=lin2021", "backend=fleet", "algorithm=dpsgd,qgm", "algorithm.order=atc"],
}
# The same on a harder, real task (Fashion-MNIST with the CNN, 2 epochs: 936 steps), alpha 10 and 0.1 only: digits
# saturates near 0.97. (Until 2026-12-06 the harder task was the 5,000-image MNIST subset, 10 epochs.)
HARDER = ["experiment=lin2021", "backend=fleet", *FASHION, "epochs=2", "log_every=468", "data.alpha=10,0.1"]
SWEEPS["fashion_allreduce"] = [*HARDER, "algorithm=allreduce"]
SWEEPS["fashion_gossip"] = [*HARDER, "algorithm=dpsgd,qgm", "algorithm.order=atc"]
RUNS = {"allreduce": 3, "gossip": 6, "fashion_allreduce": 2, "fashion_gossip": 4}
ALPHAS = ("10", "1", "0.1")  # as Hydra records the overrides
NAMES = {"allreduce": "all-reduce", "dpsgd": "D-PSGD (heavy-ball)", "qgm": "QGM"}


def recovered_fraction(drop_allreduce: float, drop_dpsgd: float, drop_qgm: float) -> float:
    """The part of D-PSGD's extra accuracy drop (beyond all-reduce's) that QGM does not suffer: 1 = all of it,
    0 = none, negative = QGM lost more than D-PSGD. nan when D-PSGD has no extra drop to recover."""
    extra = drop_dpsgd - drop_allreduce
    if extra <= 0:
        return float("nan")
    return (drop_dpsgd - drop_qgm) / extra


def verdict(drops: dict[str, tuple[float, float]], noise_floor: float = 0.005) -> tuple[bool | None, str]:
    """holds / partly holds / does not hold from each algorithm's drop (alpha 10 -> 0.1) as (mean, 95% half width
    of the difference). D-PSGD must lose more than all-reduce beyond the intervals; QGM must recover at least half
    of D-PSGD's extra drop ("a large part") for the whole claim to hold."""
    (d_ar, ci_ar), (d_dp, ci_dp), (d_qg, _) = drops["allreduce"], drops["dpsgd"], drops["qgm"]
    margin = max(ci_ar + ci_dp, noise_floor)
    gap_shows = d_dp - d_ar > margin
    fraction = recovered_fraction(d_ar, d_dp, d_qg)
    summary = (
        f"accuracy drop from alpha 10 to 0.1: all-reduce {d_ar:+.4f}, D-PSGD {d_dp:+.4f}, QGM {d_qg:+.4f}; "
        f"D-PSGD's extra drop {d_dp - d_ar:+.4f} against the intervals' {margin:.4f}"
    )
    if not gap_shows:
        return False, (
            f"does not hold: D-PSGD's extra drop is within the seeds' noise ({summary}), so there is no loss for QGM "
            "to recover at this scale"
        )
    recovered = f"QGM recovers {fraction:.0%} of it"
    if fraction >= 0.5:
        return True, f"holds: {summary}; {recovered}"
    return None, f"partly holds: D-PSGD loses more than all-reduce ({summary}), but {recovered} (less than half)"


def _drop(high: Configuration, low: Configuration, key: str) -> tuple[float, float]:
    """Mean accuracy at alpha 10 minus at alpha 0.1, with the half width of the difference of two independent means
    (the two half widths added: conservative)."""
    return high.mean(key) - low.mean(key), high.ci(key) + low.ci(key)


def _task(allreduce: list[Configuration], gossip: list[Configuration], alphas: tuple[str, ...], task: str, out: Path):
    """One workload's table rows, verdict and plot."""

    def cell(algorithm: str, alpha: str) -> Configuration:
        if algorithm == "allreduce":
            return find(allreduce, data__alpha=alpha)
        return find(gossip, algorithm=algorithm, data__alpha=alpha)

    example = cell("dpsgd", alphas[0])
    rows = [
        f"{task}, {int(example.summary['steps'])} steps, mean ± 95% interval over {int(example.summary['seeds'])} "
        "seeds:\n",
        "| | " + " | ".join(f"alpha {a}" for a in alphas) + f" | drop {alphas[0]} -> {alphas[-1]} (averaged model) | "
        f"drop {alphas[0]} -> {alphas[-1]} (peers' own models) | consensus distance at {alphas[-1]} |",
        "|---|" + "---|" * (len(alphas) + 3),
    ]
    drops, peer_drops = {}, {}
    for algorithm in ("allreduce", "dpsgd", "qgm"):
        high, low = cell(algorithm, alphas[0]), cell(algorithm, alphas[-1])
        drops[algorithm] = _drop(high, low, "test_accuracy")
        peer_drops[algorithm] = _drop(high, low, "peer_test_accuracy_mean")
        rows.append(
            f"| {NAMES[algorithm]} | "
            + " | ".join(cell(algorithm, a).text("test_accuracy") for a in alphas)
            + f" | {drops[algorithm][0]:+.4f} ± {drops[algorithm][1]:.4f} | {peer_drops[algorithm][0]:+.4f} ± "
            f"{peer_drops[algorithm][1]:.4f} | {low.mean('consensus_distance'):.3g} |"
        )
    holds, text = verdict(drops)
    _, peer_text = verdict(peer_drops)
    plot = plot_curves(
        [c for c in allreduce + gossip if c.setting.get("data.alpha") in (alphas[0], alphas[-1])],
        "step",
        [
            ("test_accuracy", "test accuracy (averaged model)"),
            ("peer_test_accuracy_mean", "test accuracy (peers' own)"),
        ],
        out / f"alpha_{task.split(',')[0].replace(' ', '_')}.png",
        f"{task}: ring of 16, Dirichlet alpha {alphas[0]} and {alphas[-1]}, mean and 95% interval over seeds",
        label=lambda c: f"{NAMES[c.setting.get('algorithm', 'allreduce')]}, alpha {c.setting['data.alpha']}",
    )
    summary = f"{task}: the averaged model's accuracy {text}; the peers' own models' accuracy {peer_text}"
    return "\n".join(rows), holds, summary, plot


def analyze(configs: dict[str, list[Configuration]], out: Path) -> Finding:
    paper = (
        "Paper (paraphrased, ResNet-20 on CIFAR-10, ring of 16, tuned lr): all-reduce's accuracy barely moves as "
        "alpha falls, decentralized SGD with momentum loses several points at alpha 0.1, and QG-DSGDm closes much "
        "of that gap at the same communication.\n\n"
        "Ours: 16 peers on a ring, the MLP (64 hidden) on digits and the CNN on Fashion-MNIST, lr 0.1 and momentum 0.9 "
        "for all three, D-PSGD and QGM both "
        "mixing after the local step; test accuracy of the averaged model (drops also of the peers' own models).\n"
    )
    tasks = [
        _task(configs["allreduce"], configs["gossip"], ALPHAS, "digits, 30 epochs", out),
        _task(
            configs["fashion_allreduce"],
            configs["fashion_gossip"],
            (ALPHAS[0], ALPHAS[-1]),
            "Fashion-MNIST (CNN), 2 epochs",
            out,
        ),
    ]
    # the harder task decides: on digits every algorithm ends near 0.97, leaving little room for a gap
    holds = tasks[1][1]
    verdict_text = (
        f"{'holds' if holds else 'partly holds' if holds is None else 'does not hold'} on the harder task. "
        + " ".join(f"{t[2]}." for t in tasks)
    )
    return Finding(
        paper + "\n" + "\n\n".join(t[0] for t in tasks), verdict_text, holds=holds, plots=[t[3] for t in tasks]
    )
