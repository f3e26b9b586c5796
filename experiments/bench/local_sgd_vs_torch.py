"""`dpsgd.optim.LocalSGD` against torch's post-local SGD (PeriodicModelAverager + PostLocalSGDOptimizer).
`python -m experiments.bench local_sgd_vs_torch [--peers 4] [--period 4] [--warmup-steps 20] [--windows 30]`

On `--peers` real MPI processes that also form one gloo world, side by side in one run, the same
MLP on the same batches with SGD (momentum 0.9, each peer keeping its own momentum):
- ours: `LocalSGD(period, warmup_steps)` on the `torch` backend (the default gloo group), and on
  the `mpi` backend (shown, no target);
- torch's recipe: DDP with `post_localSGD_hook` (gradient all-reduce for the first
  `start_localSGD_iter` = warm-up steps, then none) and `PostLocalSGDOptimizer` with a
  `PeriodicModelAverager(period, warmup_steps + period - 1)`. torch's averager averages after the
  first local step and then every `period`; LocalSGD after `period` local steps (as the papers do),
  so torch's warm-up is shifted by period - 1 to average after exactly the same steps.

The warm-up steps alternate one at a time, then the local phase alternates windows of `period`
steps (each ending in one averaging); the first `--skip` warm-up steps are not timed. Per-step
times: the slowest rank's, median over the warm-up steps, and over the windows divided by the
period. Targets: ours at most 1.0x torch per step in each phase, and the same parameters after the
same steps: in float64 from a fresh model (a few warm-up steps, two periods), max |difference| at
most 1e-12. The timed float32 run's difference is shown too: it is exactly 0 without warm-up, but
torch's warm-up all-reduces DDP's gradient buckets where ours all-reduces one flat buffer, so the
sums round differently (about 1e-8 after a few steps, which training grows to about 1e-6 over a
hundred steps). Beside them, the floor: the bytes of a ring all-reduce of the model divided by the
loopback bandwidth measured in the same run.
"""

from __future__ import annotations

from experiments.bench import cli, harness, ranks
from experiments.bench.allreduce_vs_ddp import POOL, batches, finish, make_model  # allreduce_vs_ddp's task
from experiments.bench.steps import flat_params, train_step

LIMIT = 1.0
PARAM_TOLERANCE = 1e-12  # float64
VARIANTS = ("dpsgd_torch", "torch", "dpsgd_mpi")


def make_variant(name: str, args, comms: dict, dtype):
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dpsgd.optim import LocalSGD

    model = make_model(args, dtype)

    def sgd(params):
        return torch.optim.SGD(params, lr=args.lr, momentum=0.9)

    if name.startswith("dpsgd_"):
        comm = comms[name.removeprefix("dpsgd_")]
        return model, LocalSGD(sgd(model.parameters()), comm=comm, period=args.period, warmup_steps=args.warmup_steps)
    ddp = DDP(model)
    state = PostLocalSGDState(
        process_group=None, subgroup=None, start_localSGD_iter=args.warmup_steps, post_local_gradient_allreduce=False
    )
    ddp.register_comm_hook(state, post_localSGD_hook)
    averager = PeriodicModelAverager(period=args.period, warmup_steps=args.warmup_steps + args.period - 1)
    return ddp, PostLocalSGDOptimizer(optim=sgd(ddp.parameters()), averager=averager)


