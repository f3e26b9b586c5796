"""A training step of `dpsgd.optim.AllReduce` against torch's DistributedDataParallel.
`python -m experiments.bench allreduce_vs_ddp [--peers 4] [--hidden 2048 2048] [--reps 40] [--quick]`

On `--peers` real MPI processes that also form one gloo world, side by side in one run, the same
MLP (`dpsgd.models`, `--hidden` widths) on the same batches, one SGD step (momentum 0.9) each:
`AllReduce` on the `torch` backend (the default gloo group) and on the `mpi` backend, DDP (gloo,
default 25 MiB buckets whose all-reduces overlap the backward pass), DDP with one bucket (its
all-reduce starts after the backward pass: no overlap, like AllReduce), and the same step with no
communication at all. Each time is the slowest rank's, median over `--reps` repetitions after
warm-up; the variants' steps alternate, in rotating order. Targets: `AllReduce(overlap=True)` (gradient
buckets of `--bucket-mb` MiB started as backward fills them) at most 1.0x DDP; AllReduce without overlap at
most 1.05x DDP with one bucket.
The gap that DDP's overlap explains is (DDP one bucket - DDP) / (AllReduce - DDP). Beside them:
the communication floor, the bytes of a ring all-reduce of the gradients divided by the loopback
bandwidth measured in the same run.

Correctness (in float64, from a fresh model, `--check-steps` steps): AllReduce on both backends,
DDP and one large-batch SGD on the union of the peers' batches give the same parameters.
"""

from __future__ import annotations

from dpsgd.comm.netem import ring_allreduce_bytes
from experiments.bench import cli, harness, ranks, steps
from experiments.bench.steps import flat_params, train_step

LIMIT = 1.05  # without overlap, against DDP without overlap (one bucket)
OVERLAP_LIMIT = 1.0  # AllReduce(overlap=True) against DDP (overlapping buckets)
VARIANTS = (
    "no_comm",
    "allreduce_torch",
    "allreduce_mpi",
    "allreduce_torch_overlap",
    "allreduce_mpi_overlap",
    "ddp",
    "ddp_one_bucket",
)
INPUTS, POOL = 784, 8  # the MLP's inputs; batches per peer, drawn in turn


# --- inside the ranks ---------------------------------------------------------------------


def batches(rank: int, batch: int, seed: int, dtype):
    """POOL (inputs, labels) batches of peer `rank`; any peer can make any peer's batches."""
    return steps.batches(rank, batch, INPUTS, seed, POOL, dtype)


def make_model(args, dtype):
    return steps.mlp(INPUTS, args.hidden, args.seed, dtype)


