"""Test hosts on this machine: N Linux network namespaces on one private subnet, joined by a bridge.

A set of hosts gets a number S (1..250, the first free one) and the subnet 10.213.S.0/24: host I
(1..N) is the namespace `dpsgdh-S-hI` with loopback and `eth0` at 10.213.S.I; its veth peer sits in
the namespace `dpsgdh-S-br` on the bridge `br0`, so no interface of the root namespace is touched and
traffic stays among these namespaces. Sets are separate: two sessions on one machine (two pytest
runs, a benchmark beside the tests) each make and remove their own. An optional rate cap (tc tbf;
this kernel has no netem, so delay cannot be shaped) is put on both ends of each host's link: egress
of `eth0` caps what the host sends, egress of the bridge-side veth caps what it receives. The bucket is
64 KiB whatever the rate (0.5 ms at 1 Gbit/s, 5 ms at 100 Mbit/s): a larger one lets that much through
at line speed after each pause, and smaller ones lose rate (measured: 16 KiB gave 922 Mbit/s at 1gbit,
4 KiB 677). Needs root and `ip netns`.

By hand:
    python tools/testhosts.py up 2 [--rate 100mbit]      # prints the set number S and the hosts
    python tools/testhosts.py run 1 -- python -c 'print(1)'   # --set S when several sets exist
    python tools/testhosts.py down                         # --set S, or --all
The hosts' TCP congestion control is Reno unless `tcp` names another (None: the kernel's default, here BBR).
Loss-based like CUBIC, most clusters' default (which this kernel refuses to a namespace), Reno fills a
capped link however many flows share it; this kernel's BBR, with two flows each way through the 50 ms tbf
queue, resent thousands of segments a step and took 6-7% longer than the cap's rate needs (plain flows; one-peer
D-PSGD's step on 2 x 2 hosts 5-8% longer than under Reno: docs/results/network.md).
From code (tests):
    with TestHosts(2, rate="1gbit", tcp="reno") as hosts:
        hosts.run(1, ["python", "-c", "print(1)"], timeout=30)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

PREFIX = "dpsgdh-"
SUBNET = "10.213"  # private test range 10.213.0.0/16, a /24 per set; nothing else is ever addressed
MAX_SETS = 250
_TIMEOUT = 20.0  # seconds for one ip/tc call
BURST_BYTES = 65536  # tbf bucket: one TSO segment
TCP = "reno"  # the hosts' congestion control unless told (None: the kernel's); why in the module's text


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


_MADE_HERE: set[int] = set()  # sets this process made (and has not removed)


def leftovers(sets: Sequence[int] | None = None) -> list[str]:
    """Namespaces of this tool that exist, of `sets` only if given (should be none after `down`)."""
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=_TIMEOUT)
    names = sorted(line.split()[0] for line in r.stdout.splitlines() if line.startswith(PREFIX))
    return names if sets is None else [n for n in names if set_of(n) in set(sets)]


def made_here() -> list[int]:
    """The sets this process made and has not removed (the pytest session checks these)."""
    return sorted(_MADE_HERE)


def set_of(ns: str) -> int | None:
    number = ns[len(PREFIX) :].split("-")[0]
    return int(number) if number.isdigit() else None


def sets() -> list[int]:
    return sorted({s for s in map(set_of, leftovers()) if s is not None})


def bridge_ns(set_id: int) -> str:
    return f"{PREFIX}{set_id}-br"


def host_ns(set_id: int, i: int) -> str:
    return f"{PREFIX}{set_id}-h{i}"


def address(set_id: int, i: int) -> str:
    return f"{SUBNET}.{set_id}.{i}"


class TestHosts:
    """N hosts (1-based), made on __enter__/up() and removed on __exit__/down(), also after errors."""

    __test__ = False  # not a pytest test class

    def __init__(self, n: int, rate: str | None = None, tcp: str | None = TCP):
        if not 1 <= n <= 250:
            raise ValueError(f"TestHosts: n={n} hosts, expected 1..250 (one /24 test subnet)")
        if rate is not None:
            _check_rate(rate)
        self.n, self.rate, self.tcp = n, rate, tcp
        self.set_id: int | None = None  # chosen by up()

    # --- lifecycle -------------------------------------------------------------------------------------

    def up(self) -> TestHosts:
        why = unavailable()
        if why:
            raise RuntimeError(why)
        self.set_id = _claim_set()
        _MADE_HERE.add(self.set_id)
        bridge = bridge_ns(self.set_id)
        try:
            _ip("link", "set", "lo", "up", ns=bridge)
            _ip("link", "add", "br0", "type", "bridge", ns=bridge)
            _ip("link", "set", "br0", "up", ns=bridge)
            for i in range(1, self.n + 1):
                ns, side = self.ns(i), f"h{i}-br"
                _ip("netns", "add", ns)
                # made inside the bridge namespace, so the root namespace never holds the pair
                _ip("link", "add", side, "type", "veth", "peer", "name", "eth0", "netns", ns, ns=bridge)
                _ip("link", "set", side, "master", "br0", ns=bridge)
                _ip("link", "set", side, "up", ns=bridge)
                _ip("link", "set", "lo", "up", ns=ns)
                # no IPv6: its link-local chatter would add bytes the byte accounting cannot attribute
                subprocess.run([*self.prefix(i), "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"],
                               capture_output=True, timeout=_TIMEOUT)  # fmt: skip
                if self.tcp:
                    self._congestion_control(i, self.tcp)
                _ip("addr", "add", f"{self.address(i)}/24", "dev", "eth0", ns=ns)
                _ip("link", "set", "eth0", "up", ns=ns)
                if self.rate:
                    for where, dev in ((ns, "eth0"), (bridge, side)):
                        self._cap(where, dev, self.rate)
        except BaseException:
            self.down()
            raise
        return self

    @staticmethod
    def _cap(ns: str, dev: str, rate: str | None) -> None:
        r = subprocess.run(["ip", "netns", "exec", ns, *cap_command(rate, dev)], capture_output=True, text=True,
                           timeout=_TIMEOUT)  # fmt: skip
        if r.returncode != 0 and rate is not None:
            raise RuntimeError(f"tc tbf rate {rate} on {ns}/{dev} failed: {r.stderr.strip()}")

    def _congestion_control(self, i: int, name: str) -> None:
        r = subprocess.run([*self.prefix(i), "sysctl", "-qw", f"net.ipv4.tcp_congestion_control={name}"],
                           capture_output=True, text=True, timeout=_TIMEOUT)  # fmt: skip
        if r.returncode != 0:
            allowed = _sysctl("net.ipv4.tcp_allowed_congestion_control")
            raise RuntimeError(
                f"TestHosts: TCP congestion control {name!r} refused in host {i} ({r.stderr.strip()}); "
                f"a network namespace here may take one of: {allowed}; or keep the kernel's {default_tcp()} "
                "(--tcp kernel, tcp=None)"
            )

    def down(self) -> None:
        """Remove this set's namespaces; deleting a namespace deletes its veth ends with it."""
        if self.set_id is not None:
            down([self.set_id])

    def __enter__(self) -> TestHosts:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # --- use -------------------------------------------------------------------------------------------

    def _set(self) -> int:
        if self.set_id is None:
            raise RuntimeError("TestHosts: the hosts are not up; use `with TestHosts(n) as hosts:` or up()")
        return self.set_id

    def address(self, i: int) -> str:
        return address(self._set(), i)

    def ns(self, i: int) -> str:
        """The network namespace of host i."""
        return host_ns(self._set(), i)

    def prefix(self, i: int) -> list[str]:
        """Command prefix that runs a program inside host i."""
        return ["ip", "netns", "exec", self.ns(i)]

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

    def retransmitted(self, i: int) -> int:
        """TCP segments host i sent again (a loss, or a timeout that took one for it): the counters above
        count these bytes too. Seen even uncapped: 0 to 45 in a 4 MB transfer on this machine under load."""
        r = subprocess.run([*self.prefix(i), "cat", "/proc/net/snmp"], capture_output=True, text=True,
                           timeout=_TIMEOUT, check=True)  # fmt: skip
        return retransmitted_in(r.stdout)


