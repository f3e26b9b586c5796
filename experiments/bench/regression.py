"""`make bench-quick` (`python -m experiments.bench --regression`): the regression check, at most 5 minutes on 2 cores.

It runs, one after the other and each in its quick form, the benchmarks whose figures guard the communication,
optimizer and step code: comm_overhead at 1 and 11 MiB (mpi and torch: neighbor_exchange with new buffers and
with out=, neighbor_average, allreduce_mean), allreduce_vs_ddp (AllReduce with overlap against DDP), waiter_cost,
step_work (the step module against torch's idioms) and fleet_vs_batch --quick (without its vmap side, a figure shown
and not a target).
Every figure is a ratio its benchmark measured side by side in one run, so a loaded machine slows both sides
and does not fake a regression. Each is printed PASS, MISS or NOISE (a miss whose target lies inside the run's own
95% interval of the ratio, printed beside it where the benchmark repeats both sides) against its target, beside
the figure the results
pages record for it (experiments/bench/recorded.yaml, with the page and date each came from) and whether it is
better, within or worse than that; under a MISS, the cause the benchmark measured (e.g. comm_overhead's split
into MPI's non-blocking path and the toolkit's waiting). A MISS is information: the command exits 0; a broken
benchmark (one that could not measure) exits 1.

`--dry`: the same benchmarks at tiny sizes (seconds): a check of the harness and of this comparison, whose
figures mean nothing.
"""

from __future__ import annotations

import argparse
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import yaml

from experiments.bench import harness

RECORDED = Path(__file__).with_name("recorded.yaml")
# each benchmark's options here, and with --dry (tiny sizes: the harness and the comparison, in seconds)
RUNS = {
    "comm_overhead": (["--quick"], ["--quick", "--reps", "2", "--warmup", "1", "--floor-reps", "2"]),
    "allreduce_vs_ddp": (["--quick"], ["--hidden", "16", "--batch", "4", "--reps", "2", "--warmup", "1",
                                       "--check-steps", "2", "--floor-reps", "2"]),
    "waiter_cost": (["--quick"], ["--matmuls", "5", "--matrix", "64", "--rounds", "2", "--warmup", "1"]),
    "step_work": (["--quick"], ["--rounds", "1", "--steps", "1"]),
    "fleet_vs_batch": (["--quick", "--without-vmap"], ["--models", "mlp", "--peers", "64", "--steps", "1",
                                                       "--repeats", "1", "--bandwidth-mib", "8"]),
}  # fmt: skip


@dataclass(frozen=True)
class Recorded:
    """A figure a results page records for one target, and where it came from."""

    bench: str
    target: str
    low: float
    high: float
    page: str
    where: str
    date: str

    def figure(self) -> str:
        def two_decimals_at_least(x: float) -> str:
            whole, _, part = f"{x:.3f}".rstrip("0").partition(".")
            return f"{whole}.{part:0<2}"

        low, high = two_decimals_at_least(self.low), two_decimals_at_least(self.high)
        return low if low == high else f"{low}-{high}"


def load_recorded(path: Path = RECORDED) -> list[Recorded]:
    found = []
    for entry in yaml.safe_load(path.read_text()):
        value = entry["recorded"]
        low, high = (value, value) if isinstance(value, (int, float)) else value
        source = (entry["page"], entry["where"], str(entry["date"]))
        found += [Recorded(entry["bench"], name, float(low), float(high), *source) for name in entry["targets"]]
    return found


