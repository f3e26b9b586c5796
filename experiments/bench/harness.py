"""The benchmarks' harness: one registry (`BENCHES`), one parser and one result writer for all of them; their command
line (experiments.bench.cli):

    python -m experiments.bench --list                  # a line per benchmark: its name and what it compares
    python -m experiments.bench NAME [--quick] [...]    # one benchmark (as python -m experiments.bench.NAME)
    python -m experiments.bench --all [--quick]         # every benchmark of `make bench`, one after the other
    python -m experiments.bench --regression [--dry]    # make bench-quick (experiments.bench.regression)

A benchmark is a module of this package with `options(parser)` (its own options, if any), `run(args) -> Result`
(measure, print its table, return what the writer writes) and, if it spawns ranks, `worker(args)`
(experiments.bench.ranks).
Its record below names the options it shares with the others (`SHARED`) and their defaults there, and what
`--quick` means for it. The writer puts every result in one shape: benchmark, date, machine, command line,
targets (each a ratio measured side by side in one run, its limit, its noise where the benchmark repeats both sides,
PASS, MISS or MISS within noise, and a miss's measured cause),
then the benchmark's own keys. `run_config` composes an experiment's config, `run_app` runs the app.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dpsgd.config import RunConfig
from dpsgd.config import parse as parse_config

ROOT = Path(__file__).resolve().parent.parent.parent
OUT_DIR = Path("outputs") / "bench"  # relative to where the command runs, as the app's outputs/


@dataclass(frozen=True)
class Bench:
    """A benchmark's record: what it compares, the shared options it takes (with its defaults), its quick form."""

    name: str
    compares: str  # one line for --list
    shared: dict = field(default_factory=dict)  # SHARED option -> this benchmark's default
    quick: tuple[str, ...] | None = None  # --quick: these options first (the command line's own win); None: no quick
    in_make_bench: bool = True
    needs: str = ""  # what it needs beyond this machine (why it is not in `make bench`)
    out: str | None = None  # its result's default path; None: outputs/bench/NAME.json
    keep_freed_memory: bool = False  # run with glibc keeping freed buffers, as spawned peers do (peer_env)


