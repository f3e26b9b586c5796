"""What every fidelity harness here shares: the reference checkout's commit, a gloo world of n processes on
loopback (the only part of a reference's distributed set-up these harnesses supply), and the fixture file: an
.npz of numbers plus `meta`, a JSON string naming the repository, file, commit, inputs and the command.

These scripts import the authors' code from a checkout given on the command line; they are not part of the
package, and no reference code is copied here."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np


def commit(checkout: str) -> str:
    return subprocess.run(
        ["git", "-C", checkout, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, n: int, *args) -> None:
    """fn(rank, n, port, *args) on n processes, each in a gloo group of n on 127.0.0.1 (fn calls init)."""
    import torch.multiprocessing as mp

    mp.spawn(fn, args=(n, free_port(), *args), nprocs=n)


def init(rank: int, n: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)


def write(out: str, meta: dict, arrays: dict) -> None:
    meta = {**meta, "command": " ".join(["python", *sys.argv]), "python": sys.version.split()[0]}
    import torch

    meta["torch"] = torch.__version__
    np.savez_compressed(out, meta=np.array(json.dumps(meta, indent=1)), **arrays)
    print(out, {k: v.shape for k, v in arrays.items()}, os.path.getsize(out), "bytes")
