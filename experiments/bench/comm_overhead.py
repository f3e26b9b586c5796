"""What does the toolkit's communicator cost over raw MPI / torch.distributed?
`python -m experiments.bench comm_overhead [--peers 4] [--sizes-mb 1 11 44] [--reps 30] [--quick]`

On `--peers` real MPI processes that also form one gloo world, side by side in one run, for each
size of float32 parameters: the toolkit's `neighbor_exchange` and `neighbor_average` on a ring
(to both neighbours, weights 1/3) and `allreduce_mean`, on the `mpi` backend against the same
result written by hand with raw mpi4py (two `Sendrecv`, `Allreduce` into a preallocated buffer,
the same arithmetic; and, to name a miss's cause, the toolkit's own non-blocking MPI calls completed by MPI's
spinning Waitall, "raw nb", and the same returning new tensors that the caller keeps, as the toolkit's operations
do, "raw new") and on the `torch` backend (gloo) against raw torch.distributed
(`batch_isend_irecv`, `all_reduce`). Each time is the slowest rank's, median over `--reps`
repetitions (more for the smaller sizes) after warm-up; toolkit and raw repetitions alternate so
that drift affects both. Targets: the toolkit at most 1.20x raw below 11 MiB (latency-bound), at most
1.05x from 11 MiB up. Beside each: the physical floor,
the bytes one rank sends divided by the loopback bandwidth measured in the same run.
"""

from __future__ import annotations

from dpsgd.comm.netem import ring_allreduce_bytes
from experiments.bench import cli, harness, ranks

SMALL_LIMIT, LARGE_LIMIT, LARGE_MB = 1.20, 1.05, 11  # toolkit / raw: below 11 MiB, and from 11 MiB up


def limit_for(mb: float) -> float:
    """Small messages are latency-bound (the toolkit's waits cost a share); large ones bandwidth-bound."""
    return LARGE_LIMIT if mb >= LARGE_MB else SMALL_LIMIT


# neighbor_exchange_out: the exchange receiving into buffers the caller lends (`out=`), as raw receives into its
# preallocated ones; neighbor_exchange: its default form, returning new buffers (their cost: "new tensors" below)
OPS = ("neighbor_exchange", "neighbor_exchange_out", "neighbor_average", "allreduce_mean")
EXCHANGES = ("neighbor_exchange", "neighbor_exchange_out")
BACKENDS = ("mpi", "torch")
# raw_nb: mpi's non-blocking calls completed by MPI's spinning Waitall (torch's raw calls are already the toolkit's);
# raw_new: the same calls returning new tensors, as the toolkit's operations do
IMPLS = {"mpi": ("toolkit", "raw", "raw_nb", "raw_new"), "torch": ("toolkit", "raw")}
# the communicators closed before the ranks finish: the torch group goes down at exit (its close() ends it for all)
CLOSED_HERE = ("mpi",)


def reps_for(mb: float, reps: int, largest: float) -> int:
    """`reps` at the largest size; smaller (faster) sizes get more, up to 5x."""
    return int(min(5 * reps, max(reps, round(reps * largest / mb))))


# --- inside the ranks ---------------------------------------------------------------------


def _raw_mpi(raw, x, out, from_left, from_right, left, right):
    """mpi's blocking calls on preallocated buffers: (exchange, allreduce)."""
    from mpi4py import MPI

    n = raw.Get_size()
    xb, lb, rb, ob = x.numpy(), from_left.numpy(), from_right.numpy(), out.numpy()

    def exchange():
        raw.Sendrecv(xb, dest=right, recvbuf=lb, source=left)
        raw.Sendrecv(xb, dest=left, recvbuf=rb, source=right)

    def allreduce():
        raw.Allreduce(xb, ob, op=MPI.SUM)
        out.div_(n)

    return exchange, allreduce


