"""One peer of the soak test: a small model trained with D-PSGD for many steps, measuring its own
resident memory, threads and open files, and whether every message it was sent was received.

Imported by tests/test_soak.py (the local backend) and run under mpiexec:
`python tests/peers/soak_peer.py mpi OUT_DIR STEPS` writes OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import torch

import topologies
from dpsgd.metrics import gather_scalars
from dpsgd.optim import DPSGD

WARMUP_FRACTION = 0.1  # memory is compared between the end of warm-up and the end of the run


def rss_kib() -> int:
    """This process's resident memory (VmRSS of /proc/self/status), KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status (soak measurements need Linux)")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def soak(comm, steps: int, topology: str = "ring") -> dict:
    """Train for `steps`; return this peer's measurements (rank 0's process-wide ones are what the
    local backend reports, its peers being threads of one process)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = DPSGD(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        topology=topologies.make(topology, comm.size),
        comm=comm,
    )
    gen = torch.Generator().manual_seed(comm.rank)
    x, y = torch.randn(64, 16, generator=gen), torch.randn(64, 1, generator=gen)
    warmup = max(1, int(steps * WARMUP_FRACTION))
    comm.barrier()
    before = {"threads": threading.active_count(), "fds": open_fds()}
    rss_warm = None
    for step in range(1, steps + 1):
        comm.context = f"step {step}"
        i = (step * 8) % 64
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[i : i + 8]), y[i : i + 8]).backward()
        opt.step()
        if step == warmup:
            comm.barrier()
            rss_warm = rss_kib()
    comm.barrier()
    rss_end = rss_kib()
    after = {"threads": threading.active_count(), "fds": open_fds()}
    traffic = gather_scalars(comm, [comm.stats.messages_sent, comm.stats.bytes_sent, comm.stats.bytes_received])
    return {
        "rank": comm.rank,
        "steps": steps,
        "warmup_steps": warmup,
        "rss_warm_kib": rss_warm,
        "rss_end_kib": rss_end,
        "threads_before": before["threads"],
        "threads_after": after["threads"],
        "fds_before": before["fds"],
        "fds_after": after["fds"],
        "messages_sent_total": int(traffic[:, 0].sum()),
        "bytes_sent_total": int(traffic[:, 1].sum()),
        "bytes_received_total": int(traffic[:, 2].sum()),
        "unmatched_messages": unmatched_messages(comm),
    }


def unmatched_messages(comm) -> int:
    """Messages sent to this peer that nobody received (all peers are past a barrier)."""
    if comm.backend == "local":
        return sum(q.qsize() for (src, dst, _), q in list(comm.world._queues.items()) if dst == comm.rank)
    if comm.backend == "mpi":
        MPI, count = comm._MPI, 0
        while comm._comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG):
            count += 1
            if count > 1000:
                break
        return count
    raise ValueError(f"no unmatched-message count for backend {comm.backend}")


if __name__ == "__main__":
    import json

    import dpsgd.comm

    torch.set_num_threads(1)
    backend, out_dir, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    comm = dpsgd.comm.init(backend, timeout_s=60)
    result = soak(comm, steps)
    (out_dir / f"rank{comm.rank}.json").write_text(json.dumps(result))
    comm.close()