def check_parameters(args, comms, world) -> dict:
    """The same steps in float64 from a fresh model (up to 4 warm-up steps, then 2 periods):
    max |difference| of the parameters, slowest rank. float64, because in float32 DDP's bucketed
    warm-up all-reduce sums in another order than one flat buffer (differences of 1e-8 after a few
    steps, which training then grows); without warm-up float32 agrees exactly too."""
    import copy

    import torch

    short = copy.copy(args)
    short.warmup_steps = min(args.warmup_steps, 4)
    variants = {name: make_variant(name, short, comms, torch.float64) for name in VARIANTS}
    data = batches(world.Get_rank(), args.batch, args.seed + 1, torch.float64)
    steps = short.warmup_steps + 2 * args.period
    for k in range(steps):
        for module, opt in variants.values():
            train_step(module, opt, *data[k % POOL])
    final = {name: flat_params(module) for name, (module, _) in variants.items()}
    diffs = {
        "dpsgd_torch_vs_torch": float((final["dpsgd_torch"] - final["torch"]).abs().max()),
        "dpsgd_mpi_vs_torch": float((final["dpsgd_mpi"] - final["torch"]).abs().max()),
        "moved": float((final["torch"] - flat_params(make_model(args, torch.float64))).abs().max()),
    }
    return {
        "steps": steps,
        "warmup_steps": short.warmup_steps,
        **{k: ranks.slowest(world, [v])[0] for k, v in diffs.items()},
    }


def worker(args) -> None:
    import torch

    world, rank, comms = ranks.init_comms()
    check64 = check_parameters(args, comms, world)
    variants = {name: make_variant(name, args, comms, torch.float32) for name in VARIANTS}
    start = flat_params(variants["torch"][0])
    nparams = start.numel()
    floor = ranks.loopback_bandwidth(world, max(4 * nparams, 2**20), reps=args.floor_reps)
    data = batches(rank, args.batch, args.seed, torch.float32)

    def window(module, opt, first: int, steps: int) -> None:
        for k in range(first, first + steps):
            train_step(module, opt, *data[k % POOL])

    warm = {name: [] for name in VARIANTS}
    local = {name: [] for name in VARIANTS}
    windows = [(k, 1, warm) for k in range(args.warmup_steps)]
    windows += [(args.warmup_steps + w * args.period, args.period, local) for w in range(args.windows)]
    for i, (first, steps, into) in enumerate(windows):
        shift = i % len(VARIANTS)
        for name in VARIANTS[shift:] + VARIANTS[:shift]:
            module, opt = variants[name]
            dt, _, _ = ranks.timed(world, window, module, opt, first, steps)
            if into is local or first >= args.skip:
                into[name].append(dt / steps)

    final = {name: flat_params(module) for name, (module, _) in variants.items()}
    diffs = {
        "dpsgd_torch_vs_torch": float((final["dpsgd_torch"] - final["torch"]).abs().max()),
        "dpsgd_mpi_vs_torch": float((final["dpsgd_mpi"] - final["torch"]).abs().max()),
        "moved": float((final["torch"] - start).abs().max()),
    }
    # after the last averaging every peer holds the same model: a check that averaging happened
    everyone = torch.empty(world.Get_size(), nparams)
    world.Allgather(final["dpsgd_torch"].numpy(), everyone.numpy())
    diffs["dpsgd_torch_between_peers"] = float((everyone - everyone[0]).abs().max())
    check = {k: ranks.slowest(world, [v])[0] for k, v in diffs.items()}
    # per window, the slowest rank's time a step (the noise's samples), and their medians
    per_window = {
        phase: {name: ranks.slowest(world, t) if t else None for name, t in times.items()}
        for phase, times in (("warmup", warm), ("local", local))
    }
    step_s = {phase: {name: ranks.median(t) if t else None for name, t in w.items()} for phase, w in per_window.items()}
    finish(world, comms, args, nparams, floor, period=args.period, warmup_steps=args.warmup_steps, skip=args.skip,
           windows=args.windows, timed_warmup_steps=len(warm["torch"]), step_s=step_s, step_s_per_window=per_window,
           check=check, check_float64=check64)  # fmt: skip


def summarize(res: dict) -> list[harness.Target]:
    s, w = res["step_s"], res["step_s_per_window"]

    def interval(phase: str):
        return harness.ratio_interval(w[phase]["dpsgd_torch"], w[phase]["torch"])

    local = s["local"]["dpsgd_torch"] / s["local"]["torch"]
    targets = [harness.Target("LocalSGD / torch, local phase, per step", local, LIMIT, interval=interval("local"))]
    if s["warmup"]["torch"]:
        warmup = s["warmup"]["dpsgd_torch"] / s["warmup"]["torch"]
        name = "LocalSGD / torch, warm-up (all-reduce) step"
        targets.append(harness.Target(name, warmup, LIMIT, interval=interval("warmup")))
    c = res["check_float64"]
    targets.append(
        harness.Target(
            "parameters (float64): max |LocalSGD - torch|",
            max(c["dpsgd_torch_vs_torch"], c["dpsgd_mpi_vs_torch"]),
            PARAM_TOLERANCE,
            unit="",
        )
    )
    return targets


