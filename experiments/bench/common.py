"""What the benchmarks share: targets (a ratio measured side by side, its limit, whether it
holds), a plain-text table, the result JSON (date, machine, command line), the ranks' start-up
(MPI and a gloo world in the same processes) and the physical floor (loopback bandwidth of this
machine, measured in the same run).

A benchmark's driver spawns the ranks with `spawn_ranks`, which runs the benchmark module again
with `--worker DIR`; its ranks measure, rank 0 writes DIR/result.json, and the driver prints.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
PORT_VAR = "DPSGD_BENCH_GLOO_PORT"
# glibc returns a freed large buffer to the kernel (munmap) and the next one page-faults in again,
# which on small and virtual machines costs several times a memcpy; with these, freed memory is
# kept and reused (what jemalloc / tcmalloc do). Spawned peers run with them (dpsgd.backends.launch.peer_env);
# `--return-freed-memory` runs the ranks with glibc's default instead.
RETURN_FREED_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": None, "MALLOC_TRIM_THRESHOLD_": None}


@dataclass
class Target:
    """`ratio` (ours / reference, measured side by side) must be at most `limit`."""

    name: str
    ratio: float
    limit: float
    unit: str = "x"  # "" for a figure that is not a ratio (e.g. a parameter difference)

    @property
    def holds(self) -> bool:
        return self.ratio <= self.limit

    def as_dict(self) -> dict:
        return {**asdict(self), "holds": self.holds}

    def line(self) -> str:
        figure = f"{self.ratio:7.3f}x" if self.unit == "x" else f"{self.ratio:8.2g}{self.unit}"
        return f"{self.name:52s} {figure}  (target <= {self.limit:g}{self.unit})  {'PASS' if self.holds else 'MISS'}"


def print_table(headers: list[str], rows: list[list], floatfmt: str = ".2f") -> None:
    """Right-aligned plain text (first column left-aligned); floats formatted with `floatfmt`."""
    cells = [[format(c, floatfmt) if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]

    def fmt(row):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    print(fmt(headers))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print(fmt(r))


def machine() -> dict:
    import torch

    return {
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def write_result(path: Path, benchmark: str, result: dict, targets: list[Target], argv: list[str] | None) -> dict:
    """Write the benchmark's JSON: date, machine, command, targets, then the benchmark's own keys."""
    args = argv if argv is not None else sys.argv[1:]
    out = {
        "benchmark": benchmark,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": machine(),
        "command": f"python -m experiments.bench.{benchmark} " + " ".join(args),
        "targets": [t.as_dict() for t in targets],
        **result,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    return out


def print_targets(targets: list[Target]) -> None:
    print()
    for t in targets:
        print(t.line())


# --- ranks ------------------------------------------------------------------------------


def add_rank_options(parser) -> None:
    parser.add_argument(
        "--return-freed-memory",
        action="store_true",
        help="run the ranks with glibc's default of returning freed large buffers to the kernel "
        "(peers are spawned keeping them: MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_)",
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds for all the ranks' work")


def spawn_ranks(
    module: str, n: int, worker_argv: list[str], work: Path, timeout_s: float, return_freed_memory: bool = False
) -> dict:
    """Run `python -m experiments.bench.MODULE --worker WORK ...` on n MPI ranks which also form a
    gloo world (see `init_ranks`); return rank 0's WORK/result.json."""
    from dpsgd import backends
    from dpsgd.backends.launch import free_port

    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {
        PORT_VAR: str(free_port()),
        "PYTHONPATH": path,
        "DPSGD_PROGRESS": "0",
        **(RETURN_FREED_MEMORY_ENV if return_freed_memory else {}),
    }
    code = backends.spawn(
        "mpi",
        n,
        ["-m", f"experiments.bench.{module}", "--worker", str(work), *worker_argv],
        timeout_s=timeout_s,
        env=env,
    )
    if code != 0:
        why = f"did not finish within {timeout_s:g} s (--timeout)" if code == 124 else f"exited with {code}"
        raise SystemExit(f"error: the {n} ranks of experiments.bench.{module} {why}")
    return json.loads((work / "result.json").read_text())


def init_ranks(gloo: bool = True):
    """In a rank started by `spawn_ranks`: one torch thread, MPI, and (if `gloo`) the default
    torch.distributed group over the same ranks. Returns mpi4py's COMM_WORLD."""
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
    from dpsgd.comm.mpi import MPICommunicator
    from dpsgd.comm.torch_dist import TorchCommunicator

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


def page_faults() -> int:
    """Page faults of this process so far (minor + major): a fresh large buffer costs one per 4 KiB page."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt


def median(xs: list[float]) -> float:
    return statistics.median(xs)


# --- the physical floor -------------------------------------------------------------------


def loopback_bandwidth(world, nbytes: int, reps: int = 10, warmup: int = 2) -> dict:
    """Bytes per second one rank sends to another on this machine while every rank does the
    same: ranks pair up (r with r ^ 1) and swap `nbytes` with one raw MPI Sendrecv (shared
    memory, preallocated buffers). A communication step that sends B bytes per rank cannot
    take less than B / bytes_per_s. Also a local memcpy of the same bytes, for scale."""
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
    times = slowest(world, times)
    a, b = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    copies = []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        b.copy_(a)
        if i >= warmup:
            copies.append(time.perf_counter() - t0)
    copies = slowest(world, copies)
    t, c = median(times), median(copies)
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


def torch_ranks_on_test_hosts(
    hosts, argv: list[str], n: int, per_host: int, port: int, tmp: Path, timeout_s: float
) -> None:
    """Run `python ARGV` as n torch.distributed ranks on test hosts (tools/testhosts.py), rank r on host
    r // per_host + 1 with the master on host 1, rank r's stderr in tmp/r{r}.err; raise naming the first
    rank that failed. Every rank has ended on return."""
    from dpsgd.backends.launch import peer_env

    base = {**peer_env(), "MASTER_ADDR": hosts.address(1), "MASTER_PORT": str(port), "WORLD_SIZE": str(n),
            "PYTHONPATH": str(ROOT), "DPSGD_PROGRESS": "0"}  # fmt: skip
    procs = []
    try:
        for rank in range(n):
            env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank % per_host)}
            with open(tmp / f"r{rank}.err", "w") as err:
                procs.append(hosts.popen(rank // per_host + 1, [sys.executable, *argv], cwd=ROOT, env=env, stderr=err))
        deadline = time.monotonic() + timeout_s
        for rank, p in enumerate(procs):
            code = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            if code != 0:
                err = (tmp / f"r{rank}.err").read_text()[-3000:]
                raise RuntimeError(f"{argv[1]}: rank {rank} (host {rank // per_host + 1}) failed ({code}):\n{err}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def fleet_config(peers: int, batch_size: int, data: str = "digits", **data_options) -> dict:
    """A fleet run's config for the fleet benchmarks: D-PSGD on the one-peer exponential graph, the MLP, one epoch."""
    import yaml

    def load(group, name):
        return yaml.safe_load((ROOT / "conf" / group / f"{name}.yaml").read_text())

    return {
        "algorithm": load("algorithm", "dpsgd"),
        "topology": load("topology", "one_peer_exponential"),
        "model": load("model", "mlp"),
        "data": {**load("data", data), **data_options},
        "backend": {"name": "fleet"},
        "network": load("network", "loopback"),
        "peers": peers,
        "seed": 0,
        "epochs": 1,
        "batch_size": batch_size,
        "log_every": 1000,
        "device": "cpu",
        "comm": {"timeout_s": 600},
    }
