"""How much does a waiting peer slow a computing one? `python -m experiments.bench.waiter_cost [--peers 4]`

On `--peers` MPI ranks (more ranks than cores is the case that matters: a small machine, or
oversubscribed nodes), the even ranks compute (a fixed loop of float32 matmuls, one thread) while
each odd rank waits for a message its computing partner sends when done. The computing ranks'
time is compared across the ways the partner waits, in alternating rounds of one run:
- `asleep`: the partner sleeps through the computation and receives afterwards (no CPU used: the
  baseline);
- `toolkit`: the partner waits in the toolkit's `wait_request` (polls with short sleeps);
- `mpi_blocking`: the partner waits in MPICH's blocking `Recv` (it spins).
Target: toolkit / asleep <= 1.05 (a waiting peer slows a computing one by at most 5%).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from experiments.bench import common

LIMIT = 1.05
MODES = ("asleep", "toolkit", "mpi_blocking")


def worker(args) -> None:
    import numpy as np
    import torch
    from mpi4py import MPI

    from dpsgd.comm.mpi import MPICommunicator

    world = common.init_ranks(gloo=False)
    comm = MPICommunicator(timeout_s=60)
    rank, n = world.Get_rank(), world.Get_size()
    partner = rank + 1 if rank % 2 == 0 else rank - 1
    computing = rank % 2 == 0 and partner < n  # an odd count: the last rank sits out
    a = torch.randn(args.matrix, args.matrix)
    flag = torch.zeros(1)

    def compute() -> float:
        t0 = time.perf_counter()
        for _ in range(args.matmuls):
            torch.mm(a, a)
        return time.perf_counter() - t0

    def round_(mode: str, sleep_s: float) -> float | None:
        world.Barrier()
        if partner >= n:
            return None
        if computing:
            dt = compute()
            comm.wait_request("send", comm.start_send(flag, partner, tag=1), [partner])
            return dt
        wall, cpu = time.perf_counter(), time.process_time()
        if mode == "asleep":
            time.sleep(sleep_s)
        if mode == "mpi_blocking":
            comm._comm.Recv(flag.numpy(), source=partner, tag=1)  # the library's own (spinning) wait
        else:
            comm.wait_request("recv", comm.start_recv(flag, partner, tag=1), [partner])
        busy[mode].append((time.process_time() - cpu) / (time.perf_counter() - wall))
        return None

    busy: dict[str, list[float]] = {m: [] for m in MODES}  # a waiting rank's CPU time / its wait's wall time
    warm = [round_("toolkit", 0.0) or 0.0 for _ in range(args.warmup)]
    for b in busy.values():
        b.clear()  # the warm-up's waits do not count
    sleep_s = 1.5 * world.allreduce(max(warm), op=MPI.MAX)  # the baseline sleeps past every computation
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for i in range(args.rounds * len(MODES)):
        mode = MODES[i % len(MODES)]
        dt = round_(mode, sleep_s)
        if dt is not None:
            times[mode].append(dt)
    mine = {m: float(np.median(t)) for m, t in times.items()} if computing else None
    waiting = {m: float(np.median(b)) for m, b in busy.items()} if not computing and partner < n else None
    gathered = world.gather((mine, waiting), root=0)
    comm.close()
    result = {
        "peers": n,
        "computing": [g for g, _ in gathered or [] if g is not None],
        "waiting_cpu_fraction": [w for _, w in gathered or [] if w is not None],
        "sleep_s": sleep_s,
    }
    common.finish_ranks(world, args.worker, result)


def miss_cause(busy: dict[str, float]) -> str:
    """What the waiting partner took from the cores, measured: its CPU time over its wait's wall time."""
    return (
        f"the partner used {100 * busy['toolkit']:.1f}% of a core while waiting in the toolkit's polls "
        f"(asleep {100 * busy['asleep']:.1f}%, in MPICH's blocking wait {100 * busy['mpi_blocking']:.1f}%)"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--matrix", type=int, default=256)
    p.add_argument("--matmuls", type=int, default=200, help="per computation (about 0.1-0.3 s)")
    p.add_argument("--rounds", type=int, default=10, help="per way of waiting")
    p.add_argument("--warmup", type=int, default=3)
    common.add_rank_options(p)
    p.add_argument("--out", type=Path, default=common.ROOT / "outputs" / "bench" / "waiter_cost.json")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    wargs = ["--matrix", str(args.matrix), "--matmuls", str(args.matmuls), "--rounds", str(args.rounds)]
    wargs += ["--warmup", str(args.warmup)]
    with tempfile.TemporaryDirectory(prefix="bench_waiter_cost_") as tmp:
        res = common.spawn_ranks("waiter_cost", args.peers, wargs, Path(tmp), args.timeout, args.return_freed_memory)
    rows = res["computing"]
    mean = {m: sum(r[m] for r in rows) / len(rows) for m in MODES}
    print(
        f"\nA computing rank's time while its partner waits, {args.peers} MPI ranks ({len(rows)} computing), "
        f"{args.matmuls} matmuls of {args.matrix}^2, median of {args.rounds} rounds, mean over the computing ranks:\n"
    )
    common.print_table(
        ["partner waits", "compute ms", "/ asleep"], [[m, mean[m] * 1e3, mean[m] / mean["asleep"]] for m in MODES]
    )
    targets = [
        common.Target("computing rank, partner in the toolkit's wait / asleep", mean["toolkit"] / mean["asleep"], LIMIT)
    ]
    res["ratios"] = {m: mean[m] / mean["asleep"] for m in MODES}
    common.print_targets(targets)
    busy = {m: sum(w[m] for w in res["waiting_cpu_fraction"]) / len(res["waiting_cpu_fraction"]) for m in MODES}
    res["waiting_cpu_fraction_mean"] = busy
    print("the waiting partner's CPU time / its wait: " + ", ".join(f"{m} {100 * busy[m]:.1f}%" for m in MODES))
    if not targets[0].holds:
        print(f"  MISS {targets[0].name}: {miss_cause(busy)}")
    common.write_result(args.out, "waiter_cost", res, targets, argv)
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
