"""A benchmark's ranks: the driver spawns them (`spawn`: MPI processes that also form one gloo world), each runs
the benchmark's `worker(args)` with the driver's own options, rank 0 writes the result; and what the ranks
measure with: the slowest rank's times, page faults, and the physical floor (this machine's loopback bandwidth,
measured in the same run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from experiments.bench.harness import ROOT, BenchError

PORT_VAR = "DPSGD_BENCH_GLOO_PORT"
# glibc returns a freed large buffer to the kernel (munmap) and the next one page-faults in again, which on small
# and virtual machines costs several times a memcpy; spawned peers keep freed memory (dpsgd.backends.peer_env):
# `--return-freed-memory` runs the ranks with glibc's default instead
RETURN_FREED_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": None, "MALLOC_TRIM_THRESHOLD_": None}


def save_args(work: Path, args: argparse.Namespace, **extra) -> None:
    """The driver's options (and `extra` keys, e.g. what it measured) for the ranks, in WORK/args.json."""
    (work / "args.json").write_text(json.dumps({**vars(args), **extra}, default=str))


def worker_args(work: Path) -> argparse.Namespace:
    """In a rank: the driver's options, `worker` the folder rank 0 writes its result to."""
    return argparse.Namespace(**{**json.loads((work / "args.json").read_text()), "worker": work})


def spawn(args: argparse.Namespace, n: int | None = None, **extra) -> dict:
    """The benchmark's `worker(args)` on n MPI ranks (default `args.peers`) that also form a gloo world (see
    `init_ranks`); rank 0's result. `extra`: more keys of `args` for the ranks."""
    from dpsgd.backends import free_port
    from dpsgd.backends import spawn as spawn_processes

    n = args.peers if n is None else n
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {PORT_VAR: str(free_port()), "PYTHONPATH": path, "DPSGD_PROGRESS": "0"}
    env.update(RETURN_FREED_MEMORY_ENV if getattr(args, "return_freed_memory", False) else {})
    with tempfile.TemporaryDirectory(prefix=f"bench_{args.bench}_") as tmp:
        work = Path(tmp)
        save_args(work, args, **extra)
        argv = ["-m", "experiments.bench", args.bench, "--worker", str(work)]
        code = spawn_processes("mpi", n, argv, timeout_s=args.timeout, env=env)
        if code != 0:
            why = f"did not finish within {args.timeout:g} s (--timeout)" if code == 124 else f"exited with {code}"
            raise BenchError(f"the {n} ranks of {args.bench} {why}")
        return json.loads((work / "result.json").read_text())


def init_ranks(gloo: bool = True):
    """In a rank started by `spawn`: one torch thread, MPI, and (if `gloo`) the default torch.distributed group
    over the same ranks. Returns mpi4py's COMM_WORLD."""
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    if gloo:
        import torch.distributed as dist

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{os.environ[PORT_VAR]}",
            rank=world.Get_rank(),
            world_size=world.Get_size(),
        )
    return world


def init_comms():
    """`init_ranks()` plus the toolkit's communicators on both backends over the same ranks:
    (COMM_WORLD, rank, {"mpi": ..., "torch": ...})."""
    from dpsgd.comm import MPICommunicator, TorchCommunicator

    world = init_ranks()
    return world, world.Get_rank(), {"mpi": MPICommunicator(), "torch": TorchCommunicator()}


