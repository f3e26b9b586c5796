"""How much faster is the fleet? `python -m experiments.bench fleet [--peers 64] [--steps 30]`

1. 64 peers of D-PSGD (one_peer_exponential) train the small MLP on digits, once as the `local`
   backend's threads (dpsgd.training's peers: the reference) and once as the fleet (dpsgd.sim.Fleet),
   same config and seed: training steps per second of each (every peer takes one step), and their ratio
   (target: the fleet >= 10x).
2. The fleet alone at n = 64, 128, 256, ... peers (until one runs under 10 steps/s, or at the sizes
   `--scan-peers` names) with the same model (64 inputs, MLP [64], 10 classes) and 16 samples per peer per
   step, on synthetic data of as many samples as the peers need (digits has 1437 training samples: 1024 peers
   would get one each): the largest n at >= 10 steps/s (target: 8,192). Each size runs in a process of its own
   (its peak resident memory is reported) after a warm-up over the topology's period; alongside it, one model
   at batch n*b (the same arithmetic, experiments.bench.fleet_vs_batch's reference) and the fleet's step split
   into its phases, from which a miss names its cause.
Times are measured after warm-up steps, best of `--repeats` alternated runs (other processes on a shared
machine only ever slow a run down); metrics and evaluation are not included (only training steps). Both
use every core: the local backend's peers are threads (one torch thread each, running in parallel while
torch releases the GIL), the fleet's operations use torch's intra-op threads (one per core). The scan's
`--scan-threads 1` times it by this thread's CPU time instead, so that other sessions' load is not counted.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import resource
import time

import torch

from dpsgd.build import build_peer
from dpsgd.comm import run_local
from dpsgd.config import RunConfig
from dpsgd.sim import Fleet
from experiments.bench import cli, harness

RATIO_TARGET, RATE_TARGET, N_TARGET = 10.0, 10.0, 8192


def local_rate(cfg: RunConfig, steps: int, warmup: int = 3) -> float:
    """Steps per second of the local backend's peers (the slowest peer's clock)."""

    def peer(comm):
        p = build_peer(comm, cfg)
        for _ in range(warmup):
            p.step()
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            p.step()
        comm.barrier()
        return time.perf_counter() - t0

    return steps / max(run_local(cfg.peers, peer, timeout_s=600))


def fleet_rate(cfg: RunConfig, steps: int, warmup: int = 3) -> float:
    """Steps per second of the fleet, its operations on every core (as the local backend's threads are), after
    a warm-up that covers the topology's period (its mixing matrices are made once per step of the period)."""
    fleet = Fleet(cfg)
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        for _ in range(max(warmup, fleet.topology.period or 0)):
            fleet.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            fleet.step()
        return steps / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(1)


def scan_config(n: int, batch_size: int) -> dict:
    samples = int(n * batch_size / 0.8) + n  # the training split (80%) gives each peer a batch
    data = {"num_samples": samples, "num_features": 64, "num_classes": 10}
    return harness.run_config(*harness.fleet_overrides(n, batch_size, "synthetic", **data))


def scan_point(n: int, batch_size: int, steps: int, repeats: int, threads: int) -> dict:
    """One size of the scan, in a process of its own: the fleet's steps per second (best of `repeats`,
    alternated with one model at batch n*b), its phases, the process's peak resident memory."""
    from experiments.bench.fleet_vs_batch import Clock, Reference, fleet_phases

    torch.set_num_threads(threads or os.cpu_count() or 1)
    clock = Clock(torch.device("cpu"))
    started = time.perf_counter()
    fleet = Fleet(scan_config(n, batch_size))
    built_s = time.perf_counter() - started
    for _ in range(max(3, fleet.topology.period or 0)):  # every mixing matrix of the period made
        fleet.step()
    opt = fleet.config.optimizer.options
    ref = Reference(fleet, float(opt["lr"]), float(opt.get("momentum", 0.0)))
    ref.train_step()
    best = {"fleet": float("inf"), "reference": float("inf")}
    for _ in range(repeats):
        for side, step in (("fleet", fleet.step), ("reference", ref.train_step)):
            t0 = clock()
            for _ in range(steps):
                step()
            best[side] = min(best[side], (clock() - t0) / steps)
    return {
        "peers": n,
        "steps_per_s": 1 / best["fleet"],
        "reference_steps_per_s": 1 / best["reference"],
        "phases_s": fleet_phases(fleet, clock, steps),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "built_s": built_s,
        "clock": clock.label,
    }


def scan_cause(point: dict, batch_size: int) -> str:
    """Why `point` runs under RATE_TARGET steps/s: its phases and the same arithmetic's rate."""
    ph = point["phases_s"]
    parts = ", ".join(f"{name} {ph[key] * 1e3:.0f} ms" for key, name in (
        ("batch", "batch draw"), ("forward_backward", "forward+backward"), ("gossip", "gossip"),
        ("optimizer", "the rest of the algorithm's step")))  # fmt: skip
    ref = point["reference_steps_per_s"]
    beyond = " (the same arithmetic alone is under the target)" if ref < RATE_TARGET else ""
    return (
        f"{point['peers']} peers run {point['steps_per_s']:.2f} steps/s ({1e3 / point['steps_per_s']:.0f} ms: "
        f"{parts}); one model at batch {point['peers'] * batch_size} runs {ref:.2f} steps/s{beyond}"
    )


def scan(sizes, batch_size: int, steps: int, repeats: int, threads: int, stop_below: bool) -> list[dict]:
    """scan_point for each size in a fresh process (glibc keeping freed buffers, as spawned peers do)."""
    from dpsgd.backends import peer_env

    os.environ.update({k: v for k, v in peer_env().items() if k.startswith("MALLOC_")})
    points = []
    for n in sizes:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
            point = pool.submit(scan_point, n, batch_size, steps, repeats, threads).result()
        points.append(point)
        print(
            f"  {n:5d} peers: {point['steps_per_s']:8.2f} steps/s (one model at batch {n * batch_size}: "
            f"{point['reference_steps_per_s']:.2f}), peak memory {point['peak_rss_bytes'] / 2**30:.2f} GiB",
            flush=True,
        )
        if stop_below and point["steps_per_s"] < RATE_TARGET:
            break
    return points


def options(p) -> None:
    p.add_argument("--max-peers", type=int, default=8192, help="where the scan stops")
    p.add_argument("--scan-peers", type=int, nargs="+", help="scan these sizes (all of them) instead of doubling")
    p.add_argument("--scan-threads", type=int, default=0, help="torch threads of the scan (0: every core)")
    p.add_argument("--scan-only", action="store_true", help="skip the fleet-vs-local comparison")


def run(args) -> harness.Result:
    torch.set_num_threads(1)
    targets = []
    local = fleet = ratio = float("nan")
    if not args.scan_only:
        cfg = harness.run_config(*harness.fleet_overrides(args.peers, args.batch))
        local = fleet = 0.0
        for _ in range(args.repeats):  # alternated, best of each: other processes only slow a run down
            local = max(local, local_rate(cfg, args.steps))
            fleet = max(fleet, fleet_rate(cfg, 5 * args.steps))
        ratio = fleet / local
        print(f"{args.peers} peers, D-PSGD one_peer_exponential, MLP [64] on digits, batch {args.batch} per peer")
        print(f"  local backend (threads): {local:8.2f} steps/s")
        print(f"  fleet (vectorized):      {fleet:8.2f} steps/s")
        targets.append(harness.Target(f"fleet / local backend, {args.peers} peers", ratio, at_least=RATIO_TARGET))

    print(f"fleet scan: same model, {args.batch} samples per peer per step (synthetic data, 64 features)")
    ladder = args.scan_peers or [64 * 2**k for k in range(20) if 64 * 2**k <= args.max_peers]
    points = scan(ladder, args.batch, args.steps, 2, args.scan_threads, stop_below=not args.scan_peers)
    fast = [p["peers"] for p in points if p["steps_per_s"] >= RATE_TARGET]
    best = max(fast) if fast else None
    cause = None
    if best is None or best < N_TARGET:  # the cause, measured at the target's size or the first size under the rate
        slow = [p for p in points if p["steps_per_s"] < RATE_TARGET]
        at = next((p for p in points if p["peers"] == N_TARGET), slow[0] if slow else None)
        cause = scan_cause(at, args.batch) if at is not None else "the target's size was not run"
    name = f"largest fleet at >= {RATE_TARGET:g} steps/s, peers"
    targets.append(harness.Target(name, float(best or 0), at_least=N_TARGET, unit="", cause=cause))
    print(f"[{points[0]['clock'] if points else ''}; load {os.getloadavg()[0]:.2f}]")
    result = {
        "peers": args.peers,
        "local_steps_per_s": local,
        "fleet_steps_per_s": fleet,
        "ratio": ratio,
        "scan": points,
        "largest_n_at_10_steps_per_s": best,
    }
    return harness.Result(result, targets)


main = cli.entry("fleet")

if __name__ == "__main__":
    raise SystemExit(main())