def _raw_torch(raw, x, out, from_left, from_right, left, right):
    """torch.distributed's calls on preallocated buffers: (exchange, allreduce)."""
    import torch.distributed as dist

    n = raw.Get_size()

    def exchange():
        ops = [
            dist.P2POp(dist.irecv, from_left, left),
            dist.P2POp(dist.irecv, from_right, right),
            dist.P2POp(dist.isend, x, left),
            dist.P2POp(dist.isend, x, right),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def allreduce():
        out.copy_(x)
        dist.all_reduce(out)
        out.div_(n)

    return exchange, allreduce


RAW = {"mpi": _raw_mpi, "torch": _raw_torch}


def _raw_ops(backend: str, raw, x, out, from_left, from_right, left, right, nb):
    """The same results as the toolkit's operations, written by hand on preallocated buffers."""
    import torch

    first, second = (from_left, from_right) if left < right else (from_right, from_left)
    w_first, w_second = nb.recv[min(left, right)], nb.recv[max(left, right)]
    exchange, allreduce = RAW[backend](raw, x, out, from_left, from_right, left, right)

    def average():
        exchange()
        torch.mul(x, nb.self_weight, out=out)
        out.add_(first, alpha=w_first)  # rank order, as the toolkit sums
        out.add_(second, alpha=w_second)

    return {
        "neighbor_exchange": exchange,
        "neighbor_exchange_out": exchange,
        "neighbor_average": average,
        "allreduce_mean": allreduce,
    }


def _raw_nonblocking_ops(raw, x, out, from_left, from_right, left, right, nb, new_tensors: bool = False):
    """mpi only: the toolkit's own MPI calls (Irecv/Isend, in-place Iallreduce) written by hand, completed by
    MPI's Waitall, which spins and progresses the transfer continuously. Beside raw (blocking calls) and the
    toolkit (the same calls, completed by polls that sleep between them), it splits a miss into what MPI's
    non-blocking path costs and what the toolkit's waiting costs.
    `new_tensors`: returning new tensors, as the toolkit's operations do (the exchange its receive buffers; the average
    and the all-reduce a fresh result, the average receiving into buffers it reuses, as the toolkit's does). The timing
    loop keeps each call's result until the next timed call returns, as it keeps the toolkit's: so each call receives
    into fresh memory while the last result is still held, not into the one buffer still warm in the cache from the
    call before."""
    import torch
    from mpi4py import MPI

    n = raw.Get_size()
    first, second = (from_left, from_right) if left < right else (from_right, from_left)
    w_first, w_second = nb.recv[min(left, right)], nb.recv[max(left, right)]
    xb = x.numpy()

    def exchange(into):
        reqs = [raw.Irecv(into[0].numpy(), source=left), raw.Irecv(into[1].numpy(), source=right)]
        reqs += [raw.Isend(xb, dest=left), raw.Isend(xb, dest=right)]
        MPI.Request.Waitall(reqs)
        return into

    def result():  # where the all-reduce and the average write
        return torch.empty_like(x) if new_tensors else out

    def receive():
        return exchange((torch.empty_like(x), torch.empty_like(x)) if new_tensors else (from_left, from_right))

    def allreduce():
        total = result().copy_(x)
        raw.Iallreduce(MPI.IN_PLACE, total.numpy(), op=MPI.SUM).Wait()
        return total.div_(n)

    def average():
        exchange((from_left, from_right))
        mixed = torch.mul(x, nb.self_weight, out=result())
        mixed.add_(first, alpha=w_first)
        return mixed.add_(second, alpha=w_second)

    return {
        "neighbor_exchange": receive,
        "neighbor_exchange_out": lambda: exchange((from_left, from_right)),  # into lent buffers: no new tensors
        "neighbor_average": average,
        "allreduce_mean": allreduce,
    }


def _largest_difference(a, b) -> float:
    """max |a - b| over pairs of tensors, NaN counted as infinitely far (it would compare false with everything)."""
    import torch

    diffs = [torch.nan_to_num((x.reshape(-1) - y.reshape(-1)).abs(), nan=float("inf")).max() for x, y in zip(a, b)]
    return max(float(d) for d in diffs)


def _toolkit_ops(comms, backend, x, left, right, nb):
    peers = [left, right]
    lent = [x.new_empty(x.shape), x.new_empty(x.shape)]  # the exchange's out=, its own as raw's are raw's
    return {
        "neighbor_exchange": lambda: comms[(backend, "neighbor_exchange")].neighbor_exchange(x, peers, peers),
        "neighbor_exchange_out": lambda: comms[(backend, "neighbor_exchange_out")].neighbor_exchange(
            x, peers, peers, out=lent
        ),
        "neighbor_average": lambda: comms[(backend, "neighbor_average")].neighbor_average([x], nb),
        "allreduce_mean": lambda: comms[(backend, "allreduce_mean")].allreduce_mean([x]),
    }


def worker(args) -> None:
    import torch

    import topologies
    from dpsgd.comm import MPICommunicator, TorchCommunicator

    world = ranks.init_ranks()
    rank, n = world.Get_rank(), world.Get_size()
    # one communicator per backend and operation, so that no operation reuses buffers another one left
    communicator = {"mpi": MPICommunicator, "torch": TorchCommunicator}
    comms = {(backend, op): communicator[backend]() for backend in BACKENDS for op in OPS}
    raw_mpi = world.Dup()  # the raw code's own context, as the toolkit's communicator has
    nb = topologies.make("ring", n).neighbors(rank)
    left, right = (rank - 1) % n, (rank + 1) % n
    largest = max(args.sizes_mb)
    floor = ranks.loopback_bandwidth(world, int(largest * 2**20), reps=args.floor_reps)

    rows = []
    for mb in args.sizes_mb:
        numel = int(mb * 2**20) // 4
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))

        # every implementation of every operation has buffers of its own, as each toolkit operation has its own
        # communicator: shared, the raw code's stayed warm in the cache (touched by some 20 raw calls a repetition,
        # the toolkit's once), which favoured raw (1 MiB, mpi, 3 alternated pairs: the exchange 1.35-1.40x ->
        # 1.26-1.32x, the average 1.15-1.22x -> 1.10-1.17x, the all-reduce unchanged; benchmarks.md)
        def buffers(x=x):
            return torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)

        raw_buffers = {(backend, op): buffers() for backend in BACKENDS for op in OPS}
        impls = {}
        for backend in BACKENDS:
            impls[(backend, "toolkit")] = _toolkit_ops(comms, backend, x, left, right, nb)
            impls[(backend, "raw")] = {
                op: _raw_ops(backend, raw_mpi, x, *raw_buffers[(backend, op)], left, right, nb)[op] for op in OPS
            }
        for impl, new_tensors in (("raw_nb", False), ("raw_new", True)):
            impls[("mpi", impl)] = {
                op: _raw_nonblocking_ops(raw_mpi, x, *buffers(), left, right, nb, new_tensors)[op] for op in OPS
            }

        # correctness first: the toolkit (and raw with new tensors) returns what the hand-written code computes, also
        # on a second call (which reuses buffers), and that call leaves the first call's result alone; the out=
        # exchange returns the lent tensors themselves, rewritten (they are filled with NaN before its third call)
        agree = {}
        for backend in BACKENDS:
            for op in OPS:
                first = [g.clone() for g in impls[(backend, "toolkit")][op]()]
                kept = impls[(backend, "toolkit")][op]()
                pairs = [(first, kept)]
                if op == "neighbor_exchange_out":  # the same tensors each call: nothing of the first call to keep
                    pairs = []
                    for g in kept:
                        g.fill_(float("nan"))
                got = impls[(backend, "toolkit")][op]()
                if op == "neighbor_exchange_out" and not all(g is k for g, k in zip(got, kept)):
                    got = [torch.full_like(g, float("nan")) for g in got]  # not the lent tensors: a disagreement
                impls[(backend, "raw")][op]()
                out, from_left, from_right = raw_buffers[(backend, op)]
                want = [from_left, from_right] if op in EXCHANGES else [out]
                new = want
                if "raw_new" in IMPLS[backend]:
                    new = impls[(backend, "raw_new")][op]()
                    new = list(new) if op in EXCHANGES else [new]
                pairs += [(got, want), (new, want)]
                agree[(backend, op)] = max(_largest_difference(a, b) for a, b in pairs)

        reps, warmup = reps_for(mb, args.reps, largest), args.warmup
        times = {(b, op, impl): [] for b in BACKENDS for op in OPS for impl in IMPLS[b]}
        faults = {k: [] for k in times}
        for i in range(warmup + reps):
            for backend in BACKENDS:
                for op in OPS:
                    # alternate the order, so that drift and cache state favour none
                    for impl in IMPLS[backend] if i % 2 == 0 else IMPLS[backend][::-1]:
                        dt, df, _ = ranks.timed(world, impls[(backend, impl)][op])
                        if i >= warmup:
                            times[(backend, op, impl)].append(dt)
                            faults[(backend, op, impl)].append(df)
        diffs = {k: ranks.slowest(world, [v])[0] for k, v in agree.items()}
        for backend in BACKENDS:
            for op in OPS:
                tk = ranks.slowest(world, times[(backend, op, "toolkit")])
                raw = ranks.slowest(world, times[(backend, op, "raw")])
                sent = 2 * x.nbytes if op != "allreduce_mean" else ring_allreduce_bytes(x.nbytes, n)
                rows.append(
                    {
                        "backend": backend,
                        "op": op,
                        "mb": mb,
                        "bytes": x.nbytes,
                        "reps": reps,
                        "toolkit_s": ranks.median(tk),
                        "raw_s": ranks.median(raw),
                        "ratio": ranks.median(tk) / ranks.median(raw),
                        "paired_ratio": ranks.median([a / b for a, b in zip(tk, raw)]),
                        "interval": harness.ratio_interval(tk, raw),
                        "raw_nonblocking_s": (
                            ranks.slowest_median(world, times[(backend, op, "raw_nb")])
                            if "raw_nb" in IMPLS[backend]
                            else None
                        ),
                        "raw_new_tensors_s": (  # (the out= exchange returns no new tensors: no such factor)
                            ranks.slowest_median(world, times[(backend, op, "raw_new")])
                            if "raw_new" in IMPLS[backend] and op != "neighbor_exchange_out"
                            else None
                        ),
                        "bytes_sent_per_rank": sent,
                        "floor_s": ranks.floor_s(sent, floor),
                        "max_abs_diff_vs_raw": diffs[(backend, op)],
                        "page_faults": {
                            impl: ranks.slowest_median(world, faults[(backend, op, impl)])
                            for impl in ("toolkit", "raw")
                        },
                    }
                )
        del impls
    for (backend, _), c in comms.items():
        if backend in CLOSED_HERE:
            c.close()
    ranks.finish_ranks(world, args.worker, {"floor": floor, "rows": rows, "peers": n, "warmup": args.warmup})


