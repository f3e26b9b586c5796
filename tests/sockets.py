"""The listening sockets of a process tree, read from /proc (each process's own network namespace)."""

from __future__ import annotations

import ipaddress
import os
import socket


def tree(root: int) -> list[int]:
    """`root` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _socket_inodes(pid: int) -> set[int]:
    found = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                found.add(int(target[8:-1]))
    except OSError:
        pass
    return found


def _address(text: str, v6: bool) -> tuple[str, int]:
    ip, port = text.split(":")
    raw = bytes.fromhex(ip)
    if v6:
        return socket.inet_ntop(socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))), int(port, 16)
    return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)


def listening(root: int) -> list[dict]:
    """Every TCP socket in LISTEN state (and bound UDP socket) that a process of `root`'s tree holds: protocol,
    address, port, pid and the process's command line."""
    out = []
    for pid in tree(root):
        inodes = _socket_inodes(pid)
        if not inodes:
            continue
        for table, v6, proto, state in (("tcp", 0, "tcp", "0A"), ("tcp6", 1, "tcp", "0A"), ("udp", 0, "udp", "07"),
                                         ("udp6", 1, "udp", "07")):  # fmt: skip
            try:
                lines = open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                fields = line.split()
                if fields[3] == state and int(fields[9]) in inodes:
                    address, port = _address(fields[1], bool(v6))
                    cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ").strip()
                    out.append({"proto": proto, "address": address, "port": port, "pid": pid, "cmd": cmd})
    return out


def everywhere(address: str) -> bool:
    """Bound to every interface (0.0.0.0 or ::)."""
    return ipaddress.ip_address(address).is_unspecified


def loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback
