"""Test hosts on this machine: N Linux network namespaces on one private subnet, joined by a bridge.

Each host `dpsgdt-hI` (I = 1..N) has loopback and `eth0` with address 10.213.0.I/24; its veth peer
sits in the namespace `dpsgdt-br` on the bridge `br0`, so no interface of the root namespace is
touched and traffic stays among these namespaces. An optional rate cap (tc tbf; this kernel has no
netem, so delay cannot be shaped) is put on both ends of each host's link: egress of `eth0` caps what
the host sends, egress of the bridge-side veth caps what it receives. Needs root and `ip netns`.

By hand:
    python tools/testhosts.py up 2 [--rate 100mbit]
    python tools/testhosts.py run 1 -- python -c 'print(1)'
    python tools/testhosts.py down
From code (tests):
    with TestHosts(2, rate="1gbit") as hosts:
        hosts.run(1, ["python", "-c", "print(1)"], timeout=30)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

PREFIX = "dpsgdt-"
BRIDGE_NS = PREFIX + "br"
SUBNET = "10.213.0"  # private test subnet; nothing else is ever addressed
_TIMEOUT = 20.0  # seconds for one ip/tc call


def unavailable() -> str | None:
    """Why test hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "test hosts need root (network namespaces); run as root, as CI does"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "test hosts need the `ip` and `tc` commands (iproute2)"
    try:
        subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, timeout=_TIMEOUT)
    except (subprocess.SubprocessError, OSError) as e:
        return f"`ip netns list` failed ({e}); network namespaces are unavailable here"
    return None


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *args] if ns is None else ["ip", "netns", "exec", ns, "ip", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT)
    if check and r.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r


def leftovers() -> list[str]:
    """Namespaces made by this tool that still exist (should be none after `down`)."""
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=_TIMEOUT)
    return sorted(line.split()[0] for line in r.stdout.splitlines() if line.startswith(PREFIX))


def host_ns(i: int) -> str:
    return f"{PREFIX}h{i}"


def address(i: int) -> str:
    return f"{SUBNET}.{i}"


