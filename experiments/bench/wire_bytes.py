"""Bytes on the wire against the toolkit's own count: 2 test hosts x 2 peers (tools/testhosts.py, root).

The toolkit counts the bytes of training exchanges (`mb_sent_per_peer`); host 2's `eth0` counts
everything it sent: setup (rendezvous, UCX wire-up, the config), the final evaluation, TCP/IP
headers and acknowledgements. Two runs that differ only in length remove what does not grow with the
steps: wire(long) - wire(short) is set against count(long) - count(short). Headers: the counter adds
14 (Ethernet) + 20 (IPv4) + 32 (TCP with timestamps) = 66 bytes to each packet it counts (a segment
offloaded whole counts once), so payload = tx_bytes - 66 x tx_packets, and a pure ACK counts 0.

Inter-host share of the count: each of host 2's peers sends the same bytes to each of its neighbours
(one model each), so host 2 sent count x (its peers' neighbours on host 1) / (all their neighbours).
`--algorithm allreduce` counts a ring all-reduce over the ranks in order (2 (n - 1) / n models a peer,
to its successor): the `ring` topology's share, a half, whatever `--topologies` says; the backend's own
all-reduce may move other bytes.

    python -m experiments.bench wire_bytes                     # the table of docs/results/network.md
    python -m experiments.bench wire_bytes --backends torch --topologies hierarchical --epochs 1 2
    python -m experiments.bench wire_bytes --algorithm allreduce --topologies ring
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from experiments.bench import cli, harness
from experiments.bench.harness import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import testhosts  # noqa: E402

HEADER_BYTES = 14 + 20 + 32  # Ethernet + IPv4 + TCP with timestamps, per counted packet
PEERS_PER_HOST = 2
TIMEOUT_S = 240


def topology_options(topology: str) -> dict:
    """hierarchical: one group per host (all-reduce-like inside, gossip between hosts)."""
    return {"group_size": PEERS_PER_HOST} if topology == "hierarchical" else {}


def across_share(topology: str, peers: int, hosts: int) -> float:
    """Of the bytes the last host's peers send, the share that goes to peers on other hosts."""
    import topologies

    t = topologies.make(topology, peers, **topology_options(topology))
    on = [r // (peers // hosts) for r in range(peers)]
    mine = [r for r in range(peers) if on[r] == hosts - 1]
    steps = range(t.period or 1)  # a time-varying graph (one-peer exponential): every matrix of its period
    links = [(r, j) for s in steps for r in mine for j in range(peers) if j != r and t.mixing_matrix(s)[r, j] != 0]
    return sum(on[j] != on[r] for r, j in links) / len(links)


def one_run(
    hosts: testhosts.TestHosts, backend: str, topology: str, epochs: int, run_dir: Path, algorithm: str = "dpsgd"
) -> dict:
    """Run the app from host 1 on both hosts (launcher.hosts); host 2's eth0 counters before and after."""
    from dpsgd.backends import peer_env

    before = hosts.counters(2)
    cmd = [
        sys.executable, "-m", "experiments.train", f"algorithm={algorithm}", f"backend={backend}",
        f"topology={topology}", f"peers={PEERS_PER_HOST * hosts.n}", f"epochs={epochs}", "log_every=100000",
        f"launcher.hosts=[{','.join(hosts.address(i) for i in range(1, hosts.n + 1))}]",
        f"launcher.runner={ROOT / 'tools' / 'netns_exec.sh'}", f"hydra.run.dir={run_dir}",
        *(f"topology.{k}={v}" for k, v in topology_options(topology).items()),
    ]  # fmt: skip
    r = hosts.run(1, cmd, timeout=TIMEOUT_S, cwd=ROOT, env=peer_env(), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{backend} {topology} epochs={epochs} failed: {(r.stderr or r.stdout)[-2000:]}")
    after = hosts.counters(2)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "tx_bytes": after["tx_bytes"] - before["tx_bytes"],
        "tx_packets": after["tx_packets"] - before["tx_packets"],
        "count": summary["mb_sent_per_peer"] * 1e6 * PEERS_PER_HOST,  # host 2's peers, every neighbour
        "steps": summary["steps"],
    }


def measure(
    backend: str,
    topology: str,
    epochs: tuple[int, int],
    hosts: testhosts.TestHosts,
    tmp: Path,
    algorithm: str = "dpsgd",
) -> dict:
    short, long = (
        one_run(hosts, backend, topology, e, tmp / f"{algorithm}-{backend}-{topology}-{e}", algorithm) for e in epochs
    )
    # the toolkit counts an all-reduce as a ring over the ranks in order, whatever the topology
    share = across_share("ring" if algorithm == "allreduce" else topology, PEERS_PER_HOST * hosts.n, hosts.n)
    wire = long["tx_bytes"] - short["tx_bytes"]
    packets = long["tx_packets"] - short["tx_packets"]
    payload = wire - HEADER_BYTES * packets
    count = (long["count"] - short["count"]) * share
    return {
        "algorithm": algorithm,
        "backend": backend,
        "topology": topology,
        "steps": long["steps"] - short["steps"],
        "wire_bytes": wire,
        "packets": packets,
        "payload_bytes": payload,
        "toolkit_bytes": round(count),
        "ratio": payload / count,
        "whole_run_ratio": (long["tx_bytes"] - HEADER_BYTES * long["tx_packets"]) / (long["count"] * share),
    }


def table(rows: list[dict]) -> str:
    head = (
        "| algorithm | backend | topology | extra steps | eth0 tx bytes | packets | payload | toolkit count "
        "| payload / count |"
    )
    lines = [head, "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['algorithm']} | {r['backend']} | {r['topology']} | {r['steps']} | {r['wire_bytes']:,} | "
            f"{r['packets']:,} | {r['payload_bytes']:,} | {r['toolkit_bytes']:,} | {r['ratio']:.3f} |"
        )
    return "\n".join(lines)


def options(p) -> None:
    p.add_argument("--backends", nargs="+", default=["mpi", "torch"])
    p.add_argument("--topologies", nargs="+", default=["ring", "hierarchical"])
    p.add_argument("--algorithm", default="dpsgd", choices=["dpsgd", "allreduce"], help="gossip, or the all-reduce")
    p.add_argument("--epochs", nargs=2, type=int, default=[2, 6], help="the short and the long run")


def run(args) -> harness.Result:
    why = testhosts.unavailable()
    if why:
        raise SystemExit(f"error: wire_bytes: {why}")
    rows = []
    with testhosts.TestHosts(2) as hosts, tempfile.TemporaryDirectory() as tmp:
        for backend in args.backends:
            for topology in args.topologies:
                rows.append(measure(backend, topology, tuple(args.epochs), hosts, Path(tmp), args.algorithm))
                print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    return harness.Result({"rows": rows})


main = cli.entry("wire_bytes")

if __name__ == "__main__":
    raise SystemExit(main())
