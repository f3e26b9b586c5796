"""tools/testhosts.py: hosts as network namespaces talk over their subnet, counters count the bytes,
a rate cap holds, and nothing is left behind."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import testhosts  # noqa: E402

pytestmark = [
    pytest.mark.processes,
    pytest.mark.skipif(testhosts.unavailable() is not None, reason=str(testhosts.unavailable())),
]

N = 4_000_000  # bytes sent host 2 -> host 1
MSS = 1448  # TCP payload of one 1500-byte packet with timestamps
SERVER = (
    "import socket,time;s=socket.create_server(('{addr}',29511));s.settimeout(20);c,_=s.accept();"
    "t=time.monotonic();c.settimeout(20);n=0\nwhile (b:=c.recv(1<<16)): n+=len(b)\nprint(n,time.monotonic()-t)"
)
CLIENT = (
    "import socket,time\nwhile True:\n try: c=socket.create_connection(('{addr}',29511),5);break\n"
    " except OSError: time.sleep(0.05)\nc.sendall(b'x'*" + str(N) + ");c.close()"
)


def _send(hosts: testhosts.TestHosts) -> tuple[int, float, dict, dict]:
    before1, before2 = hosts.counters(1), {**hosts.counters(2), "again": hosts.retransmitted(2)}
    srv = hosts.popen(1, [sys.executable, "-c", SERVER.format(addr=hosts.address(1))], stdout=-1, text=True)
    try:
        hosts.run(
            2,
            [sys.executable, "-c", CLIENT.format(addr=hosts.address(1))],
            timeout=30,
            capture_output=True,
            text=True,
            check=True,
        )
        got_s, secs_s = srv.communicate(timeout=30)[0].split()
    finally:
        srv.kill()
        srv.wait(10)
    a1, a2 = hosts.counters(1), {**hosts.counters(2), "again": hosts.retransmitted(2)}
    d1 = {k: a1[k] - before1[k] for k in a1}
    d2 = {k: a2[k] - before2[k] for k in a2}
    return int(got_s), float(secs_s), d1, d2  # seconds: accept to EOF at the receiver


def test_hosts_talk_and_counters_count_the_bytes():
    with testhosts.TestHosts(2) as hosts:
        got, _, d1, d2 = _send(hosts)
        assert got == N
        # TCP/IP/Ethernet headers: 66 bytes a packet (14 + 20 + 32 with timestamps); a segment sent again
        # (a loss, measured: 0 to 45 of them a run) is counted again, up to one MSS (1448 bytes) each
        again = MSS * d2["again"]
        assert N * 0.99 < d2["tx_bytes"] - 66 * d2["tx_packets"] < N * 1.01 + again, (d1, d2)
        assert N * 0.99 < d1["rx_bytes"] - 66 * d1["rx_packets"] < N * 1.01 + again, (d1, d2)
    assert testhosts.leftovers([hosts.set_id]) == []


def test_rate_cap_holds():
    with testhosts.TestHosts(2, rate="50mbit") as hosts:
        got, secs, _, _ = _send(hosts)
        assert got == N
        # 4 MB at 50 Mbit/s is 0.64 s of payload at least; uncapped veth takes a few ms
        assert 0.6 < secs < 1.5, f"{N} bytes at 50mbit took {secs:.3f} s"
    assert testhosts.leftovers([hosts.set_id]) == []


def test_down_after_an_error_leaves_nothing():
    hosts = testhosts.TestHosts(2)
    with pytest.raises(RuntimeError, match="boom"), hosts:
        raise RuntimeError("boom")
    assert testhosts.leftovers([hosts.set_id]) == [] and testhosts.made_here() == []


def test_two_sets_are_separate():
    """Two sessions at once (a benchmark beside a test run) each get their own set; removing one leaves the other."""
    with testhosts.TestHosts(1) as a, testhosts.TestHosts(1) as b:
        assert a.set_id != b.set_id and a.address(1) != b.address(1)
        testhosts.down([a.set_id])
        assert testhosts.leftovers([a.set_id]) == [] and testhosts.leftovers([b.set_id])
        assert b.run(1, ["ip", "-o", "-4", "addr", "show", "eth0"], timeout=20, capture_output=True,
                     text=True).stdout.count(b.address(1) + "/24") == 1  # fmt: skip
    assert testhosts.leftovers([a.set_id, b.set_id]) == []


def _tcp_of(hosts: testhosts.TestHosts, i: int) -> str:
    return hosts.run(i, ["sysctl", "-n", "net.ipv4.tcp_congestion_control"], timeout=20, capture_output=True,
                     text=True, check=True).stdout.strip()  # fmt: skip


def test_hosts_run_reno_unless_told():
    """The hosts' TCP is testhosts.TCP (Reno) by default, the kernel's with tcp=None; the root namespace's is
    untouched, and a congestion control the kernel refuses is named with the ones it allows."""
    kernel = testhosts.default_tcp()
    assert [testhosts.tcp_option(v) for v in (None, "kernel", "bbr")] == ["reno", None, "bbr"]  # --tcp's values
    with testhosts.TestHosts(2) as reno, testhosts.TestHosts(1, tcp=None) as plain:
        assert [_tcp_of(reno, 1), _tcp_of(reno, 2)] == [testhosts.TCP, testhosts.TCP] == ["reno", "reno"]
        assert _tcp_of(plain, 1) == kernel
    assert testhosts.default_tcp() == kernel
    hosts = testhosts.TestHosts(1, tcp="no_such_tcp")
    with pytest.raises(RuntimeError, match=r"'no_such_tcp' refused in host 1.*may take one of: .*reno"):
        hosts.up()
    assert testhosts.leftovers([hosts.set_id]) == [] and testhosts.made_here() == []
