"""Step time against network and peers: `python -m experiments.bench step_time_vs_network [--quick]`.

For n = 4, 8, 16 real mpi processes, two model sizes (0.27 M parameters, ResNet-20's count, and 11 M)
and each network preset (datacenter_100g, ethernet_10g, ethernet_1g, wan), every algorithm takes the
same steps with the network emulated in `model` mode (dpsgd.comm.netem); the figure is the emulated time
per step of the slowest peer. Each step's compute is the same fixed time on every peer, measured in this
run on one core with nothing else running: a batch of 32 through ResNet-20 (for the 0.27 M size) and
through the 11 M-parameter MLP; the ranks train MLPs with exactly these parameter counts, so what they
exchange is real and its cost is modelled. Beside each figure: the closed-form cost model, and the
physical floor of this machine (the bytes a peer sends per step over the loopback bandwidth measured in
the same run).

Targets: on ethernet_1g, n = 8, 11 M: DPSGD on one-peer exponential at most 0.5x AllReduce; the emulated
step times of AllReduce and one-peer DPSGD within 10% of the closed form for the 11 M model.
"""

from __future__ import annotations

import time
from pathlib import Path

from experiments.bench import cli, harness, ranks, steps
from experiments.bench.harness import Target

PRESETS = ("datacenter_100g", "ethernet_10g", "ethernet_1g", "wan")
SIZES = {"0.27M": [480, 480], "11M": [3300, 3300]}  # MLP hidden widths on 64 inputs, 10 outputs
INPUTS, BATCH = 64, 32
# name, algorithm, options, topology
ALGORITHMS = (
    ("allreduce", "allreduce", {}, "ring"),
    ("dpsgd ring", "dpsgd", {}, "ring"),
    ("dpsgd one-peer", "dpsgd", {}, "one_peer_exponential"),
    ("dpsgd one-peer overlap", "dpsgd", {"overlap": True}, "one_peer_exponential"),
    ("local_sgd H=8", "local_sgd", {"period": 8}, "ring"),
    ("adpsgd", "adpsgd", {}, "ring"),
)
STEPS = 8  # one LocalSGD period


def mlp(hidden: list[int]):
    return steps.mlp(INPUTS, hidden)


def compute_times() -> dict:
    """Seconds of one step on one core (forward, backward, SGD): ResNet-20 on a batch of 32 (for the 0.27 M size) and
    the 11 M MLP."""
    import torch

    from dpsgd import models

    torch.set_num_threads(1)
    x32, y = torch.randn(BATCH, 3, 32, 32), torch.randint(0, steps.CLASSES, (BATCH,))
    return {
        "0.27M": steps.step_time(models.build("resnet20", (3, 32, 32), steps.CLASSES, 0), x32, y),
        "11M": steps.step_time(mlp(SIZES["11M"]), torch.randn(BATCH, INPUTS), y),
    }


def closed_form(name: str, nbytes: float, n: int, c: float, net: dict) -> float:
    from dpsgd.comm.netem import Link

    link = Link(net["latency_s"], net["bandwidth_bytes_per_s"])
    one = link.message_time(nbytes)
    return {
        "allreduce": c + link.allreduce_time(nbytes, n),
        "dpsgd ring": c + link.message_time(nbytes, 2 if n > 2 else 1),
        "dpsgd one-peer": c + one,
        "dpsgd one-peer overlap": max(c, one),
        "local_sgd H=8": c + link.allreduce_time(nbytes, n) / 8,
        "adpsgd": max(c, 2 * one),
    }[name]


def worker(args) -> None:
    """One rank: every (size, preset, algorithm) for STEPS steps; rank 0 writes the rows."""
    import numpy as np

    import dpsgd.comm
    import topologies
    from dpsgd import metrics
    from dpsgd.comm.netem import NetworkEmulator
    from dpsgd.optim import build, build_base

    world = ranks.init_ranks(gloo=False)
    comm = dpsgd.comm.init("mpi", timeout_s=300)
    n, rank = comm.size, comm.rank
    floor = ranks.loopback_bandwidth(world, 1 << 26, reps=3)
    ((x, y),) = steps.batches(rank, BATCH, INPUTS)
    rows = []
    for size in args.sizes:
        compute = args.compute[size]
        for preset in args.networks:
            net_cfg = {**args.presets[preset], "compute_time": compute}
            for name, algo, options, topo in ALGORITHMS:
                model = mlp(SIZES[size])
                nbytes = sum(p.numel() for p in model.parameters()) * 4
                net = NetworkEmulator.from_config(net_cfg, rank, n)
                comm.attach_network(net)
                comm.stats = dpsgd.comm.CommStats()
                opt = build(
                    algo,
                    build_base(model.parameters(), lr=0.01),
                    topology=topologies.make(topo, n),
                    comm=comm,
                    **options,
                )
                wall, _, _ = steps.timed_steps(opt, model, x, y, STEPS, options.get("overlap", False), net)
                emulated, sent = net.clock.elapsed(), comm.stats.bytes_sent  # AD-PSGD's closing handshake included
                comm.attach_network(None)
                table = metrics.gather_scalars(comm, [emulated, sent, wall])
                per_step = float(table[:, 0].max()) / STEPS
                model_s = closed_form(name, nbytes, n, compute, net_cfg)
                rows.append(
                    {
                        "peers": n,
                        "size": size,
                        "params": nbytes // 4,
                        "network": preset,
                        "algorithm": name,
                        "compute_s": compute,
                        "emulated_s_per_step": per_step,
                        "closed_form_s_per_step": model_s,
                        "vs_closed_form": per_step / model_s,
                        "mb_sent_per_peer_per_step": float(np.mean(table[:, 1].numpy())) / STEPS / 1e6,
                        "floor_s_per_step": ranks.floor_s(float(table[:, 1].max()) / STEPS, floor),
                        "wall_s_per_step": float(table[:, 2].max()) / STEPS,
                    }
                )
    ranks.finish_ranks(world, args.worker, {"rows": rows, "floor": floor})
    comm.close()


