"""The c10d store of a torch.distributed world the app starts, listening on the master's address only.

torch's own rendezvous (`env://`) makes rank 0 a TCPStore server bound to every interface of its host. When the
world is ours (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, no torchrun agent, whose store is its own),
rank 0 binds the listening socket to MASTER_ADDR itself (127.0.0.1 for a run on one host, the first host's
address on several) and hands it to the server (`master_listen_fd`); the other ranks connect as clients.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch.distributed as dist


def master_store(timeout_s: float) -> dist.TCPStore | None:
    """This rank's store of the world its environment describes, the server bound to MASTER_ADDR; None when the
    environment does not describe one or a torchrun agent keeps the store (then torch's own rendezvous)."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env or not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    host, port, rank, world = env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["RANK"]), int(env["WORLD_SIZE"])
    timeout = timedelta(seconds=timeout_s)
    if rank != 0:
        return dist.TCPStore(host, port, world, False, timeout)
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(address)
    listener.listen(1024)
    return dist.TCPStore(host, port, world, True, timeout, wait_for_workers=False, master_listen_fd=listener.detach())