RANKS = {"timeout": 600.0, "return_freed_memory": False}  # what every benchmark on spawned ranks takes
BENCHES = (
    Bench("comm_overhead", "the communicator's neighbor_exchange (new buffers, out=), neighbor_average and "
          "allreduce_mean against raw mpi4py and torch.distributed, 1-44 MiB on 4 ranks",
          {"peers": 4, "reps": 30, "warmup": 3, "floor_reps": 10, **RANKS},
          quick=("--sizes-mb", "1", "11", "--reps", "20")),
    Bench("allreduce_vs_ddp", "a training step of AllReduce (with and without overlap; torch and mpi backends) "
          "against DistributedDataParallel",
          {"peers": 4, "reps": 40, "warmup": 5, "floor_reps": 10, "seed": 0, "batch": 32, **RANKS},
          quick=("--reps", "10", "--warmup", "3", "--check-steps", "3")),
    Bench("waiter_cost", "a computing rank's speed while its partner waits in the toolkit, against the partner asleep "
          "and in MPICH's blocking receive", {"peers": 4, "rounds": 10, "warmup": 3, **RANKS}, quick=()),
    Bench("step_work", "the step module (schedule, precision, clipping, GradScaler agreement, accumulation) against "
          "the same step by hand with torch's idioms", {"rounds": 20}, quick=("--rounds", "6", "--steps", "3")),
    Bench("local_sgd_vs_torch", "LocalSGD against torch's post-local SGD (PostLocalSGDOptimizer): time per step and "
          "parameters", {"peers": 4, "floor_reps": 10, "seed": 0, "batch": 32, **RANKS},
          quick=("--warmup-steps", "8", "--windows", "10")),
    Bench("step_time_vs_network", "the emulated step time of six algorithms over the network presets at 4-16 peers "
          "against the closed-form cost model", {"peers": [4, 8, 16], "timeout": 900.0},
          quick=("--peers", "4", "8", "--sizes", "0.27M")),
    Bench("time_to_accuracy", "the emulated time to a test accuracy of five algorithms against AllReduce's",
          {"peers": 8, "epochs": 15, "seed": 0, "timeout": 600.0}, quick=("--peers", "4", "--epochs", "8")),
    Bench("overlap", "D-PSGD with overlap against without: the share of communication it hides",
          {"peers": 4, "steps": 40, "timeout": 600.0}, quick=("--steps", "10")),
    Bench("stragglers", "AD-PSGD's and all-reduce's throughput with one 4x slower peer against without",
          {"peers": 8, "epochs": 30, "seed": 0, "timeout": 600.0}, quick=("--peers", "4", "--epochs", "10")),
    Bench("fleet", "the fleet simulator against the local backend's threads at 64 peers; the largest fleet at >= 10 "
          "steps/s", {"peers": 64, "batch": 16, "steps": 30, "repeats": 3},
          quick=("--steps", "10", "--repeats", "2", "--max-peers", "1024")),
    Bench("fleet_vs_batch", "the fleet's samples per second against one model at batch n*b and its memory floor",
          {"steps": 3, "repeats": 3}, quick=(), keep_freed_memory=True),
    Bench("bytes_to_accuracy", "MB and emulated time to a test accuracy per method and compression against exact "
          "all-reduce (a table, no target)", {"peers": 4, "epochs": 30, "seed": 0, "timeout": 600.0},
          quick=("--epochs", "10")),
    Bench("robust_cost", "the divergence check and each robust rule's combine against the training step and the "
          "plain weighted sum", {"rounds": 30}, quick=("--rounds", "10")),
    Bench("chaos", "an elastic run on torchrun that loses and regains peers against the undisturbed run of its seed",
          {"peers": 8, "epochs": 30, "seed": 0, "timeout": 900.0}, in_make_bench=False,
          needs="about 10 minutes (make chaos)", out="outputs/bench/chaos/chaos.json",
          quick=("--peers", "4", "--kill", "1", "--add", "1", "--algorithms", "dpsgd", "--epochs", "20")),
    Bench("fleet_gpu", "ResNet-20 fleets of 64-4096 peers on one GPU: steps per second and memory",
          {"batch": 8, "steps": 3}, in_make_bench=False, needs="a GPU (make gpu-check runs it)",
          quick=("--max-peers", "256")),
    Bench("gpu_check", "the prepared GPU check: peers and fleets on the GPU against the same runs on the CPU",
          in_make_bench=False, needs="a GPU (make gpu-check; GPU_CHECK_DRY=1 runs it on the CPU)",
          out=os.environ.get("GPU_CHECK_OUT", "outputs/gpu_check.json")),
    Bench("wire_bytes", "bytes on the wire between two test hosts against the toolkit's own count", in_make_bench=False,
          needs="root: test hosts (tools/testhosts.py)",
          quick=("--backends", "torch", "--topologies", "ring", "--epochs", "1", "2")),
    Bench("calibrate", "a test-host link's latency and bandwidth from a gloo ping-pong, as a network preset",
          in_make_bench=False, needs="root: test hosts (tools/testhosts.py)"),
    Bench("emulator_vs_link", "the emulator's step time against a capped link between two test hosts",
          {"steps": 8, "batch": 64, "rounds": 3}, in_make_bench=False, needs="root: test hosts (tools/testhosts.py)",
          quick=("--rates", "1gbit", "--algorithms", "allreduce", "--steps", "4", "--rounds", "1")),
    Bench("two_way_tcp", "plain TCP flows through a capped link, both ways at once against one way",
          {"reps": 6}, in_make_bench=False, needs="root: test hosts (tools/testhosts.py)",
          quick=("--sizes", "1125000", "--flows", "1", "--cc", "reno", "--reps", "3")),
)  # fmt: skip
BY_NAME = {b.name: b for b in BENCHES}

