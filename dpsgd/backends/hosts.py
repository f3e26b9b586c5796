"""A run's peers on several hosts (`launcher.hosts=[node1,node2]`): the driver starts them itself (each
backend's `spawn` with a launcher, from the pieces here), so a user with ssh between nodes writes no mpiexec or
torchrun line.

How it works: docs/guide/internals.md#hosts.
"""

from __future__ import annotations

import os
import shlex
import sys

# what a remote peer inherits from the driver's environment (the runner starts it in a fresh one)
_FORWARD_PREFIXES = ("DPSGD_", "OMP_", "MALLOC_", "PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONHASHSEED")


def placement(hosts: list[str], n: int) -> list[str]:
    """The host of each rank: blocks in the order given, `host:k` holding k ranks, the others an equal share."""
    parsed = []
    for h in hosts:
        name, _, slots = str(h).partition(":")
        if not name or (slots and not slots.isdigit()):
            raise ValueError(f"launcher.hosts: {h!r} is not HOST or HOST:SLOTS (e.g. node1 or node1:2)")
        parsed.append((name, int(slots) if slots else None))
    fixed = sum(k for _, k in parsed if k is not None)
    free = [name for name, k in parsed if k is None]
    left = n - fixed
    if left < 0 or (free and left % len(free)) or (not free and left):
        raise ValueError(
            f"launcher.hosts={list(hosts)} cannot hold peers={n}: give slots that sum to {n}, or hosts "
            f"without slots that share the remaining {left} peers equally"
        )
    share = left // len(free) if free else 0
    return [name for name, k in parsed for _ in range(share if k is None else k)]


def forwarded(env: dict) -> dict:
    """The part of a peer's environment that crosses to another host."""
    return {k: v for k, v in env.items() if k.startswith(_FORWARD_PREFIXES)}


def runner(launcher: dict) -> list[str]:
    """The command that runs a shell line on a host (`launcher.runner`, ssh by default)."""
    return shlex.split(str(launcher.get("runner") or "ssh"))


def remote(runner: list[str], host: str, env: dict, argv: list[str]) -> list[str]:
    """The command line that runs `argv` (python arguments) on `host` in this folder with `env`, this interpreter."""
    pairs = [f"{k}={v}" for k, v in sorted(env.items())]
    line = f"cd {shlex.quote(os.getcwd())} && " + shlex.join(["env", *pairs, sys.executable, *argv])
    return [*runner, host, line]
