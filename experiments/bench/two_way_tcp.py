"""Does a capped host link carry its rate both ways at once? Plain TCP flows between 2 test hosts.

The emulator charges a message crossing a host link alpha + M / beta whatever else the link does; beta
comes from a ping-pong, where one direction is busy at a time. Training exchanges are two-way (one-peer
D-PSGD's partners send to each other in the same step), and a host's acknowledgements of what it receives
queue behind what it sends. Here, with no MPI, gloo or torch in the way: each host's eth0 capped with
`tc tbf` (as `experiments.bench.emulator_vs_link` caps it), `--flows` TCP connections from host 1 to host
2 carry `--size` bytes each, alone (one-way) or while as many carry as much from host 2 to host 1
(two-way), `--reps` times over the same warm connections, each transfer started at an agreed time. The
figure is a transfer's time over what the cap's TCP payload rate needs for its bytes.

    python -m experiments.bench two_way_tcp            # root; about 1 min
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import threading
import time

from experiments.bench import cli, harness
from experiments.bench.harness import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import testhosts  # noqa: E402

PAYLOAD_PER_FRAME = 1448 / 1514  # TCP payload of a full Ethernet frame with timestamps: what tbf's rate carries
RATES = {"mbit": 1e6, "gbit": 1e9}
PORT = 29481
TIMEOUT_S = 120


def serve(host: str, port: int, flows: int, reps: int, size: int) -> None:
    """Accept `flows` connections; for each repetition read `size` bytes on each and answer one byte."""
    with socket.create_server((host, port), backlog=flows) as server:
        print("ready", flush=True)
        conns = [server.accept()[0] for _ in range(flows)]

        def each(c: socket.socket) -> None:
            for _ in range(reps):
                left = size
                while left:
                    got = c.recv(min(left, 1 << 20))
                    if not got:
                        raise ConnectionError("the sender closed early")
                    left -= len(got)
                c.sendall(b"k")

        threads = [threading.Thread(target=each, args=(c,)) for c in conns]
        [t.start() for t in threads]
        [t.join(TIMEOUT_S) for t in threads]


def send(host: str, port: int, flows: int, reps: int, size: int, cc: str, start: float, gap: float) -> None:
    """Connect `flows` sockets (congestion control `cc`); repetition r starts at `start + r * gap` (this
    machine's clock, shared by both hosts); print each repetition's seconds until every flow was answered."""
    conns = []
    for _ in range(flows):
        c = socket.create_connection((host, port), timeout=TIMEOUT_S)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc.encode())
        conns.append(c)
    data, took = b"x" * size, []
    for r in range(reps):
        time.sleep(max(0.0, start + r * gap - time.time()))
        t0 = time.perf_counter()
        threads = [threading.Thread(target=lambda c=c: (c.sendall(data), c.recv(1))) for c in conns]
        [t.start() for t in threads]
        [t.join(TIMEOUT_S) for t in threads]
        took.append(time.perf_counter() - t0)
    print(json.dumps(took), flush=True)


def transfer(hosts, flows: int, reps: int, size: int, cc: str, two_way: bool, port: int, ideal: float) -> list[float]:
    """One configuration: the servers up, then the senders started on an agreed schedule."""
    pairs = [(1, 2)] + ([(2, 1)] if two_way else [])  # (sending host, receiving host)

    def helper(host: int, call: str) -> subprocess.Popen:  # this module's function `call` on a test host
        code = f"from experiments.bench.two_way_tcp import serve, send; {call}"
        return hosts.popen(host, [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)

    procs = []
    try:
        for _, dst in pairs:
            p = helper(dst, f"serve({hosts.address(dst)!r}, {port}, {flows}, {reps}, {size})")
            procs.append(p)
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a receiver did not start")
        start, gap = time.time() + 1.0, 3 * ideal + 0.2
        senders = [
            helper(src, f"send({hosts.address(dst)!r}, {port}, {flows}, {reps}, {size}, {cc!r}, {start!r}, {gap!r})")
            for src, dst in pairs
        ]
        procs += senders
        times = [json.loads(s.communicate(timeout=TIMEOUT_S)[0]) for s in senders]
        return [max(ts) for ts in zip(*times)]  # a repetition ends when both directions have
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


def options(p) -> None:
    p.add_argument("--rate", default="100mbit", help="tc tbf rate of each host's eth0")
    p.add_argument("--sizes", nargs="+", type=int, default=[1_125_000, 4_500_000], help="bytes a flow carries")
    p.add_argument("--flows", nargs="+", type=int, default=[1, 2], help="connections each way")
    p.add_argument("--cc", nargs="+", default=["bbr", "reno"], help="TCP congestion control of the senders")


def run(args) -> harness.Result:
    if why := testhosts.unavailable():
        raise SystemExit(f"error: two_way_tcp: {why}")
    unit = next((u for u in RATES if args.rate.endswith(u)), None)
    if unit is None:
        raise SystemExit(f"error: two_way_tcp: --rate {args.rate!r}: expected a tc rate such as 100mbit or 1gbit")
    payload_bytes_per_s = float(args.rate[: -len(unit)]) * RATES[unit] / 8 * PAYLOAD_PER_FRAME
    rows, port = [], PORT
    with testhosts.TestHosts(2) as hosts:
        for i in (1, 2):
            hosts.run(i, testhosts.cap_command(args.rate), timeout=30, check=True)
        for cc in args.cc:
            for size in args.sizes:
                for flows in args.flows:
                    ideal = flows * size / payload_bytes_per_s
                    for two_way in (False, True):
                        port += 1
                        took = transfer(hosts, flows, args.reps, size, cc, two_way, port, ideal)[1:]
                        rows.append([cc, size, flows, "two-way" if two_way else "one-way", ideal,
                                     min(took), statistics.median(took), statistics.median(took) / ideal])  # fmt: skip
                        print(
                            f"{cc} {size} B x {flows} {rows[-1][3]}: median {rows[-1][-1]:.3f} of the cap", flush=True
                        )
    columns = ["cc", "bytes", "flows each way", "traffic", "at the cap s", "fastest s", "median s", "median / cap"]
    harness.print_table(columns, rows, floatfmt=".3f")
    return harness.Result({"rate": args.rate, "rows": [dict(zip(columns, r)) for r in rows]})


main = cli.entry("two_way_tcp")

if __name__ == "__main__":
    raise SystemExit(main())
