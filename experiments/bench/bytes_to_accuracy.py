"""Bytes and emulated time to a target accuracy, per method and compression:
`python -m experiments.bench bytes_to_accuracy [--target 0.95]`.

Runs the Hydra app on real mpi processes, side by side in one invocation, on the default workload (4
peers, the MLP on digits, 30 epochs): all-reduce exact and with each compression (PowerSGD rank 2 is the
rule of DDP's PowerSGD hook, whose parameters it equals on the same seeds: tests/test_compression.py),
D-PSGD on a ring, DiLoCo and Streaming DiLoCo, exact and int8, under the emulated networks `ethernet_1g`
(100 us, 1 Gb/s) and `wan` (50 ms, 100 Mb/s), in model mode: each step's compute is fixed at the time
measured for this model on one core in this run, latency and bandwidth go to the emulated clock. For
each: the MB each peer sent and the emulated time until the first logged record whose averaged model
reaches the target, and their ratios to exact all-reduce's under the same network.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from experiments.bench import cli, harness
from experiments.bench.time_to_accuracy import digits_compute_time, ratio, to_target

METHODS = (  # label, overrides
    ("allreduce", ["algorithm=allreduce"]),
    ("allreduce powersgd", ["algorithm=allreduce", "compression=powersgd"]),
    ("allreduce int8", ["algorithm=allreduce", "compression=int8"]),
    ("allreduce fp16", ["algorithm=allreduce", "compression=fp16"]),
    ("dpsgd ring", ["algorithm=dpsgd", "topology=ring"]),
    ("dpsgd ring int8", ["algorithm=dpsgd", "topology=ring", "compression=int8"]),
    ("diloco", ["algorithm=diloco"]),
    ("diloco int8", ["algorithm=diloco", "compression=int8"]),
    ("streaming_diloco", ["algorithm=streaming_diloco"]),
    ("streaming_diloco int8", ["algorithm=streaming_diloco", "compression=int8"]),
)
NETWORKS = ("ethernet_1g", "wan")


def options(p) -> None:
    p.add_argument("--target", type=float, default=0.95, help="test accuracy to reach")
    p.add_argument("--log-every", type=int, default=11)


def run(args) -> harness.Result:
    compute = digits_compute_time()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for net in NETWORKS:
            for label, overrides in METHODS:
                network = [f"network={net}", f"network.compute_time={compute:.6g}"]
                given = [*overrides, f"target_accuracy={args.target}"]
                rows.append({**to_target(label.replace(" ", "_"), given, network, args, Path(tmp)), "algorithm": label})
                print(f"  {label:22s} {net:12s} done", flush=True)
    for net in NETWORKS:
        base = next(r for r in rows if r["network"] == net and r["algorithm"] == "allreduce")
        for r in (r for r in rows if r["network"] == net):
            r["mb_vs_allreduce"] = ratio(r["mb_to_target"], base["mb_to_target"])
            r["time_vs_allreduce"] = ratio(r["time_to_target_s"], base["time_to_target_s"])
    print(
        f"target test accuracy {args.target}; {args.peers} mpi peers; compute per step: {compute * 1e3:.3f} ms "
        "(measured on one core); MB per peer and emulated seconds until the target"
    )
    cols = ["network", "algorithm", "mb_to_target", "mb_vs_allreduce", "time_to_target_s", "time_vs_allreduce"]
    harness.print_columns(rows, [*cols, "steps_to_target", "final_accuracy", "mb_sent_per_peer"])
    return harness.Result({"compute_s": compute, "target_accuracy": args.target, "rows": rows})


main = cli.entry("bytes_to_accuracy")

if __name__ == "__main__":
    raise SystemExit(main())
