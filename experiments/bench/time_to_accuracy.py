"""Emulated time to a target accuracy: `python -m experiments.bench.time_to_accuracy [--peers 8]`.

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

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from dpsgd.backends.launch import peer_env
from experiments.bench.common import ROOT, Target, print_table, print_targets, write_result

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

    from dpsgd import models
    from experiments.bench.step_time_vs_network import measure_compute

    torch.set_num_threads(1)
    return measure_compute(
        models.build("mlp", (64,), 10, 0, hidden=[64]), torch.randn(32, 64), torch.randint(0, 10, (32,)), repeats=50
    )


def run(label: str, overrides: list[str], network: list[str], args, work: Path) -> dict:
    run_dir = work / f"{label.replace(' ', '_').replace('=', '')}_{network[0].split('=')[1]}"
    cmd = [
        sys.executable,
        "-m",
        "experiments.train",
        *overrides,
        *network,
        f"peers={args.peers}",
        f"epochs={args.epochs}",
        f"log_every={args.log_every}",
        f"seed={args.seed}",
        f"hydra.run.dir={run_dir}",
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=peer_env({"DPSGD_PROGRESS": "0"}), capture_output=True, text=True, timeout=args.timeout
    )
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd[3:])} failed:\n{proc.stderr[-2000:]}")
    records = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines() if r.strip()]
    summary = json.loads((run_dir / "summary.json").read_text())
    hit = next((r for r in records if r.get("test_accuracy") is not None and r["test_accuracy"] >= args.target), None)
    clock = "emulated_time_s" if records[-1].get("emulated_time_s") is not None else "wall_time_s"
    return {
        "algorithm": label,
        "network": network[0].split("=")[1],
        "time_to_target_s": hit[clock] if hit else None,
        "steps_to_target": hit["step"] if hit else None,
        "final_accuracy": summary["test_accuracy"],
        "final_time_s": records[-1][clock],
        "mb_sent_per_peer": summary["mb_sent_per_peer"],
        "mb_to_target": hit["mb_sent_per_peer"] if hit else None,
        "overrides": cmd[3:],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers", type=int, default=8)
    p.add_argument("--target", type=float, default=0.93, help="test accuracy to reach")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--log-every", type=int, default=4)
    p.add_argument("--straggler-compute-time", type=float, default=0.01, help="per-step floor under `straggler`")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "time_to_accuracy.json")
    args = p.parse_args(argv)
    compute = digits_compute_time()
    networks = {
        "ethernet_1g": ["network=ethernet_1g", f"network.compute_time={compute:.6g}"],
        "straggler": ["network=straggler", f"network.compute_time={args.straggler_compute_time}"],
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for net in networks.values():
            for label, overrides in ALGORITHMS:
                rows.append(run(label, overrides, net, args, Path(tmp)))
                print(f"  {label:16s} {net[0]:22s} done", flush=True)
    targets = []
    for net in networks:
        base = next(r for r in rows if r["network"] == net and r["algorithm"] == "allreduce")
        for r in rows:
            if r["network"] == net:
                ok = r["time_to_target_s"] is not None and base["time_to_target_s"]
                r["vs_allreduce"] = r["time_to_target_s"] / base["time_to_target_s"] if ok else None
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
            targets.append(
                Target(
                    f"fastest to {args.target} vs AllReduce under {net}: {best['algorithm']}", best["vs_allreduce"], 1.0
                )
            )
    cols = [
        "network",
        "algorithm",
        "time_to_target_s",
        "vs_allreduce",
        "steps_to_target",
        "final_accuracy",
        "final_time_s",
        "mb_sent_per_peer",
    ]
    print(
        f"target test accuracy {args.target}; {args.peers} mpi peers; compute per step under ethernet_1g: "
        f"{compute * 1e3:.3f} ms (measured on one core)"
    )
    print_table(cols, [[r[c] if r[c] is not None else "-" for c in cols] for r in rows], floatfmt=".4g")
    print_targets(targets)
    write_result(
        args.out,
        "time_to_accuracy",
        {"compute_s": compute, "target_accuracy": args.target, "rows": rows},
        targets,
        argv,
    )
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