def finish_ranks(world, work: Path, result: dict) -> None:
    """Rank 0 writes the result; every rank leaves torch.distributed together."""
    import torch.distributed as dist

    if world.Get_rank() == 0:
        (work / "result.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    world.Barrier()


def slowest(world, seconds: list[float]) -> list[float]:
    """Per repetition, the largest value over the ranks: the slowest rank's time (every rank gets the list)."""
    import numpy as np
    from mpi4py import MPI

    mine = np.asarray(seconds, dtype=np.float64)
    out = np.empty_like(mine)
    world.Allreduce(mine, out, op=MPI.MAX)
    return out.tolist()


def slowest_median(world, seconds: list[float]) -> float:
    return median(slowest(world, seconds))


def timed(world, fn, *args):
    """`fn(*args)` after a barrier of every rank: (seconds it took here, page faults it made here, what it returned)."""
    world.Barrier()
    f0, t0 = page_faults(), time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, page_faults() - f0, out


def page_faults() -> int:
    """Page faults of this process so far (minor + major): a fresh large buffer costs one per 4 KiB page."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt


def median(xs: list[float]) -> float:
    return statistics.median(xs)


# --- the physical floor -------------------------------------------------------------------


def loopback_bandwidth(world, nbytes: int, reps: int = 10, warmup: int = 2) -> dict:
    """Bytes per second one rank sends to another on this machine while every rank does the same: ranks pair up
    (r with r ^ 1) and swap `nbytes` with one raw MPI Sendrecv (shared memory, preallocated buffers). A
    communication step that sends B bytes per rank cannot take less than B / bytes_per_s. Also a local memcpy of
    the same bytes, for scale."""
    import numpy as np
    import torch

    rank, size = world.Get_rank(), world.Get_size()
    peer = rank ^ 1
    send, recv = np.ones(nbytes // 4, dtype=np.float32), np.empty(nbytes // 4, dtype=np.float32)
    times = []
    for i in range(warmup + reps):
        world.Barrier()
        t0 = time.perf_counter()
        if peer < size:
            world.Sendrecv(send, dest=peer, recvbuf=recv, source=peer)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    a, b = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    copies = []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        b.copy_(a)
        if i >= warmup:
            copies.append(time.perf_counter() - t0)
    t, c = slowest_median(world, times), slowest_median(world, copies)
    return {
        "nbytes": nbytes,
        "sendrecv_s": t,
        "bytes_per_s": nbytes / t,
        "memcpy_s": c,
        "memcpy_bytes_per_s": nbytes / c,
        "pairs": size // 2,
        "reps": reps,
    }


def floor_s(nbytes_sent: float, floor: dict) -> float:
    """The least time to send `nbytes_sent` from one rank at the measured loopback bandwidth."""
    return nbytes_sent / floor["bytes_per_s"]


def floor_line(floor: dict) -> str:
    return (
        f"loopback floor: raw MPI Sendrecv of {floor['nbytes'] / 2**20:.0f} MiB between {floor['pairs']} pairs "
        f"of ranks at once: {floor['bytes_per_s'] / 1e9:.2f} GB/s per rank "
        f"(a local memcpy: {floor['memcpy_bytes_per_s'] / 1e9:.2f} GB/s)"
    )


# --- ranks on test hosts -------------------------------------------------------------------


def on_test_hosts(hosts, args: argparse.Namespace, n: int, per_host: int, port: int, timeout_s: float) -> dict:
    """The benchmark's `worker(args)` as n torch.distributed ranks on test hosts (tools/testhosts.py), rank r on host
    r // per_host + 1 with the master on host 1; rank 0's result. A failed rank raises BenchError naming it and
    its stderr's last lines. Every rank has ended on return."""
    from dpsgd.backends import peer_env

    base = {**peer_env(), "MASTER_ADDR": hosts.address(1), "MASTER_PORT": str(port), "WORLD_SIZE": str(n),
            "PYTHONPATH": str(ROOT), "DPSGD_PROGRESS": "0"}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix=f"bench_{args.bench}_") as tmp:
        work = Path(tmp)
        save_args(work, args)
        argv = [sys.executable, "-m", "experiments.bench", args.bench, "--worker", str(work)]
        procs = []
        try:
            for rank in range(n):
                env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank % per_host)}
                with open(work / f"r{rank}.err", "w") as err:
                    procs.append(hosts.popen(rank // per_host + 1, argv, cwd=ROOT, env=env, stderr=err))
            deadline = time.monotonic() + timeout_s
            for rank, p in enumerate(procs):
                code = p.wait(timeout=max(1.0, deadline - time.monotonic()))
                if code != 0:
                    err = (work / f"r{rank}.err").read_text()[-3000:]
                    raise BenchError(f"{args.bench}: rank {rank} (host {rank // per_host + 1}) failed ({code}):\n{err}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
        return json.loads((work / "result.json").read_text())
