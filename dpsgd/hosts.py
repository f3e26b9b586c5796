"""Start a run's peers on several hosts (`launcher.hosts=[node1,node2]`): the driver's own spawner, so a
user with ssh between nodes writes no mpiexec or torchrun line.

Each host gets an equal block of ranks (or `host:slots` of them). A rank is started by the runner,
`RUNNER HOST 'cd CWD && env K=V ... python -m experiments.peer RUN_DIR'` (ssh by default, any command
that runs a shell line on a host: tools/netns_exec.sh for test hosts); its stderr comes back through the
runner into the run's logs. The run folder must be on a file system every host sees (as on a cluster):
the peers read the config from it and write checkpoints and the summary there.

Only what the peer needs crosses: the rank variables, DPSGD_*, OMP_NUM_THREADS, the allocator and
Python path settings. The loopback-only settings of single-host runs (GLOO_SOCKET_IFNAME=lo,
UCX_TLS=self,sm) do not: each peer picks the interface on its route to the master (dpsgd.netif).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from dpsgd import launch, netif

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


def _forwarded(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(_FORWARD_PREFIXES)}


def _line(env: dict, argv: list[str]) -> str:
    """The shell line a host runs: same folder, the forwarded environment, this interpreter."""
    pairs = [f"{k}={v}" for k, v in sorted(env.items())]
    return f"cd {shlex.quote(os.getcwd())} && " + shlex.join(["env", *pairs, sys.executable, *argv])


def spawn(
    backend: str,
    launcher: dict,
    n: int,
    argv: list[str],
    timeout_s: float | None = None,
    env: dict | None = None,
    log_dir: Path | None = None,
    codes_out: list | None = None,
) -> int:
    """Run `argv` (python arguments) as n ranks of backend `backend` on `launcher["hosts"]`; rank r's stderr
    to log_dir/rank{r}.log. The exit code; the first failure stops all (see dpsgd.launch.run_processes)."""
    hosts = list(launcher["hosts"])
    where = placement(hosts, n)
    runner = shlex.split(str(launcher.get("runner") or "ssh"))
    base = _forwarded(launch.peer_env(env))
    logs = [None if log_dir is None else Path(log_dir) / f"rank{r}.log" for r in range(n)]
    if backend == "torch":
        master = netif.resolve(where[0])
        port = int(launcher.get("port") or 0) or launch.free_port()
        local_sizes = {h: where.count(h) for h in where}
        commands = []
        for r, host in enumerate(where):
            rank_env = {
                **base,
                "MASTER_ADDR": master,
                "MASTER_PORT": str(port),
                "WORLD_SIZE": str(n),
                "RANK": str(r),
                "LOCAL_RANK": str(r - where.index(host)),
                "LOCAL_WORLD_SIZE": str(local_sizes[host]),
            }
            commands.append(([*runner, host, _line(rank_env, argv)], env, logs[r]))
        return launch.run_processes(commands, timeout_s, codes_out)
    if backend == "mpi":
        return _spawn_mpi(where, runner, base, argv, timeout_s, env, log_dir)
    raise ValueError(f"launcher.hosts needs backend=torch or backend=mpi (processes on hosts), got backend={backend}")


def _spawn_mpi(where: list[str], runner: list[str], base: dict, argv: list[str], timeout_s, env, log_dir) -> int:
    """mpiexec from here, its proxies started on the hosts by the runner instead of plain ssh; UCX over
    tcp on the interface to the first host (shared memory would join the ranks of one machine directly,
    which on test hosts, namespaces of one machine, bypasses their links)."""
    iface = netif.interface_to(where[0])
    if iface == "lo":
        raise ValueError(
            f"launcher.hosts: the first host {where[0]!r} is this machine's loopback; give the hosts' network "
            "addresses (or no launcher.hosts for a run on this machine)"
        )
    counts = {h: where.count(h) for h in dict.fromkeys(where)}
    cmd = [launch.mpiexec(), "-launcher", "ssh"]
    if runner != ["ssh"]:
        cmd += ["-launcher-exec", shlex.join(runner)]
    cmd += ["-iface", iface, "-hosts", ",".join(f"{h}:{k}" for h, k in counts.items()), "-n", str(len(where))]
    for k, v in {**base, "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": iface}.items():
        cmd += ["-genv", k, v]
    if log_dir is not None:
        cmd += ["-errfile-pattern", str(Path(log_dir) / "rank%r.log")]
    # the driver's own UCX_TLS=self,sm must not reach mpiexec's environment: None removes it (peer_env)
    local = {**(env or {}), "UCX_TLS": None, "UCX_NET_DEVICES": None}
    log = Path(log_dir) / "launcher.log" if log_dir is not None else None
    return launch.run_processes([([*cmd, sys.executable, *argv], local, log)], timeout_s, stdout_to_log=True)