def options(p) -> None:
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--networks", nargs="+", default=list(PRESETS), choices=list(PRESETS))


def run(args) -> harness.Result:
    compute = compute_times()
    presets = {preset: harness.network_preset(preset) for preset in args.networks}
    rows, floors = [], {}
    for n in args.peers:
        result = ranks.spawn(args, n, compute=compute, presets=presets)
        rows += result["rows"]
        floors[n] = result["floor"]
    cols = [
        "peers",
        "size",
        "network",
        "algorithm",
        "emulated_s_per_step",
        "closed_form_s_per_step",
        "vs_closed_form",
        "mb_sent_per_peer_per_step",
        "floor_s_per_step",
    ]
    print(
        f"compute per step (one core, batch {BATCH}): ResNet-20 {compute['0.27M'] * 1e3:.1f} ms (for 0.27M), "
        f"11M MLP {compute['11M'] * 1e3:.1f} ms"
    )
    for n, floor in floors.items():
        print(f"n={n}: {ranks.floor_line(floor)}")
    harness.print_columns(rows, cols)
    plot = Path(args.out).with_suffix(".png")
    _plot(rows, plot)
    print(f"plot: {plot}")
    return harness.Result({"compute_s": compute, "floors": floors, "rows": rows}, _targets(rows))


def _targets(rows: list[dict]) -> list[Target]:
    def pick(n, size, net, algo):
        return next(
            (r for r in rows if (r["peers"], r["size"], r["network"], r["algorithm"]) == (n, size, net, algo)), None
        )

    targets = []
    allreduce, one_peer = pick(8, "11M", "ethernet_1g", "allreduce"), pick(8, "11M", "ethernet_1g", "dpsgd one-peer")
    overlap = pick(8, "11M", "ethernet_1g", "dpsgd one-peer overlap")
    if allreduce and one_peer:
        targets.append(
            Target(
                "one-peer DPSGD / AllReduce, ethernet_1g, n=8, 11M",
                one_peer["emulated_s_per_step"] / allreduce["emulated_s_per_step"],
                0.5,
            )
        )
        targets.append(
            Target(
                "one-peer DPSGD with overlap / AllReduce, ethernet_1g, n=8, 11M",
                overlap["emulated_s_per_step"] / allreduce["emulated_s_per_step"],
                0.5,
            )
        )
    large = [r for r in rows if r["size"] == "11M" and r["algorithm"] in ("allreduce", "dpsgd one-peer")]
    if large:
        worst = max(large, key=lambda r: abs(r["vs_closed_form"] - 1))
        targets.append(
            Target(
                f"largest |emulated / closed form - 1|, AllReduce and one-peer DPSGD, 11M "
                f"({worst['algorithm']}, n={worst['peers']}, {worst['network']})",
                abs(worst["vs_closed_form"] - 1),
                0.10,
            )
        )
    return targets


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    size = "11M" if any(r["size"] == "11M" for r in rows) else rows[0]["size"]
    nets = [p for p in PRESETS if any(r["network"] == p for r in rows)]
    fig, axes = plt.subplots(1, len(nets), figsize=(4 * len(nets), 3.6), squeeze=False)
    for ax, net in zip(axes[0], nets):
        for name, *_ in ALGORITHMS:
            pts = sorted(
                (r["peers"], r["emulated_s_per_step"])
                for r in rows
                if r["network"] == net and r["size"] == size and r["algorithm"] == name
            )
            ax.plot([p for p, _ in pts], [t for _, t in pts], marker="o", label=name)
        ax.set_title(f"{net}, {size} parameters")
        ax.set_xlabel("peers")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
    axes[0][0].set_ylabel("emulated seconds per step")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"dpsgd step time vs peers (emulated, model mode), {time.strftime('%Y-%m-%d')}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


main = cli.entry("step_time_vs_network")

if __name__ == "__main__":
    raise SystemExit(main())