# the options several benchmarks share: (flags, type, help); a benchmark's record gives its default
SHARED: dict[str, tuple[tuple[str, ...], type, str]] = {
    "peers": (("--peers",), int, "peers: MPI ranks, processes of the app, or the fleet's size"),
    "reps": (("--reps",), int, "timed repetitions (the median counts)"),
    "warmup": (("--warmup",), int, "untimed repetitions before them"),
    "floor_reps": (("--floor-reps",), int, "repetitions of the loopback floor's measurement"),
    "rounds": (("--rounds",), int, "alternated rounds of each side"),
    "steps": (("--steps",), int, "timed steps per measurement"),
    "repeats": (("--repeats",), int, "alternated measurements of each side (the best counts)"),
    "epochs": (("--epochs",), int, "epochs of each run"),
    "batch": (("--batch", "--batch-size"), int, "samples per peer per step"),
    "seed": (("--seed",), int, "seed of the models, data and batches"),
    "timeout": (("--timeout", "--timeout-s"), float, "seconds for all the processes of one measurement"),
    "return_freed_memory": (
        ("--return-freed-memory",),
        bool,
        "run the ranks with glibc's default of returning freed large buffers to the kernel (spawned peers keep "
        "them: MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_)",
    ),
}


class BenchError(RuntimeError):
    """A benchmark that could not measure (a run failed, ranks did not finish): its message is the one line shown."""


# --- targets and results ------------------------------------------------------------------


NOISE_LEVEL = 0.95  # the share of a ratio's bootstrap distribution a benchmark states as its noise


def ratio_interval(ours, theirs, draws: int = 2000, seed: int = 0) -> tuple[float, float] | None:
    """The run's own noise on median(ours) / median(theirs), times of the same repetitions (each repetition timed
    both sides back to back): a paired bootstrap over the repetitions, the central NOISE_LEVEL of the resampled
    ratios. It measures the spread within this run, not a drift between runs. 2-D `ours` and `theirs` (repetitions x
    peers) give the interval of the mean over the peers of each one's median (waiter_cost's ratio). None with fewer
    than two repetitions (no spread to state). A percentile interval from a few repetitions need not hold the figure
    itself (it may sit at an edge): the benchmarks' defaults repeat 10 to 150 times."""
    import numpy as np

    a, b = np.asarray(ours, dtype=np.float64), np.asarray(theirs, dtype=np.float64)
    if a.shape != b.shape or a.ndim not in (1, 2):
        raise ValueError(
            f"ratio_interval needs two equally long lists of repetitions, got shapes {a.shape} and {b.shape}"
        )
    if len(a) < 2:
        return None
    a, b = (a, b) if a.ndim == 2 else (a[:, None], b[:, None])
    picks = np.random.default_rng(seed).integers(0, len(a), size=(draws, len(a)))
    ratios = np.median(a[picks], axis=1).mean(axis=1) / np.median(b[picks], axis=1).mean(axis=1)
    low, high = np.quantile(ratios, [(1 - NOISE_LEVEL) / 2, (1 + NOISE_LEVEL) / 2])
    return float(low), float(high)


@dataclass
class Target:
    """`ratio` (ours / reference, measured side by side in one run) at most `limit` and at least `at_least` (either
    may be None); `passed` overrides the verdict where a target has another way to hold (fleet_vs_batch's MLP).
    `cause`: for a miss, where the excess went, as the benchmark measured it. `interval`: the run's own noise on the
    ratio (`ratio_interval`), where the benchmark repeats both sides: a miss whose target lies inside it is said
    "within noise", one this run cannot tell from a pass (it still does not hold)."""

    name: str
    ratio: float
    limit: float | None = None
    unit: str = "x"  # "" for a figure that is not a ratio (e.g. a parameter difference)
    at_least: float | None = None
    cause: str | None = None
    passed: bool | None = None
    interval: tuple[float, float] | None = None

    @property
    def holds(self) -> bool:
        if self.passed is not None:
            return self.passed
        return (self.limit is None or self.ratio <= self.limit) and (
            self.at_least is None or self.ratio >= self.at_least
        )

    @property
    def within_noise(self) -> bool:
        """A miss whose limits the run's interval reaches: the ratio cannot be told from one that holds."""
        if self.holds or self.interval is None:
            return False
        low, high = self.interval
        return (self.limit is None or low <= self.limit) and (self.at_least is None or high >= self.at_least)

    @property
    def verdict(self) -> str:
        return "PASS" if self.holds else "MISS within noise" if self.within_noise else "MISS"

    def wanted(self) -> str:
        parts = [f">= {self.at_least:g}{self.unit}"] if self.at_least is not None else []
        return " and ".join(parts + ([f"<= {self.limit:g}{self.unit}"] if self.limit is not None else []))

    def figure(self) -> str:
        """The ratio as printed, followed by its interval where the benchmark states one."""
        noise = "" if self.interval is None else f" [{self.interval[0]:.3f}, {self.interval[1]:.3f}]"
        if self.unit == "x":
            return f"{self.ratio:7.3f}x{noise}"
        if float(self.ratio).is_integer():
            return f"{self.ratio:8.0f}{self.unit}{noise}"
        return f"{self.ratio:8.2g}{self.unit}{noise}"

    def as_dict(self) -> dict:
        found = {"holds": self.holds, "within_noise": self.within_noise, "cause": None if self.holds else self.cause}
        return {**asdict(self), **found}

    def line(self) -> str:
        text = f"{self.name:52s} {self.figure()}  (target {self.wanted()})  {self.verdict}"
        return text + (f"\n  cause: {self.cause}" if self.cause and not self.holds else "")


