"""What the step module costs over torch's own idioms: `python -m experiments.bench step_work [--rounds 20]`

One process, one thread, an MLP (784-512-512-10, batch 64, float32 weights) stepping SGD through
`dpsgd.optim.AllReduce` on one peer (the algorithm's collectives are then no-ops, so what differs is the step
module's own work): `dpsgd.stepping.TrainStep` with each of the run's step options (a cosine schedule, gradient
clipping, bf16 and fp16 autocast, fp16's GradScaler with its overflow agreement, accumulation over micro-batches,
and all of them at once) against the same step written by hand with torch's idioms (CosineAnnealingLR,
torch.autocast, GradScaler, clip_grad_norm_, loss / k per micro-batch) on the same optimizer and batches.
Rounds alternate the two sides, so a loaded machine slows both alike; medians per step are reported.
Target: the step module at most 1.05x the hand-written step for each option. Checked beside it: from the same model on
the same batches, the two sides' parameters are bit-identical after 3 steps (else the benchmark fails).
"""

from __future__ import annotations

import statistics
import time

import torch

from experiments.bench import cli, harness

LIMIT = 1.05
OPTIONS = {  # variant -> (StepOptions keywords, schedule kind)
    "fp32": ({}, "constant"),
    "cosine schedule": ({}, "cosine"),
    "clip_grad_norm": ({"clip_grad_norm": 0.05}, "constant"),
    "bf16": ({"precision": "bf16"}, "constant"),
    "fp16 + scaler": ({"precision": "fp16"}, "constant"),
    "accumulate 2": ({"accumulate": 2}, "constant"),
    "all of them": ({"precision": "fp16", "clip_grad_norm": 1.0, "accumulate": 2}, "cosine"),
}
BATCH, INPUTS, CLASSES, POOL = 64, 784, 10, 8


class Batches:
    """A fixed pool of batches, drawn in turn (the step's data source)."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.pool = [
            (torch.randn(BATCH, INPUTS, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g))
            for _ in range(POOL)
        ]
        self.i = 0

    def next(self):
        self.i = (self.i + 1) % POOL
        return self.pool[self.i]


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(INPUTS, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, CLASSES),
    )  # fmt: skip


def optimizer(net: torch.nn.Module, comm):
    from dpsgd.optim import AllReduce

    return AllReduce(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), comm=comm)


def ours(variant: str, total: int, comm):
    """The step module's step (a callable taking one step) and its model."""
    from dpsgd.schedule import Schedule
    from dpsgd.stepping import StepOptions, Stepper, TrainStep

    keywords, kind = OPTIONS[variant]
    net = model(0)
    stepper = Stepper(StepOptions(**keywords), optimizer(net, comm), Schedule(kind, total), "cpu")

    def losses(x, y):
        return torch.nn.functional.cross_entropy(net(x), y)

    return TrainStep(stepper, Batches(1), losses, "cpu"), net


def by_hand(variant: str, total: int, comm):
    """The same step as a researcher writes it with torch's idioms, and its model."""
    keywords, kind = OPTIONS[variant]
    net, batches = model(0), Batches(1)
    opt = optimizer(net, comm)
    precision = keywords.get("precision", "fp32")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    clip, k = keywords.get("clip_grad_norm"), keywords.get("accumulate", 1)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, total) if kind == "cosine" else None

    def step():
        x, y = batches.next()
        opt.zero_grad()
        for xm, ym in zip(x.chunk(k), y.chunk(k)):
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                loss = torch.nn.functional.cross_entropy(net(xm), ym) / k
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if schedule is not None:
            schedule.step()

    return step, net


def same_steps(variant: str, steps: int = 3) -> float:
    """Both sides' steps from the same model on the same batches: max |difference| of the parameters after `steps`."""
    from dpsgd.comm import LocalCommunicator, LocalWorld

    comm = LocalCommunicator(LocalWorld(1), 0, 60.0)
    (a, net_a), (b, net_b) = ours(variant, 2 * steps, comm), by_hand(variant, 2 * steps, comm)
    for _ in range(steps):
        a(), b()
    return max(float((p - q).detach().abs().max()) for p, q in zip(net_a.parameters(), net_b.parameters()))


def measure(variant: str, rounds: int, steps: int) -> dict:
    from dpsgd.comm import LocalCommunicator, LocalWorld

    comm = LocalCommunicator(LocalWorld(1), 0, 60.0)
    total = rounds * steps + steps
    sides = {"ours": ours(variant, total, comm)[0], "torch": by_hand(variant, total, comm)[0]}
    for side in sides.values():  # warm-up
        for _ in range(steps):
            side()
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(rounds):
        for name in sorted(sides, reverse=r % 2 == 1):  # alternating which goes first
            started = time.perf_counter()
            for _ in range(steps):
                sides[name]()
            times[name].append((time.perf_counter() - started) / steps)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    interval = harness.ratio_interval(times["ours"], times["torch"])  # the run's noise (None from one round)
    return {"variant": variant, "ours_ms": ms["ours"], "torch_ms": ms["torch"], "ratio": ms["ours"] / ms["torch"],
            "own_work_ms": ms["ours"] - ms["torch"], "interval": interval}  # fmt: skip


def options(p) -> None:
    p.add_argument("--steps", type=int, default=5, help="steps per timed round of each side")


def run(args) -> harness.Result:
    torch.set_num_threads(1)
    rows = [{**measure(variant, args.rounds, args.steps), "max_param_difference": same_steps(variant)}
            for variant in OPTIONS]  # fmt: skip
    print(
        "both sides' parameters bit-identical after the same 3 steps: "
        + ("yes" if all(r["max_param_difference"] == 0 for r in rows) else "NO")
    )
    print(
        f"\nThe step module (TrainStep) against the same step by hand with torch's idioms, one thread, MLP "
        f"{INPUTS}-512-512-{CLASSES}, batch {BATCH}, AllReduce on one peer; median per step over {args.rounds} "
        "alternating rounds:\n"
    )
    harness.print_table(
        ["step option", "ours ms", "torch ms", "ratio", "own work ms"],
        [[r["variant"], r["ours_ms"], r["torch_ms"], r["ratio"], r["own_work_ms"]] for r in rows],
        floatfmt=".3f",
    )
    targets = [
        harness.Target(
            f"step module, {r['variant']} / by hand",
            r["ratio"],
            LIMIT,
            cause=f"the step module's own work costs {r['own_work_ms']:.3f} ms a step",
            interval=r["interval"],
        )  # fmt: skip
        for r in rows
    ]
    differ = [f"{r['variant']}: the two sides' parameters differ by {r['max_param_difference']:.3g} after the same "
              "steps" for r in rows if r["max_param_difference"] != 0]  # fmt: skip
    return harness.Result({"rows": rows}, targets, differ)


main = cli.entry("step_work")

if __name__ == "__main__":
    raise SystemExit(main())
