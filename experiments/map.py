"""Where does gossip win? `python -m experiments.map WORKLOAD [--quick]` draws the answer for one workload.

WORKLOAD is `default` (the default config) or the name of an `experiment=` preset. For each algorithm (by default
all-reduce, D-PSGD on a ring and on the one-peer exponential graph, AD-PSGD, LocalSGD, DiLoCo; `--algorithms A,B,...`
names any algorithm whose class declares how the cost model prices it, its `cost_form`, and `diloco_delayed` or
`diloco_eager`, DiLoCo with its outer exchange behind the next round, Kale et al. 2025):
1. the steps to a target (a test accuracy to reach, or a test perplexity or loss to get under), over seeds, measured
   on the fleet (`backend=fleet`) at each peer count;
2. the time those steps take in each cell of a grid (bandwidth x latency x peers per host x a straggler's slowdown),
   from the emulator's cost model (`experiments.cost_model`) with the workload's compute time per step on one core as
   the emulator's clock takes it (calibrated once per workload on this machine, `dpsgd.calibration`): per cell
   the winner, its margin (the runner-up's time over the winner's) and whether the winner's
   and the runner-up's 95% intervals over seeds (`experiments.intervals`) are apart;
3. checks against reality: at a few cells, the winner and the runner-up run for real (mpi peers with the network
   emulated in sleep mode: peers really wait), and their time to the target is set beside the prediction.
Writes outputs/map/WORKLOAD/map.json (`cells`, `checks`), map.png (a heatmap per peer count) and map.md (the regions
in words). `--quick`: a coarse grid, one seed, under 10 minutes on 2 cores. A fleet sweep already in the output
folder is read, not rerun (delete the folder to start again).
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from dpsgd.optim import ALGORITHMS as REGISTERED
from experiments import intervals
from experiments.cost_model import KINDS, STRAGGLER, Algorithm, Network, clock_after
from experiments.sweeps import finished, run_sweep
from experiments.validate import compose

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ALGORITHMS = ("allreduce", "dpsgd", "adpsgd", "local_sgd", "diloco")  # the map's comparison unless told
GOSSIP_TOPOLOGIES = {"ring": "ring", "one_peer_exponential": "one-peer"}  # where gossip runs: graph, label word
ASYNC_TOPOLOGY = "ring"  # the pairs of an asynchronous algorithm (bipartite for an even number of peers)
# DiLoCo with its outer exchange behind the next round's inner steps (Kale et al. 2025), as runs of their own beside
# DiLoCo: the same class and period, priced by the periodic form with `delayed` (eager sends the same exchange)
OVERLAPPED = {
    "diloco_delayed": ("diloco", ("algorithm.outer_delay=1",)),
    "diloco_eager": ("diloco", ("algorithm.outer_delay=1", "algorithm.eager=true")),
}


def period(cls) -> int | None:
    """The default `period` of an optimizer class's constructor (or of the parent it hands its keywords to)."""
    for klass in inspect.getmro(cls):
        try:
            parameter = inspect.signature(klass).parameters.get("period")
        except (TypeError, ValueError):  # a class without a signature of its own (object)
            return None
        if parameter is not None:
            return parameter.default if isinstance(parameter.default, int) else None
    return None


def cost_form(cls) -> str | None:
    """How the cost model prices the class's steps (its declared `cost_form`), or None where it cannot: none
    declared (a user's class), an unknown form, or a periodic one without a default `period`."""
    form = getattr(cls, "cost_form", None)
    if form not in KINDS or (form in ("periodic", "pairwise") and period(cls) is None):
        return None
    return form


def eligible() -> list[str]:
    """The names of dpsgd.optim.ALGORITHMS the map can price, and the OVERLAPPED variants of those."""
    names = [name for name, cls in REGISTERED.items() if cost_form(cls) is not None]
    return names + [name for name, (base, _) in OVERLAPPED.items() if base in names]


def variants(names) -> tuple[Algorithm, ...]:
    """The map's runs of the algorithms `names` (eligible ones), from what their classes declare: a gossip algorithm
    on each of GOSSIP_TOPOLOGIES, a periodic one at its default period, an asynchronous one on ASYNC_TOPOLOGY."""
    out: list[Algorithm] = []
    for name in names:
        if name in OVERLAPPED:
            base, extra = OVERLAPPED[name]
            h = period(REGISTERED[base])
            assert h is not None and cost_form(REGISTERED[base]) == "periodic"
            overrides = (f"algorithm={base}", f"algorithm.period={h}", *extra)
            out.append(Algorithm(f"{name} H={h}", overrides, "periodic", period=h, delayed=True))
            continue
        cls, run = REGISTERED[name], f"algorithm={name}"
        form, h = cost_form(cls), period(cls)
        if form == "gossip":
            for graph, word in GOSSIP_TOPOLOGIES.items():
                out.append(Algorithm(f"{name} {word}", (run, f"topology={graph}"), form, topology=graph))
        elif form in ("periodic", "pairwise") and h is not None:
            out.append(Algorithm(f"{name} H={h}", (run, f"algorithm.period={h}"), form, period=h))
        elif form == "async":
            out.append(Algorithm(name, (run, f"topology={ASYNC_TOPOLOGY}"), form))
        elif form == "allreduce":
            out.append(Algorithm(name, (run,), form))
        else:
            raise ValueError(f"the map cannot price algorithm {name!r}; eligible: {', '.join(eligible())}")
    return tuple(out)


