"""What does the toolkit's communicator cost over raw MPI / torch.distributed?
`python -m experiments.bench comm_overhead [--peers 4] [--sizes-mb 1 11 44] [--reps 30] [--quick]`

On `--peers` real MPI processes that also form one gloo world, side by side in one run, for each
size of float32 parameters: the toolkit's `neighbor_exchange` (in its default form, which returns new receive
buffers, and with `out=`, which receives into the caller's) and `neighbor_average` on a ring (to both neighbours,
weights 1/3) and `allreduce_mean`, on the `mpi` backend against the same results written by hand with raw mpi4py
(two `Sendrecv`, `Allreduce`, the same arithmetic) and on the `torch` backend (gloo) against raw torch.distributed
(`batch_isend_irecv`, `all_reduce`). Raw keeps each operation's contract: where the toolkit returns new tensors (the
default exchange's receive buffers, the average's and the all-reduce's result), so does raw; the out= exchange
receives into lent buffers in both. Beside it, to name a miss's cause: "raw nb", the toolkit's own non-blocking MPI
calls completed by MPI's spinning Waitall, and "raw lent", raw into preallocated buffers, which shows what the
contract of new tensors costs any code (not part of the ratio; docs/results/benchmarks.md: a receive buffer new
each call cost raw as much as preallocated ones taken in turn, memory not warm in the cache; the exchange's `out=`
avoids it, the average has no such form). Every implementation's last result is held until its own next call, as a
caller keeps it. Each time is the slowest rank's, median over `--reps` repetitions (more for the smaller sizes) after
warm-up; toolkit and raw repetitions alternate so that drift affects both. Targets: the toolkit at most 1.20x raw
below 11 MiB (latency-bound), at most 1.05x from 11 MiB up. Beside each: the physical floor, the bytes one rank sends
divided by the loopback bandwidth measured in the same run.
"""

from __future__ import annotations

from dpsgd.comm.netem import ring_allreduce_bytes
from experiments.bench import cli, harness, ranks

SMALL_LIMIT, LARGE_LIMIT, LARGE_MB = 1.20, 1.05, 11  # toolkit / raw: below 11 MiB, and from 11 MiB up


def limit_for(mb: float) -> float:
    """Small messages are latency-bound (the toolkit's waits cost a share); large ones bandwidth-bound."""
    return LARGE_LIMIT if mb >= LARGE_MB else SMALL_LIMIT


# neighbor_exchange_out: the exchange receiving into buffers the caller lends (`out=`), as raw receives into its
# preallocated ones; neighbor_exchange: its default form, returning new buffers (as raw then does: RAW below)
OPS = ("neighbor_exchange", "neighbor_exchange_out", "neighbor_average", "allreduce_mean")
BACKENDS = ("mpi", "torch")
# the communicators closed before the ranks finish: the torch group goes down at exit (its close() ends it for all)
CLOSED_HERE = ("mpi",)


def reps_for(mb: float, reps: int, largest: float) -> int:
    """`reps` at the largest size; smaller (faster) sizes get more, up to 5x."""
    return int(min(5 * reps, max(reps, round(reps * largest / mb))))


# --- inside the ranks ---------------------------------------------------------------------


def _raw_mpi(raw, x, left, right):
    """mpi's blocking calls: (exchange(into), allreduce(out)), each returning where it wrote."""
    from mpi4py import MPI

    n, xb = raw.Get_size(), x.numpy()

    def exchange(into):
        raw.Sendrecv(xb, dest=right, recvbuf=into[0].numpy(), source=left)
        raw.Sendrecv(xb, dest=left, recvbuf=into[1].numpy(), source=right)
        return into

    def allreduce(out):
        raw.Allreduce(xb, out.numpy(), op=MPI.SUM)
        return out.div_(n)

    return exchange, allreduce