# --- the driver ---------------------------------------------------------------------------


def miss_cause(row: dict) -> str:
    """Where a row's excess over raw went, from its own measurements. On mpi, three factors whose product is the
    ratio: MPI's non-blocking path (raw nb: the toolkit's MPI calls completed by MPI's spinning Waitall, against the
    blocking calls), new tensors (the same calls returning new tensors, which the caller keeps, as the toolkit's
    operations do, against preallocated buffers reused warm), and the toolkit's waits and wrapper (its polls, its
    Python layers: the toolkit against raw with new tensors). On torch, the toolkit's own work in ms."""
    excess_ms = (row["toolkit_s"] - row["raw_s"]) * 1e3
    if row["raw_nonblocking_s"] is None:
        return (
            f"the toolkit makes the same gloo calls as raw; its own work (flattening, staging copies, polls) costs "
            f"{excess_ms:.2f} ms a call"
        )
    path = row["raw_nonblocking_s"] / row["raw_s"]
    nonblocking = (
        f"{row['ratio']:.2f}x = MPI's non-blocking calls {path:.2f}x (under MPI's spinning Waitall, against the "
        f"blocking ones)"
    )
    if row["raw_new_tensors_s"] is None:  # the out= exchange: into lent buffers, as raw
        wrapper = row["toolkit_s"] / row["raw_nonblocking_s"]
        largest = "the toolkit's waits and wrapper" if wrapper >= path else "MPI's non-blocking calls"
        return f"{nonblocking} x the toolkit's waits and wrapper {wrapper:.2f}x; the largest: {largest}"
    new = row["raw_new_tensors_s"] / row["raw_nonblocking_s"]
    wrapper = row["toolkit_s"] / row["raw_new_tensors_s"]
    names = ("MPI's non-blocking calls", "new tensors", "the toolkit's waits and wrapper")
    largest = max(zip((path, new, wrapper), names))[1]
    return (
        f"{nonblocking} x new tensors {new:.2f}x (the same calls returning fresh buffers that the caller keeps, as "
        f"the toolkit's operations do) x the toolkit's waits and wrapper {wrapper:.2f}x; the largest: {largest}"
    )


