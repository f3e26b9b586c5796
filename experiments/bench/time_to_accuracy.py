"""Emulated time to a target accuracy: `python -m experiments.bench time_to_accuracy [--peers 8]`.

Runs the Hydra app on real mpi processes, side by side in one invocation: each algorithm (AllReduce,
D-PSGD on a ring and on the one-peer exponential graph, LocalSGD with H=4, AD-PSGD) trains the default
MLP on digits under two networks: `ethernet_1g` (model mode: latency and bandwidth on the emulated clock,
each step's compute fixed at the time measured for this model on one core in this run) and `straggler`
(sleep mode: peer 1 computes 4x slower, for real, with a per-step compute floor). The figure is the
emulated time at the first logged record whose averaged model reaches the target test accuracy (for
AD-PSGD, whose peers log no common step, rank 0's own model), and its ratio to AllReduce's under the
same network. Beside it: the bytes each peer sent up to then, over this machine's loopback bandwidth.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from experiments.bench import cli, harness, steps

ALGORITHMS = (  # label, overrides
    ("allreduce", ["algorithm=allreduce"]),
    ("dpsgd ring", ["algorithm=dpsgd", "topology=ring"]),
    ("dpsgd one-peer", ["algorithm=dpsgd", "topology=one_peer_exponential"]),
    ("local_sgd H=4", ["algorithm=local_sgd", "algorithm.period=4"]),
    ("adpsgd", ["algorithm=adpsgd", "topology=ring"]),
)


def digits_compute_time() -> float:
    """Median seconds of one step of the default model (MLP on digits, batch 32) on one core."""
    import torch

    torch.set_num_threads(1)
    x, y = torch.randn(32, 64), torch.randint(0, steps.CLASSES, (32,))
    return steps.step_time(steps.mlp(64, [64]), x, y, repeats=50)


def to_target(label: str, overrides: list[str], network: list[str], args, work: Path) -> dict:
    """One run of the app: when (emulated time, steps, MB each peer sent) its averaged model first reached
    `args.target`, from its logged records."""
    net = network[0].split("=")[1]
    run_dir = work / f"{label.replace(' ', '_').replace('=', '')}_{net}"
    given = [*overrides, *network, f"peers={args.peers}", f"epochs={args.epochs}", f"log_every={args.log_every}"]
    summary, records = harness.run_app([*given, f"seed={args.seed}"], run_dir, args.timeout)
    hit = next((r for r in records if r.get("test_accuracy") is not None and r["test_accuracy"] >= args.target), None)
    clock = "emulated_time_s" if records[-1].get("emulated_time_s") is not None else "wall_time_s"
    return {
        "algorithm": label,
        "network": net,
        "time_to_target_s": hit[clock] if hit else None,
        "steps_to_target": hit["step"] if hit else None,
        "final_accuracy": summary["test_accuracy"],
        "final_time_s": records[-1][clock],
        "mb_sent_per_peer": summary["mb_sent_per_peer"],
        "mb_to_target": hit["mb_sent_per_peer"] if hit else None,
        "overrides": given,
    }


def ratio(a, b):
    return a / b if a is not None and b else None


def options(p) -> None:
    p.add_argument("--target", type=float, default=0.93, help="test accuracy to reach")
    p.add_argument("--log-every", type=int, default=4)
    p.add_argument("--straggler-compute-time", type=float, default=0.01, help="per-step floor under `straggler`")


def run(args) -> harness.Result:
    compute = digits_compute_time()
    networks = {
        "ethernet_1g": ["network=ethernet_1g", f"network.compute_time={compute:.6g}"],
        "straggler": ["network=straggler", f"network.compute_time={args.straggler_compute_time}"],
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for net in networks.values():
            for label, overrides in ALGORITHMS:
                rows.append(to_target(label, overrides, net, args, Path(tmp)))
                print(f"  {label:16s} {net[0]:22s} done", flush=True)
    targets = []
    for net in networks:
        base = next(r for r in rows if r["network"] == net and r["algorithm"] == "allreduce")
        for r in rows:
            if r["network"] == net:
                r["vs_allreduce"] = ratio(r["time_to_target_s"], base["time_to_target_s"])
        best = min(
            (
                r
                for r in rows
                if r["network"] == net and r["vs_allreduce"] is not None and r["algorithm"] != "allreduce"
            ),
            key=lambda r: r["vs_allreduce"],
            default=None,
        )
        if best is not None:
            name = f"fastest to {args.target} vs AllReduce under {net}: {best['algorithm']}"
            targets.append(harness.Target(name, best["vs_allreduce"], 1.0))
    print(
        f"target test accuracy {args.target}; {args.peers} mpi peers; compute per step under ethernet_1g: "
        f"{compute * 1e3:.3f} ms (measured on one core)"
    )
    cols = ["network", "algorithm", "time_to_target_s", "vs_allreduce", "steps_to_target", "final_accuracy"]
    harness.print_columns(rows, [*cols, "final_time_s", "mb_sent_per_peer"])
    return harness.Result({"compute_s": compute, "target_accuracy": args.target, "rows": rows}, targets)


main = cli.entry("time_to_accuracy")

if __name__ == "__main__":
    raise SystemExit(main())
