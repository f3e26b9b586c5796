"""The network interface a run uses: the one on this host's route to the master's address.

gloo otherwise binds the address the hostname resolves to (often 127.0.0.1, so a peer on another host
cannot connect), NCCL's bootstrap and socket transport pick an interface of their own, and MPICH listens on
every interface. Loopback masters get `lo`, so single-host runs stay off external interfaces as before.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess

_TIMEOUT_S = 10.0
TORCH_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")  # gloo's and NCCL's interface


def set_torch_interface(master: str, env=None) -> str:
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME to the interface on the route to `master`, where the user has not
    set them (in `env`, default os.environ); returns that interface."""
    env = os.environ if env is None else env
    iface = interface_to(master)
    for var in TORCH_VARIABLES:
        env.setdefault(var, iface)
    return iface


def resolve(host: str) -> str:
    """IPv4 address of `host` (a name or an address)."""
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise RuntimeError(f"cannot resolve the master address {host!r} ({e}); give an IP address instead") from e


def interface_to(host: str) -> str:
    """Name of the interface this host sends to `host` through (`ip route get`), e.g. 'eth0' or 'lo'."""
    addr = resolve(host)
    if ipaddress.ip_address(addr).is_loopback:
        return "lo"
    try:
        r = subprocess.run(["ip", "-o", "route", "get", addr], capture_output=True, text=True, timeout=_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(
            f"cannot find the interface on the route to {addr} (`ip route get` failed: {e}); install "
            "iproute2, or set GLOO_SOCKET_IFNAME (torch) / UCX_NET_DEVICES (MPI) to the interface yourself"
        ) from e
    words = r.stdout.split()
    if r.returncode != 0 or "dev" not in words:
        raise RuntimeError(
            f"no route to the master address {addr} from this host ({r.stderr.strip() or r.stdout.strip()}); "
            "check that MASTER_ADDR is an address of the first host reachable from here"
        )
    if words[0] == "local":  # the master is this host: the interface that holds its address, not `lo`
        return _holder(addr)
    return words[words.index("dev") + 1]


def _holder(addr: str) -> str:
    r = subprocess.run(
        ["ip", "-o", "-4", "addr", "show", "to", addr], capture_output=True, text=True, timeout=_TIMEOUT_S
    )
    words = r.stdout.split()
    if r.returncode != 0 or len(words) < 2:
        raise RuntimeError(f"{addr} is routed to this host but no interface holds it ({r.stderr.strip()})")
    return words[1]
