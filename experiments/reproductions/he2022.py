"""He, Karimireddy and Jaggi 2022: with Byzantine peers on a graph, plain gossip breaks down and ClippedGossip
keeps the accuracy of the attack-free run."""

from __future__ import annotations

from pathlib import Path

from experiments.reproduce import Configuration, Finding, find, plot_curves
from experiments.reproductions._verdicts import overall

PAPER = "He, Karimireddy and Jaggi 2022, Byzantine-robust decentralized learning via ClippedGossip"
CLAIM = (
    "On an arbitrary communication graph with a few Byzantine workers, plain gossip averaging is broken by their "
    "attacks, while ClippedGossip (each worker clips the differences to its neighbours' values around its own, with "
    "an adaptive radius) keeps the regular workers' accuracy close to that of the run without attackers."
)
ATTACKS = ("sign", "scale", "alie")  # sign flipping, a large scaling, and "a little is enough" (Baruch et al.)
COMMON = ["backend=fleet", "peers=12", "topology=erdos_renyi", "on_divergence=mark"]
CORRUPT = ["faults.corrupt_peer=[2,7]", f"faults.corrupt_mode={','.join(ATTACKS)}"]
CLIPPED = ["robust=clipped_gossip", "robust.byzantine=2"]  # b = 2 corrupt peers: the two farthest values are clipped
SWEEPS = {
    "clean": [*COMMON, "robust=none"],
    "clean_clipped": [*COMMON, *CLIPPED],
    "plain": [*COMMON, "robust=none", *CORRUPT],
    "clipped": [*COMMON, *CLIPPED, *CORRUPT],
}
RUNS = {"clean": 1, "clean_clipped": 1, "plain": len(ATTACKS), "clipped": len(ATTACKS)}
COLLAPSE = 0.10  # plain gossip "fails" on an attack that costs it this much accuracy or more
MARGIN = 0.03  # ClippedGossip "keeps" the accuracy within this much of the attack-free run


def analyze(configs: dict[str, list[Configuration]], out: Path) -> Finding:
    clean, clean_clipped = configs["clean"][0], configs["clean_clipped"][0]
    base = clean.mean("test_accuracy")
    rows, fails, keeps = [], [], []
    for attack in ATTACKS:
        plain = find(configs["plain"], faults__corrupt_mode=attack)
        clipped = find(configs["clipped"], faults__corrupt_mode=attack)
        diverged = sum(r["summary"].get("status") == "diverged" for r in plain.runs)
        fails.append(plain.mean("test_accuracy") <= base - COLLAPSE)
        keeps.append(clipped.mean("test_accuracy") >= base - MARGIN)
        rows.append(
            f"| {attack} | {plain.text('test_accuracy')}"
            + (f" ({diverged} of {len(plain.runs)} seeds diverged)" if diverged else "")
            + f" | {clipped.text('test_accuracy')} | {clipped.mean('test_accuracy') - base:+.4f} |"
        )
    peers, steps = int(clean.summary["peers"]), int(clean.summary["steps"])
    table = "\n".join(
        [
            f"Attack-free: plain gossip {clean.text('test_accuracy')}, "
            f"ClippedGossip {clean_clipped.text('test_accuracy')} ({peers} peers, Erdos-Renyi graph, {steps} steps; "
            "peers 2 and 7 corrupt under attack).",
            "",
            "| attack | plain gossip | ClippedGossip | ClippedGossip - attack-free plain |",
            "|---|---|---|---|",
            *rows,
        ]
    )
    failed = [a for a, f in zip(ATTACKS, fails) if f]
    kept = [a for a, k in zip(ATTACKS, keeps) if k]
    cost = clean_clipped.mean("test_accuracy") - base
    holds = overall([bool(failed), len(kept) == len(ATTACKS)])
    verdict = (
        {True: "holds", None: "partly holds", False: "does not hold"}[holds]
        + f": plain gossip loses {COLLAPSE:.2f} or more of accuracy under {', '.join(failed) or 'no attack'}"
        + f" ({len(failed)} of {len(ATTACKS)} attacks), and ClippedGossip stays within {MARGIN:.2f} of the"
        + f" attack-free run under {', '.join(kept) or 'no attack'} ({len(kept)} of {len(ATTACKS)}); without"
        + f" attackers it costs {-cost:.4f} of accuracy against plain gossip."
    )
    plot = plot_curves(
        [clean, *configs["plain"], *configs["clipped"]],
        "step",
        [("test_accuracy", "test accuracy (averaged model)")],
        out / "vs_steps.png",
        f"Plain gossip and ClippedGossip under attack, {peers} peers, mean and 95% interval over seeds",
        x_label="step",
        label=_label,
    )
    return Finding(table, verdict, holds=holds, plots=[plot])


def _label(config: Configuration) -> str:
    cfg = config.runs[0]["config"]
    rule = "ClippedGossip" if cfg.get("robust.name") == "clipped_gossip" else "plain gossip"
    attack = cfg.get("faults.corrupt_mode") if cfg.get("faults.corrupt_peer") is not None else None
    return f"{rule}, {attack + ' attack' if attack else 'no attack'}"
