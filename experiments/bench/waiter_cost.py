"""How much does a waiting peer slow a computing one? `python -m experiments.bench waiter_cost [--peers 4]`

On `--peers` MPI ranks (more ranks than cores is the case that matters: a small machine, or
oversubscribed nodes), the even ranks compute (a fixed loop of float32 matmuls, one thread) while
each odd rank waits for a message its computing partner sends when done. The computing ranks'
time is compared across the ways the partner waits, in alternating rounds of one run:
- `asleep`: the partner sleeps through the computation and receives afterwards (no CPU used: the
  baseline);
- `toolkit`: the partner waits in the toolkit's `wait_request` (polls with short sleeps);
- `exchange`: both call the toolkit's `exchange` (the computing one when done): a collective's wait, which polls
  its first milliseconds without sleeping (dpsgd.comm.mpi.SPIN_S) before the short sleeps;
- `mpi_blocking`: the partner waits in MPICH's blocking `Recv` (it spins).
Target: toolkit / asleep and exchange / asleep <= 1.05 (a waiting peer slows a computing one by at most 5%).
"""

from __future__ import annotations

import time

from experiments.bench import cli, harness, ranks

LIMIT = 1.05
MODES = ("asleep", "toolkit", "exchange", "mpi_blocking")
TOOLKIT_MODES = ("toolkit", "exchange")  # held to LIMIT


def worker(args) -> None:
    import numpy as np
    import torch
    from mpi4py import MPI

    from dpsgd.comm import MPICommunicator

    world = ranks.init_ranks(gloo=False)
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
            if mode == "exchange":
                comm.exchange([flag], partner)
            else:
                comm.wait_request("send", comm.start_send(flag, partner, tag=1), [partner])
            return dt
        wall, cpu = time.perf_counter(), time.process_time()
        if mode == "asleep":
            time.sleep(sleep_s)
        if mode == "mpi_blocking":
            comm._comm.Recv(flag.numpy(), source=partner, tag=1)  # the library's own (spinning) wait
        elif mode == "exchange":
            comm.exchange([flag], partner)
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
    waiting = {m: float(np.median(b)) for m, b in busy.items()} if not computing and partner < n else None
    gathered = world.gather((times if computing else None, waiting), root=0)
    comm.close()
    result = {
        "peers": n,
        "computing_per_round": [t for t, _ in gathered or [] if t is not None],
        "waiting_cpu_fraction": [w for _, w in gathered or [] if w is not None],
        "sleep_s": sleep_s,
    }
    ranks.finish_ranks(world, args.worker, result)


def miss_cause(busy: dict[str, float], mode: str = "toolkit") -> str:
    """What the waiting partner took from the cores, measured: its CPU time over its wait's wall time."""
    return (
        f"the partner used {100 * busy[mode]:.1f}% of a core while waiting in the toolkit's "
        f"{'collective' if mode == 'exchange' else 'request'} wait "
        f"(asleep {100 * busy['asleep']:.1f}%, in MPICH's blocking wait {100 * busy['mpi_blocking']:.1f}%)"
    )


def per_round(res: dict, mode: str) -> list[list[float]]:
    """The computing ranks' times in `mode`, a row per round and a column per rank (round k of every mode ran in
    the same cycle of the modes: the pairs of the noise's bootstrap)."""
    return [list(row) for row in zip(*(rank[mode] for rank in res["computing_per_round"]))]


def options(p) -> None:
    p.add_argument("--matrix", type=int, default=256, help="side of the square matrices multiplied")
    p.add_argument("--matmuls", type=int, default=200, help="per computation (about 0.1-0.3 s)")


def run(args) -> harness.Result:
    res = ranks.spawn(args)
    # each computing rank's median per mode; the rounds themselves are the noise's samples (per_round)
    res["computing"] = rows = [{m: ranks.median(t[m]) for m in MODES} for t in res["computing_per_round"]]
    mean = {m: sum(r[m] for r in rows) / len(rows) for m in MODES}
    print(
        f"\nA computing rank's time while its partner waits, {args.peers} MPI ranks ({len(rows)} computing), "
        f"{args.matmuls} matmuls of {args.matrix}^2, median of {args.rounds} rounds, mean over the computing ranks:\n"
    )
    harness.print_table(
        ["partner waits", "compute ms", "/ asleep"], [[m, mean[m] * 1e3, mean[m] / mean["asleep"]] for m in MODES]
    )
    res["ratios"] = {m: mean[m] / mean["asleep"] for m in MODES}
    busy = {m: sum(w[m] for w in res["waiting_cpu_fraction"]) / len(res["waiting_cpu_fraction"]) for m in MODES}
    res["waiting_cpu_fraction_mean"] = busy
    print("the waiting partner's CPU time / its wait: " + ", ".join(f"{m} {100 * busy[m]:.1f}%" for m in MODES))
    targets = [
        harness.Target(
            f"computing rank, partner in the toolkit's {'collective ' if m == 'exchange' else ''}wait / asleep",
            mean[m] / mean["asleep"],
            LIMIT,
            cause=miss_cause(busy, m),
            interval=harness.ratio_interval(per_round(res, m), per_round(res, "asleep")),
        )
        for m in TOOLKIT_MODES
    ]
    return harness.Result(res, targets)


main = cli.entry("waiter_cost")


if __name__ == "__main__":
    raise SystemExit(main())
