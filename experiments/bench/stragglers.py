"""Does a straggler slow everyone? `python -m experiments.bench stragglers [--peers 8] [--quick]`

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

import sys
import tempfile
from pathlib import Path

from experiments.bench import cli, harness
from experiments.targets import ADPSGD_TARGET, ALLREDUCE_PACE_RANGE, slow_peer_pace


def throughput(algorithm: str, straggler: bool, args, work: Path) -> dict:
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
    run_dir = work / f"{algorithm}_{'straggler' if straggler else 'even'}"
    s, _ = harness.run_app(overrides, run_dir, args.timeout)
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


def options(p) -> None:
    p.add_argument("--backend", default="mpi", choices=["mpi", "torch", "local"])
    p.add_argument("--scale", type=float, default=4.0, help="how many times slower the straggler computes")
    p.add_argument("--slow-peer", type=int, default=1)
    p.add_argument("--compute-time", type=float, default=0.02, help="per-step compute floor, seconds")


def run(args) -> harness.Result:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_stragglers_") as tmp:
        for algorithm in ("adpsgd", "allreduce"):
            for straggler in (False, True):
                rows.append(throughput(algorithm, straggler, args, Path(tmp)))
                r = rows[-1]
                print(
                    f"  {algorithm:9s} straggler={straggler!s:5s} {r['samples_per_s']:9.0f} samples/s "
                    f"({r['samples']} samples in {r['wall_time_s']:.2f} s)",
                    file=sys.stderr,
                    flush=True,
                )
    by = {(r["algorithm"], r["straggler"]): r for r in rows}
    ratios = {a: by[(a, True)]["samples_per_s"] / by[(a, False)]["samples_per_s"] for a in ("adpsgd", "allreduce")}
    batch = 32  # conf/config.yaml's batch_size, which the runs keep
    slow_pace = slow_peer_pace(args.peers, batch, args.scale, args.compute_time)
    of_pace = by[("allreduce", True)]["samples_per_s"] / slow_pace
    print(
        f"\nThroughput with one of {args.peers} peers {args.scale:g}x slower ({args.backend}, "
        f"compute floor {args.compute_time:g} s/step, same total samples):\n"
    )
    harness.print_table(
        ["algorithm", "even (samples/s)", "straggler (samples/s)", "ratio", "of slow pace"],
        [
            [a, f"{by[(a, False)]['samples_per_s']:.0f}", f"{by[(a, True)]['samples_per_s']:.0f}", ratios[a],
             by[(a, True)]["samples_per_s"] / slow_pace]
            for a in ("adpsgd", "allreduce")
        ],
        floatfmt=".3f",
    )  # fmt: skip
    print(
        f"\nslow peer's pace: {args.peers} x {batch} / ({args.scale:g} x {args.compute_time:g} s) = "
        f"{slow_pace:.0f} samples/s; 1/scale = {1.0 / args.scale:.2f}"
    )
    low, high = ALLREDUCE_PACE_RANGE
    targets = [
        harness.Target("AD-PSGD throughput with the straggler / without", ratios["adpsgd"], at_least=ADPSGD_TARGET),
        harness.Target("all-reduce throughput with the straggler / the slow peer's pace", of_pace, high, at_least=low),
    ]
    result = {
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
    }
    return harness.Result(result, targets)


main = cli.entry("stragglers")

if __name__ == "__main__":
    raise SystemExit(main())