def options(p) -> None:
    p.add_argument("--hidden", type=int, nargs="+", default=[2048, 2048], help="MLP hidden widths (input 784)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--period", type=int, default=4)
    p.add_argument("--warmup-steps", type=int, default=20, help="all-reduce steps before the local phase")
    p.add_argument("--skip", type=int, default=3, help="untimed first warm-up steps")
    p.add_argument("--windows", type=int, default=30, help="timed local-phase windows of `period` steps")


def run(args) -> harness.Result:
    if args.windows < 1 or args.period < 1:
        raise SystemExit("error: local_sgd_vs_torch: --windows and --period must be at least 1")
    res = ranks.spawn(args)
    res["return_freed_memory"] = args.return_freed_memory
    targets = summarize(res)
    s = res["step_s"]
    print(
        f"\nPost-local SGD, period {args.period}, {args.warmup_steps} warm-up steps, MLP "
        f"784-{'-'.join(map(str, args.hidden))}-10 ({res['params'] / 1e6:.2f} M parameters), batch {args.batch} per "
        f"peer, {args.peers} MPI ranks (gloo in the same processes); slowest rank, median ms per step over "
        f"{res['timed_warmup_steps']} warm-up steps and {args.windows} windows of {args.period} local steps:\n"
    )
    rows = []
    for name, what in (
        ("dpsgd_torch", "LocalSGD, torch backend"),
        ("torch", "DDP+post_localSGD_hook, PostLocalSGDOptimizer"),
        ("dpsgd_mpi", "LocalSGD, mpi backend"),
    ):
        w = s["warmup"][name]
        rows.append(
            [
                name,
                w * 1e3 if w else "-",
                w / s["warmup"]["torch"] if w else "-",
                s["local"][name] * 1e3,
                s["local"][name] / s["local"]["torch"],
                what,
            ]
        )
    harness.print_table(["variant", "warm-up ms", "/ torch", "local ms", "/ torch", "what"], rows)
    print(
        f"\ncommunication floor: averaging sends {res['comm_bytes_sent_per_rank'] / 2**20:.1f} MiB per rank, "
        f"{res['comm_floor_s'] * 1e3:.2f} ms at the measured loopback bandwidth: {res['comm_floor_s'] * 1e3:.2f} ms "
        f"per warm-up step, {res['comm_floor_s'] / args.period * 1e3:.2f} ms per local step"
    )
    print(ranks.floor_line(res["floor"]))
    c, c64 = res["check"], res["check_float64"]
    print(
        f"parameters after the timed {args.warmup_steps + args.windows * args.period} steps (float32): max "
        f"|LocalSGD (torch) - torch| = {c['dpsgd_torch_vs_torch']:.1e}, |LocalSGD (mpi) - torch| = "
        f"{c['dpsgd_mpi_vs_torch']:.1e}; they moved {c['moved']:.1e}; peers after the last averaging differ by "
        f"{c['dpsgd_torch_between_peers']:.1e}"
    )
    print(
        f"parameters after {c64['steps']} steps in float64 ({c64['warmup_steps']} warm-up): max |LocalSGD (torch) - "
        f"torch| = {c64['dpsgd_torch_vs_torch']:.1e}, |LocalSGD (mpi) - torch| = {c64['dpsgd_mpi_vs_torch']:.1e}; "
        f"they moved {c64['moved']:.1e}"
    )
    return harness.Result(res, targets)


main = cli.entry("local_sgd_vs_torch")


if __name__ == "__main__":
    raise SystemExit(main())
