"""How many peers fit on one GPU? `python -m experiments.bench fleet_gpu [--device cuda] [--max-peers 4096]`

The fleet (dpsgd.sim.Fleet, backend=fleet) runs n peers of D-PSGD (one_peer_exponential, momentum SGD)
on ResNet-20 with CIFAR-shaped synthetic data (3 x 32 x 32, 10 classes; conf/data/synthetic_cifar.yaml),
`--batch-size` images per peer per step, for n = 64, 128, ... `--max-peers`. Each n: warm-up steps, then
`--steps` timed steps (the device synchronized before and after). Reported per n: steps per second
(every peer takes one step), peer-steps per second (n x that), seconds per step and the device memory
peak. The ladder stops at the first n that runs out of memory, takes longer than `--step-limit-s` per
step, or would pass `--budget-s` in all; the answer is the largest n at >= 1 step per second.
"""

from __future__ import annotations

import time

import torch

from experiments.bench import cli, harness


def config(peers: int, batch_size: int, device: str, samples: int) -> dict:
    """experiments.bench.fleet's config with ResNet-20 on CIFAR-shaped synthetic data, on `device`."""
    run = harness.fleet_overrides(peers, batch_size, "synthetic_cifar", num_samples=samples)
    return harness.run_config(*run, "model=resnet20", f"device={device}")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(peers: int, batch_size: int, device: str, samples: int, steps: int, warmup: int = 2) -> dict:
    """One rung: the fleet of `peers` built, warmed up and timed."""
    from dpsgd.sim import Fleet

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    built = time.perf_counter()
    fleet = Fleet(config(peers, batch_size, device, samples))
    built = time.perf_counter() - built
    for _ in range(warmup):
        fleet.step()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fleet.step()
    _sync(device)
    per_step = (time.perf_counter() - t0) / steps
    row = {
        "peers": peers,
        "steps_per_s": 1 / per_step,
        "peer_steps_per_s": peers / per_step,
        "s_per_step": per_step,
        "build_s": built,
    }
    if device.startswith("cuda"):
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del fleet
    return row


def scan(
    device: str,
    ladder: list[int],
    batch_size: int = 8,
    steps: int = 3,
    step_limit_s: float = 5.0,
    budget_s: float = 90.0,
) -> dict:
    """The ladder of fleet sizes, stopped as the module's docstring says: rows, why it stopped, the answer."""
    # one dataset for every rung, sized for the largest (the training split, 80%, gives each peer a batch)
    samples = max(200, int(max(ladder) * batch_size / 0.8) + max(ladder))
    rows, stopped, start = [], "the ladder's end", time.monotonic()
    for n in ladder:
        # the next rung costs about twice the last one: building its fleet, 2 warm-up steps and the timed ones
        expected = 2 * (rows[-1]["build_s"] + rows[-1]["s_per_step"] * (steps + 2)) if rows else 0.0
        if time.monotonic() - start + expected > budget_s:
            stopped = f"n={n} would pass the {budget_s:g} s budget"
            break
        try:
            row = measure(n, batch_size, device, samples, steps)
        except torch.cuda.OutOfMemoryError:
            stopped = f"n={n} ran out of device memory"
            torch.cuda.empty_cache()
            break
        rows.append(row)
        print(
            f"  {n:5d} peers: {row['steps_per_s']:8.2f} steps/s  {row['peer_steps_per_s']:10.1f} peer-steps/s"
            + (f"  {row['peak_memory_gib']:6.1f} GiB" if "peak_memory_gib" in row else ""),
            flush=True,
        )
        if row["s_per_step"] > step_limit_s:
            stopped = f"n={n} took {row['s_per_step']:.1f} s per step (limit {step_limit_s:g} s)"
            break
    fast = [r["peers"] for r in rows if r["steps_per_s"] >= 1]
    return {
        "device": device,
        "model": "resnet20",
        "batch_size": batch_size,
        "rows": rows,
        "stopped": stopped,
        "largest_n_at_1_step_per_s": max(fast) if fast else None,
    }


def options(p) -> None:
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--min-peers", type=int, default=64)
    p.add_argument("--max-peers", type=int, default=4096)
    p.add_argument("--step-limit-s", type=float, default=5.0)
    p.add_argument("--budget-s", type=float, default=90.0)


def run(args) -> harness.Result:
    ladder = [args.min_peers * 2**k for k in range(20) if args.min_peers * 2**k <= args.max_peers]
    print(f"fleet of ResNet-20 peers on {args.device}, {args.batch} CIFAR-shaped images per peer per step")
    result = scan(args.device, ladder, args.batch, args.steps, args.step_limit_s, args.budget_s)
    print(f"stopped: {result['stopped']}; largest n at >= 1 step/s: {result['largest_n_at_1_step_per_s']}")
    return harness.Result(result)


main = cli.entry("fleet_gpu")

if __name__ == "__main__":
    raise SystemExit(main())
