"""Does a straggler slow everyone? `python -m experiments.bench.stragglers [--peers 8] [--out FILE]`

Runs the Hydra app four times on real mpi processes, side by side in one invocation: AD-PSGD and
all-reduce, each without and with one peer made `--scale` x slower (`network.slow_peers`,
`network.compute_scale`). A per-step compute floor (`network.compute_time`) makes compute, not the
contention of many peers for few cores, set each peer's pace. Both algorithms process the same total
number of samples. Reports each algorithm's throughput (samples/s, all peers together) with the
straggler divided by its throughput without one. Targets: AD-PSGD >= 0.75 (a slow peer slows only
itself); all-reduce falls to about the slow peer's pace: every step waits for the straggler, so its
throughput is at most peers x batch / (scale x compute_time) samples/s (the "pace" column; the
ratio itself is above 1/scale when all-reduce's own step costs more than the floor).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dpsgd.backends.launch import peer_env

ROOT = Path(__file__).resolve().parent.parent.parent
ADPSGD_TARGET = 0.75  # AD-PSGD's throughput with the straggler, of its throughput without, at least
ALLREDUCE_PACE_RANGE = (0.7, 1.05)  # all-reduce's throughput with the straggler, of the slow peer's pace


def slow_peer_pace(peers: int, batch: int, scale: float, compute_time: float) -> float:
    """All-reduce's ceiling in samples/s (all peers together) with one peer `scale` x slower: every step waits for
    it, and its step takes at least scale x compute_time."""
    return peers * batch / (scale * compute_time)


def run(algorithm: str, straggler: bool, args, work: Path) -> dict:
    run_dir = work / f"{algorithm}_{'straggler' if straggler else 'even'}"
    overrides = [
        f"algorithm={algorithm}",
        f"peers={args.peers}",
        f"backend={args.backend}",
        "topology=ring",
        f"epochs={args.epochs}",
        "log_every=100000",
        f"seed={args.seed}",
        f"network={'straggler' if straggler else 'loopback'}",
        f"network.compute_time={args.compute_time}",
    ]
    if straggler:
        overrides += [f"network.slow_peers=[{args.slow_peer}]", f"network.compute_scale={args.scale}"]
    cmd = [sys.executable, "-m", "experiments.train", *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=peer_env({"DPSGD_PROGRESS": "0"}), capture_output=True, text=True, timeout=args.timeout
    )
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(overrides)} failed:\n{proc.stderr[-2000:]}")
    s = json.loads((run_dir / "summary.json").read_text())
    return {
        "algorithm": algorithm,
        "straggler": straggler,
        "samples": s["samples"],
        "wall_time_s": s["wall_time_s"],
        "samples_per_s": s["samples_per_s"],
        "test_accuracy": s["test_accuracy"],
        "steps_per_peer": (s.get("adpsgd") or {}).get("steps_per_peer"),
        "overrides": overrides,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers", type=int, default=8)
    p.add_argument("--backend", default="mpi", choices=["mpi", "torch", "local"])
    p.add_argument("--scale", type=float, default=4.0, help="how many times slower the straggler computes")
    p.add_argument("--slow-peer", type=int, default=1)
    p.add_argument("--compute-time", type=float, default=0.02, help="per-step compute floor, seconds")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "stragglers.json")
    args = p.parse_args(argv)

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_stragglers_") as tmp:
        for algorithm in ("adpsgd", "allreduce"):
            for straggler in (False, True):
                rows.append(run(algorithm, straggler, args, Path(tmp)))
                r = rows[-1]
                print(
                    f"  {algorithm:9s} straggler={straggler!s:5s} {r['samples_per_s']:9.0f} samples/s "
                    f"({r['samples']} samples in {r['wall_time_s']:.2f} s)",
                    file=sys.stderr,
                    flush=True,
                )
    by = {(r["algorithm"], r["straggler"]): r for r in rows}
    ratios = {a: by[(a, True)]["samples_per_s"] / by[(a, False)]["samples_per_s"] for a in ("adpsgd", "allreduce")}
    expected_allreduce = 1.0 / args.scale
    batch = 32  # conf/config.yaml's batch_size, which the runs keep
    slow_pace = slow_peer_pace(args.peers, batch, args.scale, args.compute_time)
    of_pace = by[("allreduce", True)]["samples_per_s"] / slow_pace
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "command": "python -m experiments.bench.stragglers " + " ".join(argv if argv is not None else sys.argv[1:]),
        "peers": args.peers,
        "backend": args.backend,
        "scale": args.scale,
        "slow_peer": args.slow_peer,
        "compute_time_s": args.compute_time,
        "epochs": args.epochs,
        "runs": rows,
        "throughput_ratio": ratios,
        "slow_peer_pace_samples_per_s": slow_pace,
        "allreduce_straggler_of_slow_pace": of_pace,
        "targets": {
            "adpsgd": {"target": f">= {ADPSGD_TARGET}", "holds": ratios["adpsgd"] >= ADPSGD_TARGET},
            "allreduce": {
                "expected": "at the slow peer's pace ({} to {} of it)".format(*ALLREDUCE_PACE_RANGE),
                "holds": ALLREDUCE_PACE_RANGE[0] <= of_pace <= ALLREDUCE_PACE_RANGE[1],
            },
        },
    }
    print(
        f"\nThroughput with one of {args.peers} peers {args.scale:g}x slower ({args.backend}, "
        f"compute floor {args.compute_time:g} s/step, same total samples):\n"
    )
    print(
        f"{'algorithm':10s} {'even (samples/s)':>17s} {'straggler (samples/s)':>22s} {'ratio':>7s} "
        f"{'of slow pace':>13s}  target"
    )
    for a in ("adpsgd", "allreduce"):
        holds = "holds" if result["targets"][a]["holds"] else "MISSED"
        target = f"ratio >= {ADPSGD_TARGET}" if a == "adpsgd" else "at the slow peer's pace"
        pace = by[(a, True)]["samples_per_s"] / slow_pace
        print(
            f"{a:10s} {by[(a, False)]['samples_per_s']:17.0f} {by[(a, True)]['samples_per_s']:22.0f} "
            f"{ratios[a]:7.3f} {pace:13.2f}  {target} ({holds})"
        )
    print(
        f"\nslow peer's pace: {args.peers} x {batch} / ({args.scale:g} x {args.compute_time:g} s) = "
        f"{slow_pace:.0f} samples/s; 1/scale = {expected_allreduce:.2f}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwritten: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
