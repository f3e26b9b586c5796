"""Alpha and beta of a real link, measured: ping-pong between 2 test hosts (tools/testhosts.py, root)
over gloo, message sizes 1 KB .. 16 MB; one-way time = alpha + M / beta (beta from the two largest
sizes, alpha the smallest's time) is written as a network preset (the `network` config keys, mode: model).

    python -m experiments.bench calibrate --rate 100mbit --preset conf/network/testhosts_100m.yaml

The rank on host 1 and the rank on host 2 each run this benchmark's worker; nothing but the two test hosts'
subnet carries the traffic.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from experiments.bench import cli, harness, ranks
from experiments.bench.harness import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import testhosts  # noqa: E402

SIZES = [2**k for k in range(10, 25, 2)]  # 1 KB .. 16 MB: past the tbf bucket at 1 Gbit/s
REPS = 5  # round trips per size; the fastest counts (the link's cost, not the scheduler's)
TIMEOUT_S = 180
PORT = 29431


def worker(args) -> None:
    """One of the two ranks: round trips of each size; rank 0 writes the one-way times."""
    from datetime import timedelta

    import torch.distributed as dist

    from dpsgd import netif

    netif.set_torch_interface(os.environ["MASTER_ADDR"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    rank = dist.get_rank()
    times = one_way_times(rank, 0, 1)
    dist.destroy_process_group()
    if rank == 0:
        (args.worker / "result.json").write_text(json.dumps(times))


def one_way_times(rank: int, a: int, b: int) -> dict[int, float]:
    """Ping-pong between ranks a and b of the default torch.distributed group (every rank calls it; the
    others only join the barriers): per size, the fastest of REPS round trips, halved. Meaningful on a."""
    import torch
    import torch.distributed as dist

    times = {}
    for size in SIZES:
        buf = torch.zeros(size, dtype=torch.uint8)
        best = float("inf")
        for _ in range(REPS + 1):  # the first round trip of a size warms the connection up
            dist.barrier()
            t0 = time.perf_counter()
            if rank == a:
                dist.send(buf, b)
                dist.recv(buf, b)
            elif rank == b:
                dist.recv(buf, a)
                dist.send(buf, a)
            best = min(best, (time.perf_counter() - t0) / 2)
        times[size] = best
    # b's last send returns once its socket holds the reply, not once a has it: whatever comes next (a
    # changed link cap) waits for a
    dist.barrier()
    return times


def fit(times: dict[int, float]) -> tuple[float, float]:
    """(alpha seconds, beta bytes/s): beta from the slope between the two largest sizes, alpha the time of
    the smallest. Not a least-squares line: tc tbf lets a burst (its bucket) through at line rate, so
    small and middle sizes sit below the capped line (a 1 KB message pays no M / beta) and would pull
    a fitted intercept to zero or below."""
    sizes = sorted(times)
    big, bigger = sizes[-2], sizes[-1]
    slope = (times[bigger] - times[big]) / (bigger - big)
    if slope <= 0:
        raise RuntimeError(f"calibrate: time does not grow with message size ({times}); the link was not measured")
    return times[sizes[0]], 1.0 / slope


def measure(hosts: testhosts.TestHosts, args) -> dict[int, float]:
    times = ranks.on_test_hosts(hosts, args, n=2, per_host=1, port=PORT, timeout_s=TIMEOUT_S)
    return {int(k): v for k, v in times.items()}


def preset(name: str, alpha: float, beta: float) -> str:
    return (
        f"# measured by experiments.bench.calibrate between 2 test hosts: ping-pong 1 KB .. 16 MB over gloo\n"
        f"name: {name}\nmode: model\nlatency_s: {alpha:.3e}\nbandwidth_bytes_per_s: {beta:.4e}\n"
        "jitter_s: 0.0\nslow_peers: []\ncompute_scale: 1.0\ncompute_time: 0.0\n"
    )


def options(p) -> None:
    p.add_argument("--rate", help="cap each host's link (tc tbf rate, e.g. 1gbit, 100mbit); default: none")
    p.add_argument("--preset", type=Path, help="write the network preset here (default: print it)")


def run(args) -> harness.Result:
    why = testhosts.unavailable()
    if why:
        raise SystemExit(f"error: calibrate: {why}")
    with testhosts.TestHosts(2, rate=args.rate) as hosts:
        times = measure(hosts, args)
    alpha, beta = fit(times)
    for size, t in sorted(times.items()):
        print(f"{size:>9} B  {t * 1e6:10.1f} us one way   model {(alpha + size / beta) * 1e6:10.1f} us")
    print(f"alpha {alpha * 1e6:.1f} us, beta {beta * 8 / 1e6:.1f} Mbit/s ({beta:.3e} bytes/s)")
    name = args.preset.stem if args.preset else f"testhosts_{args.rate or 'uncapped'}"
    text = preset(name, alpha, beta)
    if args.preset:
        args.preset.write_text(text)
        print(f"preset: {args.preset}")
    else:
        print(text)
    return harness.Result({"rate": args.rate, "one_way_s": times, "alpha_s": alpha, "beta_bytes_per_s": beta})


main = cli.entry("calibrate")

if __name__ == "__main__":
    raise SystemExit(main())