@dataclass(frozen=True)
class Verdict:
    """One recorded figure against what this run measured for its target (None: not measured)."""

    recorded: Recorded
    measured: dict | None  # the target as the benchmark wrote it: name, ratio, limit, at_least, unit, holds, cause

    @property
    def state(self) -> str:
        """PASS, MISS, NOISE (a miss within the run's noise: `harness.Target.within_noise`) or ---- (not measured)."""
        if self.measured is None:
            return "----"
        return "PASS" if self.measured["holds"] else "NOISE" if self.measured.get("within_noise") else "MISS"

    def against_recorded(self) -> str:
        """better, within or worse than the recorded figure (for a target with a lower limit, higher is better)."""
        m, r = self.measured, self.recorded
        if m is None:
            return ""
        higher_is_better = m.get("limit") is None and m.get("at_least") is not None
        if r.low <= m["ratio"] <= r.high:
            return "within recorded"
        above = m["ratio"] > r.high
        return "better than recorded" if above == higher_is_better else "worse than recorded"

    def line(self) -> str:
        r, m = self.recorded, self.measured
        name = f"{r.bench}: {r.target}"
        source = f"recorded {r.figure()} ({Path(r.page).name}, {r.date})"
        if m is None:
            return f"{self.state:5s}  {name:64s} not measured in this run; {source}"
        interval = tuple(m["interval"]) if m.get("interval") else None
        target = harness.Target(
            m["name"], m["ratio"], m.get("limit"), m.get("unit", "x"), m.get("at_least"), interval=interval
        )
        text = (
            f"{self.state:5s}  {name:64s} {target.figure()}  target {target.wanted():9s} {source}: "
            f"{self.against_recorded()}"
        )
        return text + (f"\n      cause: {m['cause']}" if m.get("cause") and not m["holds"] else "")


def compare(measured: dict[tuple[str, str], dict], recorded: list[Recorded]) -> list[Verdict]:
    """Each recorded figure with the target of the same benchmark and name that this run measured, if any."""
    return [Verdict(r, measured.get((r.bench, r.target))) for r in recorded]


def summary(verdicts: list[Verdict], broken: list[str]) -> str:
    states = [v.state for v in verdicts]
    worse = sum(v.against_recorded() == "worse than recorded" for v in verdicts)
    line = (
        f"{states.count('PASS')} PASS, {states.count('NOISE')} MISS within noise (NOISE), {states.count('MISS')} MISS, "
        f"{states.count('----')} not measured, {worse} worse than recorded; a MISS is information (exit 0)"
    )
    return line + (f"; broken (exit 1): {'; '.join(broken)}" if broken else "")


def main(argv: list[str]) -> int:
    p = harness.Parser(prog="python -m experiments.bench --regression", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--dry", action="store_true", help="tiny sizes, in seconds: the harness and the comparison")
    p.add_argument("--out", type=Path, default=harness.OUT_DIR / "quick", help="folder of the benchmarks' JSON")
    args = p.parse_args(argv)
    recorded = load_recorded()
    load, begun = os.getloadavg(), time.monotonic()
    print(f"bench-quick{' (dry: tiny sizes, the figures mean nothing)' if args.dry else ''}: {', '.join(RUNS)}; "
          f"load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)  # fmt: skip
    measured: dict[tuple[str, str], dict] = {}
    broken = []
    for bench, (quick, dry) in RUNS.items():
        options = [*(dry if args.dry else quick), "--out", str(args.out / f"{bench}.json")]
        print(f"\n== {bench} {' '.join(options)}", flush=True)
        try:
            written = harness.run_bench(bench, options)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - a broken benchmark: said, and the next one runs
            if not isinstance(exc, (harness.BenchError, SystemExit)):
                traceback.print_exc()
            broken.append(f"{bench}: {exc}")
            continue
        measured.update({(bench, t["name"]): t for t in written["targets"]})
    verdicts = compare(measured, recorded)
    after, took = os.getloadavg(), time.monotonic() - begun
    print(f"\nbench-quick: {len(verdicts)} figures, each a ratio measured side by side in one run; {took:.0f} s, "
          f"load {load[0]:.2f} -> {after[0]:.2f}; recorded figures: {RECORDED.relative_to(harness.ROOT)}")  # fmt: skip
    for v in verdicts:
        print(v.line())
    print(summary(verdicts, broken), flush=True)
    command = " ".join(["python -m experiments.bench --regression", *argv])
    report = argparse.Namespace(bench="bench-quick", command=command, out=args.out / "bench_quick.json")
    rows = [{**vars(v.recorded), "measured": v.measured, "state": v.state, "against_recorded": v.against_recorded()}
            for v in verdicts]  # fmt: skip
    harness.write(report, {"seconds": took, "load": [load[0], after[0]], "verdicts": rows, "broken": broken})
    return 1 if broken else 0