def options(p) -> None:
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 11, 44], help="MiB of float32 parameters")


def run(args) -> harness.Result:
    if args.peers < 3:
        raise SystemExit("error: comm_overhead: --peers must be at least 3 (a ring with two distinct neighbours)")
    res = ranks.spawn(args)
    rows, floor = res["rows"], res["floor"]
    res["return_freed_memory"] = args.return_freed_memory
    targets = [
        harness.Target(
            f"{r['backend']} {r['op']} {r['mb']:g} MiB",
            r["ratio"],
            limit_for(r["mb"]),
            cause=miss_cause(r),
            interval=tuple(r["interval"]) if r["interval"] else None,
        )
        for r in rows
    ]
    print(
        f"\nToolkit against raw, {args.peers} MPI ranks (gloo in the same processes), ring neighbours, "
        f"float32; slowest rank, median ms:\n"
    )
    columns = ["backend", "op", "MiB", "reps", "toolkit ms", "raw ms", "raw nb ms", "raw new ms", "ratio", "floor ms"]
    harness.print_table(
        [*columns, "toolkit/floor", "faults tk/raw", "target"],
        [
            [
                r["backend"],
                r["op"],
                f"{r['mb']:g}",
                r["reps"],
                r["toolkit_s"] * 1e3,
                r["raw_s"] * 1e3,
                r["raw_nonblocking_s"] * 1e3 if r["raw_nonblocking_s"] is not None else "-",
                r["raw_new_tensors_s"] * 1e3 if r["raw_new_tensors_s"] is not None else "-",
                r["ratio"],
                r["floor_s"] * 1e3,
                r["toolkit_s"] / r["floor_s"],
                f"{r['page_faults']['toolkit']:.0f}/{r['page_faults']['raw']:.0f}",
                "PASS" if t.holds else "MISS",
            ]
            for r, t in zip(rows, targets)
        ],
    )
    print(
        f"\n{ranks.floor_line(floor)}; floor = bytes one rank sends (ring exchange 2M, all-reduce "
        f"2(n-1)/n M) / that bandwidth. Targets: toolkit <= {SMALL_LIMIT:g}x raw below "
        f"{LARGE_MB} MiB, <= {LARGE_LIMIT:g}x from {LARGE_MB} MiB up. faults: page faults per call "
        f"(slowest rank, median); a fresh buffer faults once per 4 KiB page."
    )
    bad = [r for r in rows if r["max_abs_diff_vs_raw"] > 1e-5]
    problems = [f"toolkit and raw results differ: {[(r['backend'], r['op'], r['mb']) for r in bad]}"] if bad else []
    return harness.Result(res, targets, problems)


main = cli.entry("comm_overhead")


if __name__ == "__main__":
    raise SystemExit(main())