def chosen(text: str | None) -> tuple[Algorithm, ...]:
    """`--algorithms` (comma-separated names) as the map's runs, or the default comparison; a name the map cannot
    price ends in one line naming those it can."""
    names = text.split(",") if text else list(DEFAULT_ALGORITHMS)
    can = eligible()
    if refused := [name for name in names if name not in can]:
        raise SystemExit(
            f"error: --algorithms {','.join(refused)}: the map prices only an algorithm whose class declares a "
            f"cost_form ({', '.join(KINDS)}); eligible: {', '.join(can)}"
        )
    return variants(names)


ALGORITHMS = variants(DEFAULT_ALGORITHMS)
# the target per workload: a value of a record's metric each algorithm can reach in the workload's budget
TARGETS = {
    "default": ("test_accuracy", 0.93),
    "mnist_cnn_peers": ("test_accuracy", 0.75),
    "text_lm_peers": ("test_perplexity", 9.5),
    "fashion_mnist_peers": ("test_accuracy", 0.85),
}
MINIMISED = ("test_perplexity", "test_loss")  # metrics reached from above (lower is better); others from below
SWEPT_BY_THE_MAP = ("algorithm", "peers", "seed", "topology")
MB = 1e6


def grid(quick: bool) -> dict[str, list]:
    """The grid's axes: link bandwidth (bytes/s), latency (s), peers per host, the straggler's slowdown."""
    if quick:
        return {
            "bandwidth_bytes_per_s": [1.25e6, 1.25e8, 1.25e10],
            "latency_s": [1e-5, 1e-3, 5e-2],
            "peers_per_host": [1, 4],
            "slowdown": [1.0, 4.0],
        }
    return {
        "bandwidth_bytes_per_s": [1.25e6, 1.25e7, 1.25e8, 1.25e9, 1.25e10],
        "latency_s": [1e-5, 1e-4, 1e-3, 1e-2, 5e-2],
        "peers_per_host": [1, 4],
        "slowdown": [1.0, 4.0],
    }


# --- the workload -------------------------------------------------------------------------------------------------
def workload_overrides(workload: str) -> list[str]:
    if workload == "default":
        return []
    presets = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
    if workload not in presets:
        raise SystemExit(f"error: unknown workload {workload!r}; expected default or a preset: {', '.join(presets)}")
    return [f"experiment={workload}"]


def pinned(workload: list[str]) -> list[str]:
    """A preset's own sweep, but for what the map sweeps, pinned to its first value (e.g. mnist_cnn_peers's
    data.alpha to 0.1, the non-iid shares)."""
    from omegaconf import OmegaConf

    params = compose(workload, hydra_config=True).hydra.sweeper.params
    params = OmegaConf.to_container(params) if params is not None else {}
    assert isinstance(params, dict)
    return [
        f"{k}={str(v).split(',')[0]}"
        for k, v in params.items()
        if k not in SWEPT_BY_THE_MAP and not str(k).startswith("algorithm.")
    ]


def measure_compute(cfg: dict) -> tuple[float, int, int]:
    """Seconds of one peer's forward and backward pass on its batch (one core), as the emulator's calibrated clock
    takes them (dpsgd.calibration: measured once per workload on this machine and kept, so that the map's times do
    not move with the load while it runs), the model's bytes and the training set's size."""
    from dpsgd import build, calibration
    from dpsgd.config import parse

    run = parse(cfg)
    split = build.load_data(run.data, run.seed, run.peers)
    model = build.build_model(run.model, split, run.seed, run.data.name)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return calibration.calibrated(run), int(nbytes), len(split.x_train)