def retransmitted_in(snmp: str) -> int:
    """RetransSegs from the text of a network namespace's /proc/net/snmp."""
    head, values = (line.split() for line in snmp.splitlines() if line.startswith("Tcp:"))
    return int(values[head.index("RetransSegs")])


def cap_command(rate: str | None, dev: str = "eth0") -> list[str]:
    """The tc command that caps `dev`'s egress at `rate` (tbf, a 64 KiB bucket), or with None removes the cap."""
    if rate is None:  # back to a veth's own default (no queue); fails harmlessly where no cap is set
        return ["tc", "qdisc", "del", "dev", dev, "root"]
    _check_rate(rate)
    return ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", str(BURST_BYTES),
            "latency", "50ms"]  # fmt: skip


def _sysctl(key: str) -> str:
    r = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, timeout=_TIMEOUT)
    return r.stdout.strip() or "?"


def tcp_option(value: str | None) -> str | None:
    """A `--tcp` option's congestion control for TestHosts: 'kernel' keeps the kernel's (None), nothing is TCP."""
    return None if value == "kernel" else value or TCP


def default_tcp() -> str:
    """The kernel's TCP congestion control, what a host gets unless `tcp` is given."""
    return _sysctl("net.ipv4.tcp_congestion_control")


def _check_rate(rate: str) -> None:
    number = next((rate[: -len(u)] for u in ("kbit", "mbit", "gbit") if rate.endswith(u)), "")
    if number.replace(".", "", 1).isdigit():
        return
    raise ValueError(f"rate {rate!r}: expected a number with kbit, mbit or gbit (tc's units), e.g. 100mbit")