@dataclass
class Result:
    """What a benchmark's run gives the writer: its own keys, its targets, and problems that make it fail (exit 1)."""

    data: dict
    targets: list[Target] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def machine() -> dict:
    import torch

    return {
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def write(args, data: dict, targets: list[Target] = ()) -> dict:
    """The one result writer: benchmark, date, machine, command line, targets, then the benchmark's own keys, as
    JSON at `args.out`. A benchmark may call it while it runs (the rows measured so far); the harness calls it last."""
    out = {
        "benchmark": args.bench,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": machine(),
        "command": getattr(args, "command", None) or f"python -m experiments.bench {args.bench} " + " ".join(args.argv),
        "targets": [t.as_dict() for t in targets],
        **data,
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, default=str) + "\n")
    return out


def print_table(headers: list[str], rows: list[list], floatfmt: str = ".2f") -> None:
    """Right-aligned plain text (first column left-aligned); floats formatted with `floatfmt`."""
    cells = [[format(c, floatfmt) if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]

    def fmt(row):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    print(fmt(headers))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print(fmt(r))


def print_columns(rows: list[dict], columns: list[str], floatfmt: str = ".4g") -> None:
    """A table of `rows` (dicts) with `columns` as headers; a missing value as '-'."""
    print_table(columns, [[r[c] if r.get(c) is not None else "-" for c in columns] for r in rows], floatfmt)


def print_targets(targets: list[Target]) -> None:
    if targets:
        print()
        held, noisy = sum(t.holds for t in targets), sum(t.within_noise for t in targets)
        for t in targets:
            print(t.line())
        noise = [t for t in targets if t.interval is not None]
        if noise:
            print(
                f"[low, high]: the central {NOISE_LEVEL:.0%} of the ratio over this run's repetitions resampled (a "
                f"paired bootstrap): its noise within the run, not between runs"
            )
        print(f"targets held: {held}/{len(targets)}" + (f"; {noisy} more missed within noise" if noisy else ""))


# --- an experiment's config and the app -----------------------------------------------------


def run_config(*overrides: str) -> RunConfig:
    """An experiment's typed config as the app composes and parses it: conf/config.yaml with Hydra's `overrides`
    (e.g. "backend=fleet", "peers=64", "data.num_samples=2000"). Every benchmark that builds a run in its own process
    (Fleet, build_peer, plan, the event simulator) takes its config from here."""
    from experiments.validate import compose

    return parse_config(compose(list(overrides)))


def network_preset(name: str) -> dict:
    """conf/network/NAME.yaml as the typed config reads it, as plain keys (what a rank receives as JSON)."""
    return dataclasses.asdict(run_config(f"network={name}").network)


def fleet_overrides(peers: int, batch: int, data: str = "digits", **data_options) -> list[str]:
    """The fleet benchmarks' run: D-PSGD on the one-peer exponential graph, the MLP, one epoch, `data` with
    `data_options` (e.g. num_samples=2000); add overrides after these to change any of it."""
    return [
        "backend=fleet",
        "algorithm=dpsgd",
        "topology=one_peer_exponential",
        "model=mlp",
        f"data={data}",
        *(f"data.{k}={v}" for k, v in data_options.items()),
        "network=loopback",
        f"peers={peers}",
        f"batch_size={batch}",
        "epochs=1",
        "log_every=1000",
        "comm.timeout_s=600",
    ]


def run_app(overrides: list[str], run_dir: Path, timeout_s: float, env: dict | None = None) -> tuple[dict, list]:
    """One run of the app (`python -m experiments.train OVERRIDES`) in `run_dir`, its peers spawned with the
    toolkit's environment: (summary.json, the records of metrics.jsonl). A failed run raises BenchError naming it."""
    from dpsgd.backends import peer_env

    cmd = [sys.executable, "-m", "experiments.train", *overrides, f"hydra.run.dir={run_dir}"]
    env = env if env is not None else peer_env({"DPSGD_PROGRESS": "0"})
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        last = lines[-1] if lines else "(no output)"
        raise BenchError(f"the app's run `{' '.join(overrides)}` exited {proc.returncode}: {last}")
    return json.loads((run_dir / "summary.json").read_text()), records(run_dir)


def records(run_dir: Path) -> list[dict]:
    """The records of a run's metrics.jsonl so far (a line being written is left out)."""
    path = run_dir / "metrics.jsonl"
    found = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            found.append(json.loads(line))
        except ValueError:
            pass
    return found


# --- the command line -------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        self.exit(2, f"error: {self.prog}: {message}; see {self.prog} --help\n")


def lookup(name: str) -> Bench:
    if name not in BY_NAME:
        raise SystemExit(
            f"error: no benchmark {name!r}; the benchmarks: {', '.join(BY_NAME)} (--list says what each compares)"
        )
    return BY_NAME[name]


def module(bench: Bench):
    return importlib.import_module(f"experiments.bench.{bench.name}")


def parser(bench: Bench, mod) -> Parser:
    """The skeleton (the shared options the record names, --quick, --out) and the benchmark's own options."""
    p = Parser(
        prog=f"python -m experiments.bench {bench.name}",
        description=mod.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for key, default in bench.shared.items():
        flags, kind, text = SHARED[key]
        if kind is bool:
            p.add_argument(*flags, dest=key, action="store_true", help=text)
        else:
            many = isinstance(default, list)
            p.add_argument(*flags, dest=key, type=kind, default=default, nargs="+" if many else None,
                           help=f"{text} (default {' '.join(map(str, default)) if many else default})")  # fmt: skip
    if bench.quick is not None:
        shown = " ".join(bench.quick) or "its default sizes"
        p.add_argument("--quick", action="store_true", help=f"the quick form: {shown}")
    p.add_argument("--out", type=Path, default=Path(bench.out or OUT_DIR / f"{bench.name}.json"), help="result JSON")
    if hasattr(mod, "options"):
        mod.options(p)
    return p


def parse(bench: Bench, mod, argv: list[str]) -> argparse.Namespace:
    given = list(argv)
    if "--quick" in given and bench.quick:
        given = [*bench.quick, *given]  # the command line's own options come later and win
    args = parser(bench, mod).parse_args(given)
    args.bench, args.argv = bench.name, list(argv)
    args.quick = getattr(args, "quick", False)
    return args


def execute(bench: Bench, args: argparse.Namespace) -> dict:
    """Run the benchmark, print its targets, write its result; returns what was written. Raises BenchError."""
    result = module(bench).run(args)
    print_targets(result.targets)
    written = write(args, {**result.data, "problems": result.problems}, result.targets)
    for problem in result.problems:
        print(f"problem: {problem}", flush=True)
    print(f"written: {args.out}", flush=True)
    if result.problems:
        raise BenchError(f"{bench.name}: {len(result.problems)} problem(s), the first: {result.problems[0]}")
    return written


def run_bench(name: str, argv: list[str]) -> dict:
    """One benchmark in this process with `argv` (its options): what it wrote. Raises BenchError or SystemExit."""
    bench = lookup(name)
    return execute(bench, parse(bench, module(bench), argv))


def listing() -> str:
    lines = []
    for b in BENCHES:
        where = "" if b.in_make_bench else f"  [not in make bench: {b.needs}]"
        lines.append(f"{b.name:22s} {b.compares}{where}")
    return "\n".join(lines)