def epochs_for(cfg: dict, n: int, train_size: int, min_steps: int, epochs: int | None = None) -> int:
    """The workload's epochs (or `epochs`), or more where n peers would take fewer than `min_steps` steps in them."""
    per_epoch = max(1, train_size // (n * int(cfg["batch_size"])))
    return max(int(epochs or cfg["epochs"]), math.ceil(min_steps / per_epoch))


# --- the target -----------------------------------------------------------------------------------------------
def meets(value: float | None, metric: str, target: float) -> bool:
    """Whether a record's `metric` has reached `target`: at or under it for a minimised metric (perplexity, loss),
    at or over it for the others (accuracy)."""
    if value is None or not math.isfinite(value):
        return False
    return value <= target if metric in MINIMISED else value >= target


def first_reached(run_dir: Path, metric: str, target: float) -> dict:
    """The run's first record (of the model every peer's records describe: not rank 0's own) that reaches the target:
    its step, samples and emulated clock; all None where no record does."""
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        if record.get("scope") != "rank 0" and meets(record.get(metric), metric, target):
            return {"steps": record["step"], "samples": record["samples"], "emulated_s": record.get("emulated_time_s")}
    return {"steps": None, "samples": None, "emulated_s": None}


def target_override(args) -> list[str]:
    """`target_accuracy=` for the runs where the metric is accuracy (their summary.json then reports it too)."""
    return [f"target_accuracy={args.target}"] if args.metric == "test_accuracy" else []


# --- 1. steps to the target on the fleet --------------------------------------------------------------------------
def fleet_steps(args, base: list[str], cfg: dict, train_size: int, out: Path) -> dict:
    """{label: {n: [steps to target per seed, None where not reached]}} (and samples), from fleet sweeps."""
    found: dict[str, dict] = {}
    for algorithm, n in itertools.product(args.algorithms, args.peers):
        sweep = out / "fleet" / f"{algorithm.label.replace(' ', '_').replace('=', '')}_n{n}"
        seeds = ",".join(str(s) for s in range(args.seeds))
        if not finished(sweep, args.seeds):
            shutil.rmtree(sweep, ignore_errors=True)  # an interrupted sweep's runs: run again
            started = time.perf_counter()
            run_sweep(
                [
                    *base,
                    *algorithm.overrides,
                    "backend=fleet",
                    "backend.threads=1",
                    f"peers={n}",
                    f"seed={seeds}",
                    f"epochs={epochs_for(cfg, n, train_size, args.min_steps, args.epochs)}",
                    *target_override(args),
                    f"log_every={args.log_every}",
                ],
                sweep,
            )
            print(f"fleet: {algorithm.label}, {n} peers, {args.seeds} seed(s): {time.perf_counter() - started:.0f} s")
        runs = sorted(
            (
                (json.loads(p.read_text()), first_reached(p.parent, args.metric, args.target))
                for p in sweep.rglob("summary.json")
            ),
            key=lambda run: run[0].get("seed", 0),
        )
        entry = found.setdefault(algorithm.label, {})
        entry[str(n)] = {
            "steps": [hit["steps"] for _, hit in runs],
            "samples": [hit["samples"] for _, hit in runs],
            "final": [summary.get(args.metric) for summary, _ in runs],
        }
    return found


# --- 2. the grid --------------------------------------------------------------------------------------------------
def times_to_target(
    algorithm: Algorithm, steps: list, n: int, nbytes: float, compute_s: float, net: Network
) -> list[float]:
    return [math.inf if s is None else clock_after(algorithm, int(s), n, nbytes, compute_s, net) for s in steps]


def decide(times: dict[str, list[float]]) -> dict:
    """Winner (least mean time to target), margin (runner-up's mean / winner's) and whether their 95% intervals over
    seeds are apart (None: one seed, no interval)."""
    means = {}
    for label, ts in times.items():
        means[label] = math.inf if any(math.isinf(t) for t in ts) else float(np.mean(ts))
    ranked = sorted(means, key=lambda k: means[k])
    winner, runner = ranked[0], ranked[1]
    if math.isinf(means[winner]):
        return {"winner": None, "runner_up": None, "margin": None, "apart": None, "mean_s": means}
    margin = means[runner] / means[winner]
    apart = None
    if math.isinf(means[runner]):
        apart = True
    elif len(times[winner]) > 1:
        hw_w, hw_r = intervals.half_width(times[winner]), intervals.half_width(times[runner])
        apart = bool(means[winner] + hw_w < means[runner] - hw_r)
    return {"winner": winner, "runner_up": runner, "margin": margin, "apart": apart, "mean_s": means}


def cells(
    steps: dict, axes: dict, peers: list[int], nbytes: float, compute_s: float, algorithms=ALGORITHMS
) -> list[dict]:
    out = []
    for n in peers:
        for bw, lat, ppr, slow in itertools.product(*axes.values()):
            net = Network(lat, bw, ppr, slow)
            times = {
                a.label: times_to_target(a, steps[a.label][str(n)]["steps"], n, nbytes, compute_s, net)
                for a in algorithms
            }
            d = decide(times)
            out.append({
                "peers": n, "bandwidth_bytes_per_s": bw, "latency_s": lat, "peers_per_host": ppr, "slowdown": slow,
                "winner": d["winner"], "runner_up": d["runner_up"], "margin": d["margin"], "apart": d["apart"],
                "times": {k: (None if math.isinf(v) else v) for k, v in d["mean_s"].items()},
            })  # fmt: skip
    return out


# --- 3. checks against real runs ----------------------------------------------------------------------------------
def check_cells(
    found: list[dict], n: int, count: int, max_bandwidth: float = 1.25e8, min_latency: float = 0.0
) -> list[dict]:
    """`count` cells at `n` peers, one peer per host, with different winners (or stragglers) where possible, and
    links slow enough (<= `max_bandwidth` bytes/s, >= `min_latency` s) that the emulated waits, not this machine,
    set the pace."""
    candidates = [
        c
        for c in found
        if c["peers"] == n
        and c["winner"]
        and c["peers_per_host"] == 1
        and c["bandwidth_bytes_per_s"] <= max_bandwidth
        and c["latency_s"] >= min_latency
    ]
    chosen: list[dict] = []
    for c in sorted(candidates, key=lambda c: -(c["margin"] or 0)):
        if len(chosen) < count and all((c["winner"], c["slowdown"]) != (o["winner"], o["slowdown"]) for o in chosen):
            chosen.append(c)
    for c in candidates:
        if len(chosen) < count and c not in chosen:
            chosen.append(c)
    return chosen


def real_run(
    base: list[str], algorithm: Algorithm, cell: dict, floor_s: float, epochs: int, args, run_dir: Path
) -> dict:
    """One real run (mpi peers, the cell's network emulated in sleep mode, compute floor `floor_s`): its time to
    the target on the peers' clock, and its steps."""
    net = Network(cell["latency_s"], cell["bandwidth_bytes_per_s"], cell["peers_per_host"], cell["slowdown"])
    network = net.config(floor_s, cell["peers"])
    network["mode"] = "sleep"
    sets = [f"network.{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in network.items()]
    sets = [s.replace("=None", "=null") for s in sets]
    cmd = [
        sys.executable, "-m", "experiments.train", *base, *algorithm.overrides, "backend=mpi",
        f"peers={cell['peers']}", "seed=0", "network=loopback", *sets, f"epochs={epochs}",
        *target_override(args), f"log_every={args.log_every}", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    shutil.rmtree(run_dir, ignore_errors=True)  # a run of an earlier invocation: measured again
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"error: a check run failed: {' '.join(cmd[3:])}\n{proc.stderr[-2000:]}")
    hit = first_reached(run_dir, args.metric, args.target)
    return {"measured_s": hit["emulated_s"], "steps": hit["steps"]}


def checks(args, base: list[str], cfg: dict, steps: dict, found: list[dict], train_size: int, out: Path) -> list[dict]:
    n = args.check_peers
    rows = []
    by_label = {a.label: a for a in args.algorithms}
    for i, cell in enumerate(check_cells(found, n, args.check_cells, args.check_max_bandwidth, args.check_min_latency)):
        net = Network(cell["latency_s"], cell["bandwidth_bytes_per_s"], cell["peers_per_host"], cell["slowdown"])
        # the two fastest at the check's compute (or --check-algorithms); AD-PSGD's real peers record rank 0's own
        # model only (no common step), which the fleet's records of the average model do not predict: not checked
        predicted_s = {
            a.label: clock_after(a, steps[a.label][str(n)]["steps"][0], n, args.model_bytes, args.check_compute_s, net)
            for a in args.algorithms
            if a.kind != "async" and steps[a.label][str(n)]["steps"][0] is not None
        }
        for label in args.check_algorithms or sorted(predicted_s, key=lambda k: predicted_s[k])[:2]:
            if label not in predicted_s:
                print(f"check: {label} does not reach the target on the fleet (seed 0): nothing to check")
                continue
            algorithm = by_label[label]
            predicted_steps = steps[label][str(n)]["steps"][0]
            per_epoch = max(1, train_size // (n * int(cfg["batch_size"])))
            epochs = math.ceil((predicted_steps + 2 * args.log_every) / per_epoch)
            run_dir = out / "checks" / f"cell{i}_{label.replace(' ', '_').replace('=', '')}"
            started = time.perf_counter()
            real = real_run(base, algorithm, cell, args.check_compute_s, epochs, args, run_dir)
            predicted = predicted_s[label]
            rows.append({
                "algorithm": label, "cell": i, "peers": n, "bandwidth_bytes_per_s": cell["bandwidth_bytes_per_s"],
                "latency_s": cell["latency_s"], "peers_per_host": cell["peers_per_host"], "slowdown": cell["slowdown"],
                "compute_s": args.check_compute_s, "predicted_steps": predicted_steps, "measured_steps": real["steps"],
                "predicted_s": predicted, "measured_s": real["measured_s"],
                "ratio": None if not real["measured_s"] else predicted / real["measured_s"],
                "run_s": time.perf_counter() - started,
            })  # fmt: skip
            print(f"check: {label} at cell {i}: predicted {predicted:.3g} s, measured {real['measured_s']} s")
    return rows


TCP_PAYLOAD = 1448 / 1514  # payload of a full TCP segment (timestamps) over its bytes on the wire, which tbf counts


def rate_bytes_per_s(rate: str) -> float:
    """A tc rate (e.g. 1mbit) in payload bytes per second."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    unit = next((u for u in units if rate.endswith(u)), None)
    if unit is None:
        raise SystemExit(f"error: --test-hosts {rate!r}: expected a tc rate such as 1mbit or 500kbit")
    return float(rate[: -len(unit)]) * units[unit] / 8 * TCP_PAYLOAD


def test_host_checks(args, base: list[str], cfg: dict, steps: dict, train_size: int, out: Path) -> list[dict]:
    """The default placement for real: 4 peers (`--test-host-backend`, torch unless told) on 2 test hosts
    (tools/testhosts.py, network namespaces, TCP Reno unless `--test-host-tcp`), ranks 0, 1 on host 1 and 2, 3 on
    host 2, each host's link capped at `--test-hosts` (tc tbf both ways), nothing emulated but the compute floor.
    The prediction: the cost model with 2 peers per host, that rate's payload and 100 us, and the backend's all-reduce
    (torch: a ring; mpi: halving and doubling, docs/results/network.md)."""
    sys.path.insert(0, str(ROOT / "tools"))
    import testhosts

    from dpsgd.backends import peer_env

    if why := testhosts.unavailable():
        print(f"test hosts: {why}; no check on a capped link")
        return []
    # the backend's own all-reduce: gloo's ring; MPICH's carried halving and doubling's bytes between these hosts
    allreduce = "halving_doubling" if args.test_host_backend == "mpi" else "ring"
    net = Network(1e-4, rate_bytes_per_s(args.test_hosts), peers_per_host=2, allreduce=allreduce)
    n, compute = 4, args.test_host_compute_s
    if str(n) not in next(iter(steps.values())):
        print(f"test hosts: 4 peers are not among --peers {args.peers}; no check on a capped link")
        return []
    # algorithms that send every step: tbf's 64 KiB bucket refills while a link idles, and lets that much through at
    # line speed, which for a small model is most of a periodic all-reduce (LocalSGD, DiLoCo): not checked here
    predicted_s = {
        a.label: clock_after(a, steps[a.label][str(n)]["steps"][0], n, args.model_bytes, compute, net)
        for a in args.algorithms
        if a.kind in ("allreduce", "gossip") and steps[a.label][str(n)]["steps"][0] is not None
    }
    rows = []
    tcp = testhosts.tcp_option(args.test_host_tcp)
    with testhosts.TestHosts(2, rate=args.test_hosts, tcp=tcp) as hosts:
        for label in sorted(predicted_s, key=lambda k: predicted_s[k])[:2]:
            algorithm = next(a for a in args.algorithms if a.label == label)
            predicted_steps = steps[label][str(n)]["steps"][0]
            per_epoch = max(1, train_size // (n * int(cfg["batch_size"])))
            run_dir = out / "checks" / f"testhosts_{label.replace(' ', '_').replace('=', '')}"
            cmd = [
                sys.executable, "-m", "experiments.train", *base, *algorithm.overrides,
                f"backend={args.test_host_backend}", f"peers={n}", "seed=0", "network=loopback",
                f"network.compute_time={compute}",
                f"epochs={math.ceil((predicted_steps + 2 * args.log_every) / per_epoch)}",
                *target_override(args), f"log_every={args.log_every}", f"hydra.run.dir={run_dir}",
                f"launcher.hosts=[{hosts.address(1)},{hosts.address(2)}]",
                f"launcher.runner={ROOT / 'tools' / 'netns_exec.sh'}",
            ]  # fmt: skip
            shutil.rmtree(run_dir, ignore_errors=True)  # a run of an earlier invocation: measured again
            started = time.perf_counter()
            proc = hosts.run(1, cmd, timeout=600, cwd=ROOT, env=peer_env(), capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"error: a test-host run failed: {' '.join(cmd[3:])}\n{proc.stderr[-2000:]}")
            hit = first_reached(run_dir, args.metric, args.target)
            measured = hit["emulated_s"]
            rows.append({
                "algorithm": label, "cell": "test hosts", "peers": n, "latency_s": net.latency_s,
                "bandwidth_bytes_per_s": net.bandwidth_bytes_per_s, "peers_per_host": 2, "slowdown": 1.0,
                "link": f"tc tbf {args.test_hosts}, {args.test_host_backend}, {tcp or testhosts.default_tcp()}",
                "compute_s": compute, "predicted_steps": predicted_steps,
                "measured_steps": hit["steps"], "predicted_s": predicted_s[label],
                "measured_s": measured, "ratio": None if not measured else predicted_s[label] / measured,
                "run_s": time.perf_counter() - started,
            })  # fmt: skip
            print(f"check: {label} on test hosts at {args.test_hosts}: predicted {predicted_s[label]:.3g} s, "
                  f"measured {measured} s")  # fmt: skip
    return rows


# --- output -------------------------------------------------------------------------------------------------------
def regions(found: list[dict], axes: dict) -> list[str]:
    """The map in words: per peer count, hosts and straggler, where each algorithm wins."""
    lines = []
    for (n, ppr, slow), group in itertools.groupby(
        sorted(found, key=lambda c: (c["peers"], c["peers_per_host"], c["slowdown"])),
        key=lambda c: (c["peers"], c["peers_per_host"], c["slowdown"]),
    ):
        group = list(group)
        parts = []
        for winner in sorted({c["winner"] for c in group}, key=str):
            mine = [c for c in group if c["winner"] == winner]
            bws = sorted({c["bandwidth_bytes_per_s"] for c in mine})
            lats = sorted({c["latency_s"] for c in mine})
            apart = sum(1 for c in mine if c["apart"])
            sure = "one seed: no interval" if all(c["apart"] is None for c in mine) else f"{apart} beyond the intervals"
            parts.append(
                f"**{winner}** in {len(mine)}/{len(group)} cells (bandwidth {_span(bws, _rate)}, latency "
                f"{_span(lats, _seconds)}; margin up to {max(c['margin'] or 1 for c in mine):.2f}x; {sure})"
            )
        straggler = f"peer {STRAGGLER} {slow:g}x slower" if slow != 1 else "no straggler"
        lines.append(f"- {n} peers, {ppr} per host, {straggler}: " + "; ".join(parts) + ".")
    return lines


def _span(values: list, fmt) -> str:
    return fmt(values[0]) if len(values) == 1 else f"{fmt(values[0])} to {fmt(values[-1])}"


def _rate(bytes_per_s: float) -> str:
    bits = bytes_per_s * 8
    return f"{bits / 1e9:g} Gb/s" if bits >= 1e9 else f"{bits / 1e6:g} Mb/s"


def _seconds(s: float) -> str:
    return f"{s * 1e3:g} ms" if s >= 1e-3 else f"{s * 1e6:g} us"


def plot(found: list[dict], axes: dict, peers: list[int], path: Path, algorithms=ALGORITHMS, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    combos = list(itertools.product(axes["peers_per_host"], axes["slowdown"]))
    colours = {a.label: plt.get_cmap("tab10")(i) for i, a in enumerate(algorithms)}
    bws, lats = axes["bandwidth_bytes_per_s"], axes["latency_s"]
    fig, grid_axes = plt.subplots(
        len(combos), len(peers), figsize=(max(6.4, 3.2 * len(peers)), 2.9 * len(combos)), squeeze=False
    )
    for (row, (ppr, slow)), (col, n) in itertools.product(enumerate(combos), enumerate(peers)):
        ax = grid_axes[row][col]
        image = np.ones((len(lats), len(bws), 4))
        for c in found:
            if (c["peers"], c["peers_per_host"], c["slowdown"]) != (n, ppr, slow) or not c["winner"]:
                continue
            i, j = lats.index(c["latency_s"]), bws.index(c["bandwidth_bytes_per_s"])
            shade = 0.3 + 0.7 * min(1.0, math.log(c["margin"]) / math.log(4)) if c["margin"] else 0.3
            image[i, j] = (*colours[c["winner"]][:3], shade)
            if c["apart"] is not True:
                ax.text(j, i, "~", ha="center", va="center", fontsize=12)
        ax.imshow(image, origin="lower", aspect="auto")
        ax.set_xticks(range(len(bws)), [_rate(b).replace(" ", "\n") for b in bws], fontsize=7)
        ax.set_yticks(range(len(lats)), [_seconds(s) for s in lats], fontsize=7)
        ax.set_title(f"{n} peers, {ppr}/host, slow x{slow:g}", fontsize=8)
    fig.legend(
        handles=[Patch(color=colours[a.label], label=a.label) for a in algorithms],
        loc="lower center",
        ncol=len(algorithms) if len(peers) > 2 else 3,  # a narrow map: the legend on two lines
        fontsize=7,
    )
    fig.suptitle(  # what was run, then how to read it; lines: a map of one or two peer counts is narrow
        (title + "\n" if title else "")
        + "Fastest to the target: colour the winner, shade its margin (full at 4x),\n~ the seeds' intervals overlap",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.04, 1, 0.97 if not title else 0.94))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def map_title(args, cfg: dict) -> str:
    """What the map ran, in one line: workload, data and its partition, model, target, inner optimizer, seeds."""
    data = cfg.get("data", {})
    partition = data.get("partition", "iid") + (f" {data.get('alpha')}" if data.get("partition") == "dirichlet" else "")
    optimizer = cfg.get("optimizer", {})
    inner = f"{optimizer.get('name')} lr {optimizer.get('lr')}"
    towards = "<=" if args.metric in MINIMISED else ">="
    return (
        f"{args.workload}: {data.get('name')} ({partition}), {cfg.get('model', {}).get('name')}; target {args.metric} "
        f"{towards} {args.target:g}; inner optimizer {inner} for all; {args.seeds} seed(s)"
    )


def markdown(result: dict) -> str:
    metric = result.get("metric", "test_accuracy")  # a map.json written before the metric was a choice: accuracy
    towards = "<=" if metric in MINIMISED else ">="
    lines = [
        f"# Map: {result['workload']}",
        "",
        f"Target: {metric} {towards} {result['target']}; {result['seeds']} seed(s); peers {result['peers']}; "
        f"model {result['model_bytes'] / MB:.3g} MB; compute {result['compute_s'] * 1e3:.3g} ms a step (one core). "
        f"Command: `{result['command']}` ({result['elapsed_s']:.0f} s).",
        "",
        "Steps to the target on the fleet (per seed; - not reached):",
        "",
        "| algorithm | " + " | ".join(f"{n} peers" for n in result["peers"]) + " |",
        "|---|" + "---|" * len(result["peers"]),
    ]
    for label, per_n in result["steps"].items():
        lines.append(
            f"| {label} | "
            + " | ".join(
                ", ".join("-" if s is None else str(s) for s in per_n[str(n)]["steps"]) for n in result["peers"]
            )
            + " |"
        )
    lines += ["", "Where each algorithm wins:", "", *regions(result["cells"], result["axes"]), ""]
    if result["checks"]:
        lines += [
            "Checks (mpi peers: the cell's network emulated in sleep mode, or test hosts with capped links; compute "
            "floor per step as given):",
            "",
            "| cell | algorithm | link | peers per host | slowdown | compute floor | steps predicted / measured | "
            "predicted s | measured s | predicted / measured |",
            "|---|---|---|---|---|---|---|---:|---:|---:|",
        ]
        for c in result["checks"]:
            ratio = "-" if c["ratio"] is None else f"{c['ratio']:.3f}"
            link = c.get("link") or f"emulated {_rate(c['bandwidth_bytes_per_s'])}, {_seconds(c['latency_s'])}"
            measured = "-" if c["measured_s"] is None else f"{c['measured_s']:.3g}"
            lines.append(
                f"| {c['cell']} | {c['algorithm']} | {link} | {c['peers_per_host']} | {c['slowdown']:g} | "
                f"{c['compute_s'] * 1e3:g} ms | "
                f"{c['predicted_steps']} / {c['measured_steps']} | {c['predicted_s']:.3g} | {measured} | {ratio} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workload", help="default, or an experiment= preset's name")
    p.add_argument("--quick", action="store_true", help="a coarse grid, one seed, 4 and 8 peers")
    p.add_argument(
        "--algorithms",
        metavar="A,B,...",
        help=f"the algorithms compared (default {','.join(DEFAULT_ALGORITHMS)}); any of {', '.join(eligible())}",
    )
    p.add_argument("--peers", type=int, nargs="+", help="peer counts (default 4 8 16 32; quick: 4 8)")
    p.add_argument("--seeds", type=int, help="seeds per algorithm and peer count (default 3; quick: 1)")
    p.add_argument("--target", type=float, help=f"the value of --metric to reach (default per workload: {TARGETS})")
    p.add_argument(
        "--metric",
        help=f"a record's metric the target is of (default per workload, else test_accuracy; minimised: {MINIMISED})",
    )
    p.add_argument("--log-every", type=int, default=1, help="steps between evaluations (the steps' resolution)")
    p.add_argument("--epochs", type=int, help="the fleet runs' epochs (default: the workload's)")
    p.add_argument("--min-steps", type=int, default=120, help="more epochs where a peer count would take fewer")
    p.add_argument("--check-cells", type=int, default=3, help="cells checked against real runs (0: none)")
    p.add_argument("--check-peers", type=int, default=4, help="peers of the real runs (one of --peers)")
    p.add_argument("--check-compute-s", type=float, default=0.1, help="compute floor of each real step")
    p.add_argument(
        "--check-algorithms",
        nargs="+",
        metavar="LABEL",
        help="check these (the map's labels, e.g. 'dpsgd one-peer') in every checked cell; default: the two fastest",
    )
    p.add_argument(
        "--check-max-bandwidth",
        type=float,
        default=1.25e8,
        help="checked cells' links at most this many bytes/s (slow links: the link's cost, not this machine's, counts)",
    )
    p.add_argument(
        "--check-min-latency", type=float, default=0.0, help="checked cells' links at least this latency (seconds)"
    )
    p.add_argument("--test-hosts", metavar="RATE", help="also check 4 peers on 2 test hosts capped at RATE (root)")
    p.add_argument(
        "--test-host-backend",
        default="torch",
        choices=["mpi", "torch"],
        help="test-host runs' backend (torch: gloo's ring)",
    )
    p.add_argument("--test-host-compute-s", type=float, default=0.01, help="compute floor of the test-host runs")
    p.add_argument(
        "--test-host-tcp", help="the test hosts' TCP congestion control (default Reno; 'kernel': the kernel's)"
    )
    for axis, what in (
        ("bandwidths", "link bandwidths in bytes/s (e.g. 1.25e7 for 100 Mbit/s)"),
        ("latencies", "per-message latencies in seconds (e.g. 0.01)"),
        ("peers-per-host", "peers sharing a host's link"),
        ("slowdowns", "how many times slower the straggler (peer 1) is; 1: none"),
    ):
        p.add_argument(f"--{axis}", type=float, nargs="+", metavar="X", help=f"the grid's {what} (default: the grid's)")
    p.add_argument("--out", type=Path, help="default outputs/map/WORKLOAD")
    p.add_argument("overrides", nargs="*", help="more Hydra overrides for every run (e.g. data.alpha=0.1)")
    args = p.parse_intermixed_args(argv)
    started = time.perf_counter()
    args.peers = args.peers or ([4, 8] if args.quick else [4, 8, 16, 32])
    args.seeds = args.seeds or (1 if args.quick else 3)
    workload = workload_overrides(args.workload)  # an unknown workload first: no folder, no other complaint
    args.algorithms = chosen(args.algorithms)
    metric, target = TARGETS.get(args.workload, (None, None))
    args.metric = args.metric or metric or "test_accuracy"
    if args.target is None:
        if target is None or args.metric != metric:
            raise SystemExit(f"error: no default target for {args.workload!r}, {args.metric}; give --target (e.g. 0.9)")
        args.target = target
    checkable = [a.label for a in args.algorithms if a.kind != "async"]
    if unknown := set(args.check_algorithms or []) - set(checkable):
        raise SystemExit(f"error: --check-algorithms {sorted(unknown)}: expected labels among {checkable}")
    if args.check_cells and args.check_peers not in args.peers:
        raise SystemExit(f"error: --check-peers {args.check_peers} must be one of --peers {args.peers}")
    out = args.out or ROOT / "outputs" / "map" / args.workload
    out.mkdir(parents=True, exist_ok=True)
    base = [*workload, *pinned(workload), *args.overrides]
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(compose([*base, "backend=fleet"]), resolve=True)
    assert isinstance(cfg, dict)
    compute_s, args.model_bytes, train_size = measure_compute(cfg)
    print(f"{args.workload}: model {args.model_bytes / MB:.3g} MB, compute {compute_s * 1e3:.3g} ms a step")
    steps = fleet_steps(args, base, cfg, train_size, out)
    axes = grid(args.quick)
    for key, given in (
        ("bandwidth_bytes_per_s", args.bandwidths),
        ("latency_s", args.latencies),
        ("peers_per_host", [int(v) for v in args.peers_per_host] if args.peers_per_host else None),
        ("slowdown", args.slowdowns),
    ):
        axes[key] = sorted(given) if given else axes[key]
    found = cells(steps, axes, args.peers, args.model_bytes, compute_s, args.algorithms)
    rows = checks(args, base, cfg, steps, found, train_size, out) if args.check_cells else []
    if args.test_hosts:
        rows += test_host_checks(args, base, cfg, steps, train_size, out)
    command = "python -m experiments.map " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {
        "workload": args.workload, "overrides": base, "metric": args.metric, "target": args.target, "seeds": args.seeds,
        "peers": args.peers, "compute_s": compute_s, "model_bytes": args.model_bytes, "axes": axes,
        "steps": steps, "cells": found, "checks": rows, "command": command,
        "elapsed_s": time.perf_counter() - started,
    }  # fmt: skip
    (out / "map.json").write_text(json.dumps(result, indent=1))
    plot(found, axes, args.peers, out / "map.png", args.algorithms, title=map_title(args, cfg))
    (out / "map.md").write_text(markdown(result))
    print(markdown(result))
    print(f"map: {out / 'map.json'}, {out / 'map.png'}, {out / 'map.md'} ({result['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