def _claim_set() -> int:
    """The first free set number, claimed by making its bridge namespace (`ip netns add` of a name that
    exists fails, so two sessions racing for one number get different ones)."""
    taken = sets()
    for set_id in range(1, MAX_SETS + 1):
        if set_id not in taken and _ip("netns", "add", bridge_ns(set_id), check=False).returncode == 0:
            return set_id
    raise RuntimeError(
        f"all {MAX_SETS} test host sets are in use ({len(taken)} exist): remove stale ones with "
        "`python tools/testhosts.py down --all`"
    )


def down(set_ids: Sequence[int] | None = None) -> None:
    """Remove the namespaces of `set_ids` (all of this tool's if None), ending the processes inside first."""
    for ns in leftovers(set_ids):
        # processes still inside keep a namespace's network alive; end them first (only ours live there)
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=_TIMEOUT)
        for pid in pids.stdout.split():
            try:
                os.kill(int(pid), 9)
            except ProcessLookupError:
                pass
        _ip("netns", "del", ns, check=False)
    _MADE_HERE.difference_update(set_ids if set_ids is not None else list(_MADE_HERE))
    left = leftovers(set_ids)
    if left:
        raise RuntimeError(f"test host namespaces left after down: {left}; remove with `ip netns del NAME`")


def _one_set(given: int | None) -> int:
    if given is not None:
        return given
    existing = sets()
    if len(existing) != 1:
        raise SystemExit(f"testhosts: {len(existing)} sets of test hosts exist ({existing}); say which with --set S")
    return existing[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Test hosts as network namespaces on 10.213.S.0/24 (a set S each).")
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="make a set of N hosts")
    u.add_argument("n", type=int)
    u.add_argument("--rate", help="cap each host's link, both ways, e.g. 100mbit or 1gbit (tc tbf)")
    u.add_argument(
        "--tcp", default=TCP, help=f"the hosts' TCP congestion control ('kernel': the kernel's; {TCP} if not given)"
    )
    r = sub.add_parser("run", help="run a command inside host I: run I -- CMD...")
    r.add_argument("host", type=int)
    r.add_argument("--set", type=int, dest="set_id", help="the set (needed when several exist)")
    r.add_argument("command", nargs=argparse.REMAINDER)
    d = sub.add_parser("down", help="remove a set of test hosts")
    d.add_argument("--set", type=int, dest="set_id", help="the set (needed when several exist)")
    d.add_argument("--all", action="store_true", help="every set, also other sessions'")
    sub.add_parser("list", help="list the test host namespaces that exist")
    a = p.parse_args(argv)
    if a.cmd == "up":
        try:
            hosts = TestHosts(a.n, a.rate, tcp_option(a.tcp)).up()
        except (RuntimeError, ValueError) as e:  # a bad --rate or --tcp, no root: one line, not a traceback
            raise SystemExit(f"testhosts up: {e}") from None
        print(f"set {hosts.set_id}")
        for i in range(1, a.n + 1):
            print(f"{hosts.ns(i)} {hosts.address(i)}")
    elif a.cmd == "run":
        cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
        return subprocess.call(["ip", "netns", "exec", host_ns(_one_set(a.set_id), a.host), *cmd])
    elif a.cmd == "down":
        down(None if a.all else [_one_set(a.set_id)])
    else:
        print("\n".join(leftovers()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