def _raw_mpi_nonblocking(raw, x, left, right):
    """mpi only: the toolkit's own MPI calls (Irecv/Isend, in-place Iallreduce) written by hand, completed by MPI's
    Waitall, which spins and progresses the transfer continuously. Beside raw (blocking calls) and the toolkit (the
    same calls, completed by its polls), it splits a miss into what MPI's non-blocking path costs and what the
    toolkit's waiting and layers cost."""
    from mpi4py import MPI

    n, xb = raw.Get_size(), x.numpy()

    def exchange(into):
        reqs = [raw.Irecv(into[0].numpy(), source=left), raw.Irecv(into[1].numpy(), source=right)]
        reqs += [raw.Isend(xb, dest=left), raw.Isend(xb, dest=right)]
        MPI.Request.Waitall(reqs)
        return into

    def allreduce(out):
        out.copy_(x)
        raw.Iallreduce(MPI.IN_PLACE, out.numpy(), op=MPI.SUM).Wait()
        return out.div_(n)

    return exchange, allreduce


def _raw_torch(raw, x, left, right):
    """torch.distributed's calls: (exchange(into), allreduce(out))."""
    import torch.distributed as dist

    n = raw.Get_size()

    def exchange(into):
        ops = [
            dist.P2POp(dist.irecv, into[0], left),
            dist.P2POp(dist.irecv, into[1], right),
            dist.P2POp(dist.isend, x, left),
            dist.P2POp(dist.isend, x, right),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return into

    def allreduce(out):
        out.copy_(x)
        dist.all_reduce(out)
        return out.div_(n)

    return exchange, allreduce


# the raw implementations, each made of one backend's calls: raw, its blocking calls by hand, and raw_nb, mpi's
# non-blocking calls completed by MPI's spinning Waitall (torch's raw calls are already the toolkit's), both returning
# new tensors as the toolkit's operations do (the same contract); raw_lent, raw into preallocated buffers, which the
# default forms do not use (the contract's own cost)
RAW = {
    ("mpi", "raw"): (_raw_mpi, True),
    ("mpi", "raw_nb"): (_raw_mpi_nonblocking, True),
    ("mpi", "raw_lent"): (_raw_mpi, False),
    ("torch", "raw"): (_raw_torch, True),
    ("torch", "raw_lent"): (_raw_torch, False),
}
# each backend's implementations, timed in this order: the toolkit, then its raw forms
IMPLS = {b: ("toolkit", *(impl for backend, impl in RAW if backend == b)) for b in BACKENDS}


def _raw_ops(calls, x, lent, left, right, nb, new_tensors: bool):
    """The toolkit's four operations written by hand with `calls` (exchange(into), allreduce(out)). `new_tensors`: each
    result in new tensors, as the toolkit's operations return them (the exchange its receive buffers, the average and
    the all-reduce a fresh result; the average receives into buffers it reuses, as the toolkit's does; the out=
    exchange into the lent ones); otherwise everything in the preallocated `lent` (out, from_left, from_right)."""
    import torch

    out, from_left, from_right = lent
    exchange, allreduce = calls
    first, second = (from_left, from_right) if left < right else (from_right, from_left)
    w_first, w_second = nb.recv[min(left, right)], nb.recv[max(left, right)]

    def result():  # where the all-reduce and the average write
        return torch.empty_like(x) if new_tensors else out

    def average():
        exchange((from_left, from_right))
        mixed = torch.mul(x, nb.self_weight, out=result())
        mixed.add_(first, alpha=w_first)  # rank order, as the toolkit sums
        return mixed.add_(second, alpha=w_second)

    return {
        "neighbor_exchange": lambda: exchange(
            (torch.empty_like(x), torch.empty_like(x)) if new_tensors else (from_left, from_right)
        ),
        "neighbor_exchange_out": lambda: exchange((from_left, from_right)),  # into lent buffers, in every form
        "neighbor_average": average,
        "allreduce_mean": lambda: allreduce(result()),
    }


def _as_list(result) -> list:
    """An operation's result as a list of tensors (an exchange returns several, the others one)."""
    return list(result) if isinstance(result, (list, tuple)) else [result]


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

        impls = {(backend, "toolkit"): _toolkit_ops(comms, backend, x, left, right, nb) for backend in BACKENDS}
        for (backend, impl), (calls, new_tensors) in RAW.items():
            made = calls(raw_mpi, x, left, right)
            impls[(backend, impl)] = {op: _raw_ops(made, x, buffers(), left, right, nb, new_tensors)[op] for op in OPS}

        # correctness first: every implementation returns what the hand-written code computes, on two calls, and
        # keeps its contract: where it returns new tensors (the toolkit's default forms, raw, raw nb) the second call's
        # share no memory with the first's, which the caller still holds; the out= exchange and raw lent return the
        # same buffers each call (filled with NaN between the out= calls, so that they must be written)
        agree, broken = {}, {}
        for backend in BACKENDS:
            for op in OPS:
                want = [t.clone() for t in _as_list(impls[(backend, "raw")][op]())]
                worst, broken[(backend, op)] = 0.0, []
                for impl in IMPLS[backend]:
                    first = _as_list(impls[(backend, impl)][op]())
                    worst = max(worst, _largest_difference(first, want))
                    if op == "neighbor_exchange_out":
                        for t in first:
                            t.fill_(float("nan"))
                    second = _as_list(impls[(backend, impl)][op]())
                    worst = max(worst, _largest_difference(second, want))
                    new = op != "neighbor_exchange_out" and (impl == "toolkit" or RAW[(backend, impl)][1])
                    if new != {t.data_ptr() for t in first}.isdisjoint(t.data_ptr() for t in second):
                        broken[(backend, op)].append(impl)
                agree[(backend, op)] = worst

        reps, warmup = reps_for(mb, args.reps, largest), args.warmup
        times = {(b, op, impl): [] for b in BACKENDS for op in OPS for impl in IMPLS[b]}  # (raw_lent of out=: none)
        faults, held = {k: [] for k in times}, {}
        for i in range(warmup + reps):
            for backend in BACKENDS:
                for op in OPS:
                    # alternate the order, so that drift and cache state favour none
                    order = [m for m in IMPLS[backend] if not (m == "raw_lent" and op == "neighbor_exchange_out")]
                    for impl in order if i % 2 == 0 else order[::-1]:
                        # each result held until the same implementation's next call, as a caller keeps it
                        dt, df, held[(backend, op, impl)] = ranks.timed(world, impls[(backend, impl)][op])
                        if i >= warmup:
                            times[(backend, op, impl)].append(dt)
                            faults[(backend, op, impl)].append(df)
        diffs = {k: ranks.slowest(world, [v])[0] for k, v in agree.items()}
        broken = {k: sorted(set().union(*world.allgather(v))) for k, v in broken.items()}  # on any rank
        del held
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
                        # raw into preallocated buffers: what the toolkit's contract (new tensors) costs raw code too;
                        # the out= exchange is raw itself (into lent buffers in every form)
                        "raw_lent_s": (
                            ranks.slowest_median(world, times[(backend, op, "raw_lent")])
                            if "raw_lent" in IMPLS[backend] and op != "neighbor_exchange_out"
                            else None
                        ),
                        "bytes_sent_per_rank": sent,
                        "floor_s": ranks.floor_s(sent, floor),
                        "max_abs_diff_vs_raw": diffs[(backend, op)],
                        "contract_broken_by": broken[(backend, op)],  # new tensors where kept ones were due, or back
                        "page_faults": {
                            impl: ranks.slowest_median(world, faults[(backend, op, impl)])
                            for impl in IMPLS[backend]
                            if faults[(backend, op, impl)]
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
    """Where a row's excess over raw went, from its own measurements. On mpi, two factors whose product is the ratio:
    MPI's non-blocking path (raw nb: the toolkit's MPI calls completed by MPI's spinning Waitall, against the blocking
    calls) and the toolkit's waits and wrapper (its polls, its Python layers: the toolkit against raw nb). On torch, the
    toolkit's own work in ms. Then what the operation's contract (new tensors) costs raw itself, which the ratio leaves
    out: raw against raw into preallocated buffers."""
    excess_ms = (row["toolkit_s"] - row["raw_s"]) * 1e3
    contract = ""
    if row["raw_lent_s"] is not None:  # (the out= exchange: into lent buffers in every form, raw's own contract)
        what, avoid = {  # and how a caller avoids it
            "neighbor_exchange": ("new receive buffers", "out= avoids it"),
            "allreduce_mean": ("a new result", "the in-place sum, start_allreduce_sum_, writes into yours"),
        }.get(row["op"], ("a new result", "the operation has no form that writes into yours"))
        price = row["raw_s"] / row["raw_lent_s"]
        contract = f"; not counted: raw / raw lent {price:.2f}x, " + (
            f"the price of {what} ({avoid})" if price > 1 else f"no price for {what} in this run"
        )
    if row["raw_nonblocking_s"] is None:
        return (
            f"the toolkit makes the same gloo calls as raw; its own work (flattening, staging copies, polls) costs "
            f"{excess_ms:.2f} ms a call{contract}"
        )
    path = row["raw_nonblocking_s"] / row["raw_s"]
    wrapper = row["toolkit_s"] / row["raw_nonblocking_s"]
    largest = "the toolkit's waits and wrapper" if wrapper >= path else "MPI's non-blocking calls"
    return (
        f"{row['ratio']:.2f}x = MPI's non-blocking calls {path:.2f}x (under MPI's spinning Waitall, against the "
        f"blocking ones) x the toolkit's waits and wrapper {wrapper:.2f}x; the largest: {largest}{contract}"
    )


# printed with every run: what a researcher's loop does to get vs lent's time
OWN_LOOP = (
    "In your own loop: neighbor_exchange(buf, send_to, recv_from, out=[...]) receives into tensors you allocate "
    "once (the neighbor_exchange_out row); start_allreduce_sum_(buf) sums in place into your buffer (divide by the "
    "world size for the mean; not timed here); neighbor_average returns a new tensor (no form writes into yours)."
)


def options(p) -> None:
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 11, 44], help="MiB of float32 parameters")


