"""Lian et al. 2018: AD-PSGD keeps its throughput with a slow peer, while all-reduce falls to the slow peer's pace."""

from __future__ import annotations

from pathlib import Path

from experiments import captions
from experiments.plots import Page
from experiments.report import swept_keys
from experiments.reproduce import Configuration, Finding, find
from experiments.targets import ADPSGD_TARGET, ALLREDUCE_PACE_RANGE, slow_peer_pace

PAPER = "Lian et al. 2018, Asynchronous Decentralized Parallel Stochastic Gradient Descent (AD-PSGD)"
CLAIM = (
    "In AD-PSGD no peer waits for a global step, so one slow worker slows only itself: the system keeps nearly all "
    "its throughput, while all-reduce training runs every step at the slowest worker's speed."
)
# 4 real mpi peers, not the preset's 8: on 2 cores, 8 processes (each with its AD-PSGD communication thread)
# contend for the CPU beyond the 20 ms compute floor, and contention, not compute, would set the pace.
PEERS = 4
SWEEPS = {"main": ["experiment=adpsgd_stragglers", "backend=mpi", f"peers={PEERS}"]}
RUNS = {"main": 4}


def ideal_ratio(algorithm: str, peers: int, scale: float) -> float:
    """Throughput with one peer `scale` x slower, of the throughput without, when compute sets the pace: all-reduce
    waits for the slow peer every step (1/scale); AD-PSGD's peers go on at their own speeds ((n - 1 + 1/scale) / n)."""
    return 1 / scale if algorithm == "allreduce" else (peers - 1 + 1 / scale) / peers


def analyze(configs: dict[str, list[Configuration]], out: Path) -> Finding:
    runs = configs["main"]
    cells = {
        (a, n): find(runs, algorithm=a, network=n) for a in ("allreduce", "adpsgd") for n in ("loopback", "straggler")
    }
    config = cells[("allreduce", "straggler")].runs[0]["config"]
    peers, batch = int(config["peers"]), int(config["batch_size"])
    scale, floor = float(config["network.compute_scale"]), float(config["network.compute_time"])
    pace = slow_peer_pace(peers, batch, scale, floor)
    slow_peers = str(config["network.slow_peers"]).strip("[]")
    seeds = int(cells[("adpsgd", "loopback")].summary["seeds"])

    def ratio(algorithm: str) -> float:
        return cells[(algorithm, "straggler")].mean("samples_per_s") / cells[(algorithm, "loopback")].mean(
            "samples_per_s"
        )

    def row(algorithm: str, name: str) -> str:
        even, slow = cells[(algorithm, "loopback")], cells[(algorithm, "straggler")]
        return (
            f"| {name} | {even.text('samples_per_s', 0)} | {slow.text('samples_per_s', 0)} | {ratio(algorithm):.3f} | "
            f"{ideal_ratio(algorithm, peers, scale):.3f} | {slow.mean('samples_per_s') / pace:.2f} | "
            f"{even.text('test_accuracy', 3)} | {slow.text('test_accuracy', 3)} |"
        )

    table = "\n".join(
        [
            "| | paper (paraphrased) |",
            "|---|---|",
            "| with one slow worker | AD-PSGD's speed barely changes, since the other workers never wait for it; "
            "synchronous training (all-reduce) slows to the slow worker's speed |",
            "",
            f"Ours: {peers} mpi peers on digits (MLP), a {floor * 1000:.0f} ms per-step compute floor, peer "
            f"{slow_peers} {scale:g}x slower, the same total samples; {seeds} seeds. Ideal ratio: "
            f"all-reduce 1/{scale:g}, AD-PSGD (n - 1 + 1/{scale:g}) / n. Slow peer's pace: {peers} x {batch} / "
            f"({scale:g} x {floor:g} s) = {pace:.0f} samples/s.",
            "",
            "| algorithm | samples/s, no straggler | samples/s, one straggler | ratio | ideal ratio | "
            "straggler run, of the slow pace | accuracy, no straggler | accuracy, straggler |",
            "|---|---|---|---|---|---|---|---|",
            row("adpsgd", "AD-PSGD"),
            row("allreduce", "all-reduce"),
        ]
    )
    adpsgd_keeps = ratio("adpsgd") >= ADPSGD_TARGET
    of_pace = cells[("allreduce", "straggler")].mean("samples_per_s") / pace
    allreduce_drops = ALLREDUCE_PACE_RANGE[0] <= of_pace <= ALLREDUCE_PACE_RANGE[1]
    holds = adpsgd_keeps and allreduce_drops
    even_step = peers * batch / cells[("allreduce", "loopback")].mean("samples_per_s")  # seconds
    verdict = (
        ("holds" if holds else "partly holds" if adpsgd_keeps or allreduce_drops else "does not hold")
        + f": with one peer {scale:g}x slower AD-PSGD keeps {ratio('adpsgd'):.3f} of its throughput "
        + f"({'at least' if adpsgd_keeps else 'below'} the {ADPSGD_TARGET} asked; ideal "
        + f"{ideal_ratio('adpsgd', peers, scale):.3f}); all-reduce keeps {ratio('allreduce'):.3f} (ideal "
        + f"{ideal_ratio('allreduce', peers, scale):.3f}) and runs at {of_pace:.2f} of the slow peer's pace "
        + f"({'within' if allreduce_drops else 'outside'} {ALLREDUCE_PACE_RANGE[0]}-{ALLREDUCE_PACE_RANGE[1]}). "
        + f"Without the straggler all-reduce's step took {even_step * 1000:.0f} ms against the {floor * 1000:.0f} ms "
        + f"floor (compute, the all-reduce, {peers} processes sharing the cores), so its ratio lies above 1/{scale:g}."
    )
    plot = _bars(cells, pace, pace * scale, out / "throughput.png", peers, scale)
    return Finding(table, verdict, True if holds else (None if adpsgd_keeps or allreduce_drops else False), [plot])


def _bars(cells: dict, pace: float, floor_pace: float, path: Path, peers: int, scale: float) -> Path:
    """Samples/s per algorithm without and with the straggler (mean and 95% interval, cut at 0); as lines, the pace
    of the compute floor and the slow peer's."""
    runs = [r for c in cells.values() for r in c.runs]
    seeds = [len(c.runs) for c in cells.values()]
    caption = captions.figure_caption(
        runs,
        swept_keys(runs),
        seeds,
        " ".join(captions.clocks(runs, {"wall_time_s"})),
        "cut at 0",
        marks=("bar", "error bar"),
    )
    page = Page(1, f"Throughput, {peers} mpi peers, mean and 95% interval over seeds", caption, 4)
    (ax,) = page.axes
    for i, (network, name) in enumerate((("loopback", "no straggler"), ("straggler", f"one peer {scale:g}x slower"))):
        algorithms = ("adpsgd", "allreduce")
        means = [cells[(a, network)].mean("samples_per_s") for a in algorithms]
        cis = [cells[(a, network)].ci("samples_per_s") for a in algorithms]
        ax.bar(
            [a + 0.38 * i for a in range(len(algorithms))],
            means,
            0.36,
            yerr=[[min(c, m) for c, m in zip(cis, means)], cis],
            capsize=4,
            label=name,
        )
    ax.axhline(floor_pace, color="k", linestyle=":", linewidth=1, label="the compute floor's pace")
    ax.axhline(pace, color="k", linestyle="--", linewidth=1, label="slow peer's pace")
    ax.set_xticks([0.19, 1.19], ["AD-PSGD", "all-reduce"])
    ax.set_ylabel("samples/s (all peers together)")
    ax.grid(axis="y", alpha=0.3)
    return page.save(path)