class TestHosts:
    """N hosts (1-based), made on __enter__/up() and removed on __exit__/down(), also after errors."""

    __test__ = False  # not a pytest test class

    def __init__(self, n: int, rate: str | None = None):
        if not 1 <= n <= 250:
            raise ValueError(f"TestHosts: n={n} hosts, expected 1..250 (one /24 test subnet)")
        self.n, self.rate = n, rate

    # --- lifecycle -------------------------------------------------------------------------------------

    def up(self) -> TestHosts:
        why = unavailable()
        if why:
            raise RuntimeError(why)
        if leftovers():
            raise RuntimeError(
                f"test host namespaces exist already: {leftovers()}; another run holds them, or one "
                "crashed: remove them with `python tools/testhosts.py down`"
            )
        try:
            _ip("netns", "add", BRIDGE_NS)
            _ip("link", "set", "lo", "up", ns=BRIDGE_NS)
            _ip("link", "add", "br0", "type", "bridge", ns=BRIDGE_NS)
            _ip("link", "set", "br0", "up", ns=BRIDGE_NS)
            for i in range(1, self.n + 1):
                ns, side = host_ns(i), f"h{i}-br"
                _ip("netns", "add", ns)
                # made inside the bridge namespace, so the root namespace never holds the pair
                _ip("link", "add", side, "type", "veth", "peer", "name", "eth0", "netns", ns, ns=BRIDGE_NS)
                _ip("link", "set", side, "master", "br0", ns=BRIDGE_NS)
                _ip("link", "set", side, "up", ns=BRIDGE_NS)
                _ip("link", "set", "lo", "up", ns=ns)
                # no IPv6: its link-local chatter would add bytes the byte accounting cannot attribute
                subprocess.run([*self.prefix(i), "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"],
                               capture_output=True, timeout=_TIMEOUT)  # fmt: skip
                _ip("addr", "add", f"{address(i)}/24", "dev", "eth0", ns=ns)
                _ip("link", "set", "eth0", "up", ns=ns)
                if self.rate:
                    for where, dev in ((ns, "eth0"), (BRIDGE_NS, side)):
                        self._cap(where, dev, self.rate)
        except BaseException:
            self.down()
            raise
        return self

    @staticmethod
    def _cap(ns: str, dev: str, rate: str) -> None:
        # burst: 10 ms at the rate, at least 64 KiB (a TSO segment), so the cap holds without stalls
        r = subprocess.run(
            ["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
             "burst", _burst(rate), "latency", "50ms"],
            capture_output=True, text=True, timeout=_TIMEOUT,
        )  # fmt: skip
        if r.returncode != 0:
            raise RuntimeError(f"tc tbf rate {rate} on {ns}/{dev} failed: {r.stderr.strip()}")

    def down(self) -> None:
        """Remove every namespace of this tool; deleting a namespace deletes its veth ends with it."""
        down()

    def __enter__(self) -> TestHosts:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # --- use -------------------------------------------------------------------------------------------

    def address(self, i: int) -> str:
        return address(i)

    def prefix(self, i: int) -> list[str]:
        """Command prefix that runs a program inside host i."""
        return ["ip", "netns", "exec", host_ns(i)]

    def run(self, i: int, cmd: Sequence[str], timeout: float, **kw) -> subprocess.CompletedProcess:
        return subprocess.run([*self.prefix(i), *cmd], timeout=timeout, **kw)

    def popen(self, i: int, cmd: Sequence[str], **kw) -> subprocess.Popen:
        return subprocess.Popen([*self.prefix(i), *cmd], **kw)

    def counters(self, i: int) -> dict[str, int]:
        """Bytes and packets host i's eth0 sent and received, as the kernel counted them."""
        out = {}
        for k in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets"):
            r = subprocess.run(
                [*self.prefix(i), "cat", f"/sys/class/net/eth0/statistics/{k}"],
                capture_output=True, text=True, timeout=_TIMEOUT, check=True,
            )  # fmt: skip
            out[k] = int(r.stdout)
        return out


def _burst(rate: str) -> str:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for u, f in units.items():
        if rate.endswith(u):
            bps = float(rate[: -len(u)]) * f
            return str(max(65536, int(bps / 8 * 0.01)))
    raise ValueError(f"rate {rate!r}: expected a number with kbit, mbit or gbit (tc's units), e.g. 100mbit")


def down() -> None:
    for ns in leftovers():
        # processes still inside keep a namespace's network alive; end them first (only ours live there)
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=_TIMEOUT)
        for pid in pids.stdout.split():
            try:
                os.kill(int(pid), 9)
            except ProcessLookupError:
                pass
        _ip("netns", "del", ns, check=False)
    left = leftovers()
    if left:
        raise RuntimeError(f"test host namespaces left after down: {left}; remove with `ip netns del NAME`")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Test hosts as network namespaces on 10.213.0.0/24.")
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="make N hosts")
    u.add_argument("n", type=int)
    u.add_argument("--rate", help="cap each host's link, both ways, e.g. 100mbit or 1gbit (tc tbf)")
    r = sub.add_parser("run", help="run a command inside host I: run I -- CMD...")
    r.add_argument("host", type=int)
    r.add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("down", help="remove every test host")
    sub.add_parser("list", help="list the test hosts that exist")
    a = p.parse_args(argv)
    if a.cmd == "up":
        TestHosts(a.n, a.rate).up()
        for i in range(1, a.n + 1):
            print(f"{host_ns(i)} {address(i)}")
    elif a.cmd == "run":
        cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
        return subprocess.call(["ip", "netns", "exec", host_ns(a.host), *cmd])
    elif a.cmd == "down":
        down()
    else:
        print("\n".join(leftovers()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