def make_variant(name: str, args, comms: dict, dtype):
    """(module to call, optimizer) for one variant, from the same initial model."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dpsgd.optim import AllReduce

    model = make_model(args, dtype)

    def sgd(params):
        return torch.optim.SGD(params, lr=args.lr, momentum=0.9)

    if name == "no_comm":
        return model, sgd(model.parameters())
    if name.startswith("allreduce_"):
        backend, _, overlap = name.removeprefix("allreduce_").partition("_")
        return model, AllReduce(
            sgd(model.parameters()), comm=comms[backend], overlap=overlap == "overlap", bucket_mb=args.bucket_mb
        )
    ddp = DDP(model, bucket_cap_mb=100_000) if name == "ddp_one_bucket" else DDP(model)
    return ddp, sgd(ddp.parameters())


def check_parameters(args, comms, world) -> dict:
    """Max |difference| of the parameters after `check_steps` steps (float64), slowest rank."""
    import torch

    rank, n = world.Get_rank(), world.Get_size()
    dtype = torch.float64
    mine = batches(rank, args.batch, args.seed + 1, dtype)
    got = {}
    for name in VARIANTS[1:]:
        module, opt = make_variant(name, args, comms, dtype)
        for k in range(args.check_steps):
            train_step(module, opt, *mine[k % POOL])
        got[name] = flat_params(module)
    # large-batch SGD on the union of the peers' batches, on every rank
    everyone = [batches(r, args.batch, args.seed + 1, dtype) for r in range(n)]
    big = make_model(args, dtype)
    opt = torch.optim.SGD(big.parameters(), lr=args.lr, momentum=0.9)
    for k in range(args.check_steps):
        train_step(
            big, opt, torch.cat([b[k % POOL][0] for b in everyone]), torch.cat([b[k % POOL][1] for b in everyone])
        )
    ref = flat_params(big)
    diffs = {f"{name}_vs_large_batch": float((p - ref).abs().max()) for name, p in got.items()}
    diffs["allreduce_torch_vs_ddp"] = float((got["allreduce_torch"] - got["ddp"]).abs().max())
    diffs["moved"] = float((ref - flat_params(make_model(args, dtype))).abs().max())  # the check is not vacuous
    return {k: ranks.slowest(world, [v])[0] for k, v in diffs.items()}


def worker(args) -> None:
    import torch

    world, rank, comms = ranks.init_comms()
    check = check_parameters(args, comms, world)

    variants = {name: make_variant(name, args, comms, torch.float32) for name in VARIANTS}
    nparams = sum(p.numel() for p in variants["no_comm"][0].parameters())
    floor = ranks.loopback_bandwidth(world, max(4 * nparams, 2**20), reps=args.floor_reps)
    data = batches(rank, args.batch, args.seed, torch.float32)
    times = {name: [] for name in VARIANTS}
    in_step = {name: [] for name in VARIANTS}
    faults = {name: [] for name in VARIANTS}
    for i in range(args.warmup + args.reps):
        x, y = data[i % POOL]
        shift = i % len(VARIANTS)
        for name in VARIANTS[shift:] + VARIANTS[:shift]:
            module, opt = variants[name]
            dt, df, step_s = ranks.timed(world, train_step, module, opt, x, y)
            if i >= args.warmup:
                times[name].append(dt)
                in_step[name].append(step_s)
                faults[name].append(df)
    slowest = {name: ranks.slowest(world, t) for name, t in times.items()}  # per repetition: the noise's samples
    medians = {name: ranks.median(t) for name, t in slowest.items()}
    # the part spent in opt.step() (slowest rank, median): splits a miss into backward (with its hooks) and step
    in_step_medians = {name: ranks.slowest_median(world, t) for name, t in in_step.items()}
    pf = {name: ranks.slowest_median(world, f) for name, f in faults.items()}
    timed = {"reps": args.reps, "warmup": args.warmup, "step_s": medians, "in_opt_step_s": in_step_medians,
             "step_s_per_rep": slowest}  # fmt: skip
    finish(
        world, comms, args, nparams, floor, **timed, page_faults_per_step=pf, check=check, check_steps=args.check_steps
    )


def finish(world, comms, args, nparams: int, floor: dict, **result) -> None:
    """The ranks' end (here and in local_sgd_vs_torch): the mpi communicator closed, rank 0 writes `result` with
    the model's size and the floor of a ring all-reduce of it."""
    comms["mpi"].close()
    sent = ring_allreduce_bytes(4 * nparams, world.Get_size())
    model = {"peers": world.Get_size(), "params": nparams, "hidden": args.hidden, "batch": args.batch}
    floors = {"floor": floor, "comm_bytes_sent_per_rank": sent, "comm_floor_s": ranks.floor_s(sent, floor)}
    ranks.finish_ranks(world, args.worker, {**model, **result, **floors})


# --- the driver ---------------------------------------------------------------------------


TARGET_PAIRS = (  # (ours, reference) of each target, in summarize's order
    ("allreduce_torch_overlap", "ddp"),
    ("allreduce_mpi_overlap", "ddp"),
    ("allreduce_torch", "ddp_one_bucket"),
    ("allreduce_mpi", "ddp_one_bucket"),
)


def miss_cause(res: dict, ours: str, theirs: str) -> str:
    """A step's excess over the reference, split by phase as measured: forward + backward (for AllReduce with
    overlap, its gradient hooks starting buckets; for DDP, its whole all-reduce) and opt.step() (for AllReduce,
    the wait for the all-reduce and the update; for DDP, the update alone)."""
    s, in_step = res["step_s"], res["in_opt_step_s"]
    before = {v: (s[v] - in_step[v]) * 1e3 for v in (ours, theirs, "no_comm")}
    after = {v: in_step[v] * 1e3 for v in (ours, theirs, "no_comm")}
    return (
        f"+{(s[ours] - s[theirs]) * 1e3:.2f} ms a step: forward+backward {before[ours]:.2f} against "
        f"{before[theirs]:.2f} ms, opt.step() {after[ours]:.2f} against {after[theirs]:.2f} ms (no communication: "
        f"{before['no_comm']:.2f} + {after['no_comm']:.2f} ms)"
    )


def summarize(res: dict) -> tuple[list[harness.Target], dict]:
    s = res["step_s"]
    names = {"ddp": "DDP", "ddp_one_bucket": "DDP one bucket"}
    targets = [
        harness.Target(
            f"AllReduce{' overlap' if ours.endswith('overlap') else ''} ({ours.split('_')[1]} backend) / "
            + names[theirs],
            s[ours] / s[theirs],
            OVERLAP_LIMIT if theirs == "ddp" else LIMIT,
            cause=miss_cause(res, ours, theirs),
            interval=harness.ratio_interval(res["step_s_per_rep"][ours], res["step_s_per_rep"][theirs]),
        )
        for ours, theirs in TARGET_PAIRS
    ]
    gap = s["allreduce_torch"] - s["ddp"]
    overlap = s["ddp_one_bucket"] - s["ddp"]
    derived = {
        "allreduce_torch_vs_ddp_one_bucket": s["allreduce_torch"] / s["ddp_one_bucket"],
        "allreduce_torch_overlap_gain_s": s["allreduce_torch"] - s["allreduce_torch_overlap"],
        "allreduce_mpi_overlap_gain_s": s["allreduce_mpi"] - s["allreduce_mpi_overlap"],
        "ddp_overlap_gain_s": overlap,
        "allreduce_gap_s": gap,
        "gap_explained_by_overlap": max(0.0, overlap) / gap if gap > 0 else None,
    }
    return targets, derived


def options(p) -> None:
    p.add_argument("--hidden", type=int, nargs="+", default=[2048, 2048], help="MLP hidden widths (input 784)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--bucket-mb", type=float, default=4.0, help="AllReduce's gradient buckets (MiB)")
    p.add_argument("--check-steps", type=int, default=5, help="steps of the float64 parameter check")


def run(args) -> harness.Result:
    res = ranks.spawn(args)
    res["return_freed_memory"] = args.return_freed_memory
    targets, derived = summarize(res)
    res["derived"] = derived
    s, ddp = res["step_s"], res["step_s"]["ddp"]
    print(
        f"\nOne training step, MLP 784-{'-'.join(map(str, args.hidden))}-10 ({res['params'] / 1e6:.2f} M parameters, "
        f"{4 * res['params'] / 2**20:.1f} MiB of gradients), batch {args.batch} per peer, {args.peers} MPI ranks "
        f"(gloo in the same processes); slowest rank, median of {args.reps}:\n"
    )
    notes = {
        "no_comm": "local step only",
        "allreduce_torch": "dpsgd AllReduce, torch backend",
        "allreduce_mpi": "dpsgd AllReduce, mpi backend",
        "allreduce_torch_overlap": f"AllReduce(overlap=True), {args.bucket_mb:g} MiB buckets, torch",
        "allreduce_mpi_overlap": f"AllReduce(overlap=True), {args.bucket_mb:g} MiB buckets, mpi",
        "ddp": "DDP, 25 MiB buckets overlapping backward",
        "ddp_one_bucket": "DDP, one bucket (no overlap)",
    }
    pf = res["page_faults_per_step"]
    harness.print_table(
        ["variant", "step ms", "/ DDP", "page faults", "what"],
        [[name, s[name] * 1e3, s[name] / ddp, f"{pf[name]:.0f}", notes[name]] for name in VARIANTS],
    )
    mib = res["comm_bytes_sent_per_rank"] / 2**20
    print(
        f"\ncommunication floor: a ring all-reduce of the gradients sends {mib:.1f} MiB per rank: "
        f"{res['comm_floor_s'] * 1e3:.2f} ms at the measured loopback bandwidth; step floor without "
        f"overlap: no_comm + that = {(s['no_comm'] + res['comm_floor_s']) * 1e3:.1f} ms"
    )
    print(ranks.floor_line(res["floor"]))
    gain, gap = derived["ddp_overlap_gain_s"] * 1e3, derived["allreduce_gap_s"] * 1e3
    if derived["gap_explained_by_overlap"] is not None:
        explained = (
            f"explains {100 * derived['gap_explained_by_overlap']:.0f}% of it"
            if gain > 0
            else f"explains none of it (DDP with one bucket is {-gain:.2f} ms faster than with overlap)"
        )
        print(
            f"AllReduce (torch) is {gap:.2f} ms behind DDP; DDP's overlap (one bucket - default: {gain:.2f} ms) "
            f"{explained}; AllReduce / DDP one bucket = {derived['allreduce_torch_vs_ddp_one_bucket']:.3f}"
        )
    c = res["check"]
    print(
        f"\nparameters after {res['check_steps']} steps (float64), max |difference| against large-batch SGD: "
        + ", ".join(f"{k.removesuffix('_vs_large_batch')} {v:.1e}" for k, v in c.items() if k.endswith("large_batch"))
        + f"; AllReduce vs DDP {c['allreduce_torch_vs_ddp']:.1e} (the parameters moved {c['moved']:.1e})"
    )
    return harness.Result(res, targets)


main = cli.entry("allreduce_vs_ddp")


if __name__ == "__main__":
    raise SystemExit(main())