def run(args) -> harness.Result:
    if args.peers < 3:
        raise SystemExit("error: comm_overhead: --peers must be at least 3 (a ring with two distinct neighbours)")
    res = ranks.spawn(args)
    rows, floor = res["rows"], res["floor"]
    res["return_freed_memory"] = args.return_freed_memory
    for r in rows:  # against code into buffers allocated once (the out= exchange's raw is that code itself)
        r["vs_lent"] = r["toolkit_s"] / (r["raw_s"] if r["raw_lent_s"] is None else r["raw_lent_s"])
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
    columns = ["backend", "op", "MiB", "reps", "toolkit ms", "raw ms", "raw nb ms", "raw lent ms", "ratio", "vs lent"]
    harness.print_table(
        [*columns, "floor ms", "toolkit/floor", "faults tk/raw", "target"],
        [
            [
                r["backend"],
                r["op"],
                f"{r['mb']:g}",
                r["reps"],
                r["toolkit_s"] * 1e3,
                r["raw_s"] * 1e3,
                r["raw_nonblocking_s"] * 1e3 if r["raw_nonblocking_s"] is not None else "-",
                r["raw_lent_s"] * 1e3 if r["raw_lent_s"] is not None else "-",
                r["ratio"],
                r["vs_lent"],
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
        f"2(n-1)/n M) / that bandwidth.\nraw: the same calls written by hand, keeping the operation's contract (new "
        f"tensors where the toolkit returns new ones; for neighbor_exchange_out, the caller's buffers); raw nb: the "
        f"toolkit's own non-blocking MPI calls by hand, under MPI's Waitall; raw lent: raw into buffers allocated "
        f"once. ratio: toolkit / raw, the target: <= {SMALL_LIMIT:g} below {LARGE_MB} MiB, <= {LARGE_LIMIT:g} from "
        f"{LARGE_MB} MiB up; vs lent: toolkit / raw lent, no target (for neighbor_exchange_out the ratio itself). "
        f"faults: page faults per call (slowest rank, median); a fresh buffer faults once per 4 KiB page, memory the "
        f"allocator reuses does not (0 does not mean new tensors are free: see raw lent).\n{OWN_LOOP}"
    )
    bad = [r for r in rows if r["max_abs_diff_vs_raw"] > 1e-5]
    problems = [f"toolkit and raw results differ: {[(r['backend'], r['op'], r['mb']) for r in bad]}"] if bad else []
    problems += [
        f"{r['backend']} {r['op']} {r['mb']:g} MiB: {', '.join(r['contract_broken_by'])} did not keep the operation's "
        f"contract (new tensors each call: the default forms, raw, raw nb; the same buffers: out=, raw lent)"
        for r in rows
        if r["contract_broken_by"]
    ]
    return harness.Result(res, targets, problems)


main = cli.entry("comm_overhead")


if __name__ == "__main__":
    raise SystemExit(main())
