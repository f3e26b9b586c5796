"""Reproductions in miniature: `python -m experiments.reproduce NAME [--seeds N] [--out DIR] [--docs] [overrides]`.

Each reproduction, a module experiments/reproductions/NAME.py, names a paper's claim, the sweeps that test it
(`SWEEPS`: name -> overrides of `experiments.train -m`, run over seeds 0 .. N-1) and how to read them
(`analyze`): a table of the paper's reported shape beside ours, plots, and a verdict computed from the measured
numbers, never written by hand. Writes OUT/result.md and OUT/result.json (default outputs/reproductions/NAME);
`--docs` also copies the plots into docs/reproductions/ (the figures docs/reproductions.md shows). Extra overrides
apply to every run (`peers=32`, `backend=mpi`). The same command again reads the sweeps that are complete.
`--list` names the reproductions.

A reproduction that tunes (kale2025) also declares `SEARCH` (name -> overrides sweeping a grid on a validation
split, `SEARCH_RUNS` settings each) and `choose(searched)`: the search runs first (`--search-seeds` seeds, default
1), then each sweep runs with the values `choose` picked for it (written to OUT/SWEEP.chosen.json; a finished sweep
run with other values is an error, not reused). `--no-search` runs the sweeps at their own (the paper's) settings.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from experiments import captions, reproductions
from experiments.intervals import summarize
from experiments.plots import Page, draw_band, limits_words
from experiments.report import group_by_seed, load_runs, swept_keys, value
from experiments.sweeps import finished, run_sweep

DOCS = Path(__file__).resolve().parent.parent / "docs" / "reproductions"


@dataclass
class Finding:
    """What a reproduction concludes: `table` (markdown, the paper's shape beside ours), `verdict` (one paragraph,
    starting with holds / does not hold / partly holds), `holds` (True, False or None for partly), plot files."""

    table: str
    verdict: str
    holds: bool | None
    plots: list[Path] = field(default_factory=list)


@dataclass
class Configuration:
    """The runs of one setting over its seeds: `setting` (the swept keys' values), `summary` (means, KEY_ci95 the
    95% Student-t half widths, `seeds`), `runs` (report.load_runs' records)."""

    setting: dict
    summary: dict
    runs: list[dict]

    def mean(self, key: str) -> float:
        return float(self.summary[key])

    def ci(self, key: str) -> float:
        return float(self.summary.get(f"{key}_ci95", 0.0))

    def text(self, key: str, digits: int = 4) -> str:
        """'mean ± half width' (the mean alone for one seed)."""
        ci = self.summary.get(f"{key}_ci95")
        return f"{self.mean(key):.{digits}f}" + (f" ± {ci:.{digits}f}" if ci is not None else "")


def configurations(runs: list[dict]) -> list[Configuration]:
    """The sweep's runs grouped by setting (runs differing only by seed are one), in the order they first appear."""
    keys, groups = group_by_seed(runs, swept_keys(runs))
    return [Configuration({k: value(g[0], k) for k in keys}, summarize([r["summary"] for r in g]), g) for g in groups]


def find(configs: list[Configuration], **setting) -> Configuration:
    """The one configuration whose swept values include `setting` (keys with dots written as __)."""
    wanted = {k.replace("__", "."): v for k, v in setting.items()}
    hits = [c for c in configs if all(c.setting.get(k) == v for k, v in wanted.items())]
    if len(hits) != 1:
        raise LookupError(f"{len(hits)} configurations match {wanted}; have {[c.setting for c in configs]}")
    return hits[0]


def plot_curves(
    configs: list[Configuration],
    x_key: str,
    y_keys: list[tuple[str, str]],
    path: Path,
    title: str,
    x_label: str | None = None,
    label=None,
    log_x: bool = False,
) -> Path:
    """One panel per (metric, axis label) in `y_keys`, one line per configuration against `x_key` (a metrics.jsonl
    field): the mean over its seeds in a band of the 95% interval, cut where the quantity ends. `label(config)`
    names a line (default: its setting in words). The figure's caption says what was run, what the bands are and
    which clock a time axis is on (experiments.captions)."""
    runs = [r for c in configs for r in c.runs]
    seed_counts = [len(c.runs) for c in configs]
    timed = [r for r in runs if any(m.get(x_key) is not None for m in r["metrics"])]
    clock = " ".join(captions.clocks(timed, {x_key}))
    bounds = limits_words([y for y, _ in y_keys])
    caption = captions.figure_caption(runs, swept_keys(runs), seed_counts, clock, bounds)
    page = Page(len(y_keys), title, caption, len(configs))
    for ax, (y_key, y_label) in zip(page.axes, y_keys):
        for config in configs:
            name = label(config) if label else captions.legend(config.runs[0], config.setting)
            draw_band(ax, config.runs, x_key, y_key, name)
        if log_x:
            ax.set_xscale("log")
        ax.set_xlabel(x_label or (captions.clock_label(timed, x_key) if x_key.endswith("time_s") else x_key))
        ax.set_ylabel(y_label)
        ax.grid(alpha=0.3)
    return page.save(path)


def fleet_threads(overrides: list[str]) -> list[str]:
    """A fleet sweep runs on one torch thread unless told otherwise: these models are small, a second thread
    mostly waits for a core (a 64-peer run took 60 s against 9 s on a loaded machine, with the same numbers),
    and one thread makes the sweep's time its CPU time."""
    fleet = "backend=fleet" in overrides
    return ["backend.threads=1"] if fleet and not any(o.startswith("backend.threads=") for o in overrides) else []


def _children_cpu_s() -> float:
    """CPU seconds (user + sys) of this process's finished children and the children they waited for."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(reproductions.__path__) if not m.name.startswith("_"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.reproduce", description=__doc__.split("\n")[0], epilog="Other arguments: overrides."
    )
    parser.add_argument("name", nargs="?", help="a reproduction (--list names them)")
    parser.add_argument("--list", action="store_true", help="name the reproductions and their papers")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1 per setting (default 3)")
    parser.add_argument("--out", type=Path, default=None, help="default outputs/reproductions/NAME")
    parser.add_argument("--docs", action="store_true", help="copy the plots into docs/reproductions/")
    parser.add_argument("--search-seeds", type=int, default=None, help="seeds per setting of a search (default 1)")
    parser.add_argument("--no-search", action="store_true", help="skip a search: the sweeps at their own settings")
    args, overrides = parser.parse_known_args(argv)
    if args.list or not args.name:
        width = max(map(len, available()))
        for name in available():
            module = importlib.import_module(f"experiments.reproductions.{name}")
            tuned = " (tunes by a search first)" if getattr(module, "SEARCH", None) else ""
            print(f"{name:<{width}}  {module.PAPER}{tuned}")
        return 0 if args.list else 2
    if args.name not in available():
        parser.error(f"no reproduction named {args.name!r}; choose one of {', '.join(available())}")
    if any(o.startswith("-") for o in overrides):
        parser.error(f"unknown option(s): {' '.join(o for o in overrides if o.startswith('-'))}")
    if args.seeds < 1 or (args.search_seeds is not None and args.search_seeds < 1):
        parser.error("--seeds and --search-seeds must be >= 1")
    module = importlib.import_module(f"experiments.reproductions.{args.name}")
    if args.search_seeds is not None and (args.no_search or not getattr(module, "SEARCH", None)):
        parser.error(f"--search-seeds: {args.name} runs no search" + (" with --no-search" if args.no_search else ""))
    search_seeds = args.search_seeds or 1
    out = args.out or Path("outputs/reproductions") / args.name
    out.mkdir(parents=True, exist_ok=True)

    runs, timings = {}, []
    searches = {} if args.no_search else getattr(module, "SEARCH", {})
    expected = {sweep: module.RUNS[sweep] * args.seeds for sweep in module.SWEEPS}
    search_runs = {name: module.SEARCH_RUNS[name] * search_seeds for name in searches}
    if not all(finished(out / "search" / name, n) for name, n in search_runs.items()):
        _refuse_stale(out, expected, None)  # before the search's minutes, not after them
    for name, search_overrides in searches.items():
        folder = out / "search" / name
        runs[f"search/{name}"] = _sweep(
            args.name, folder, search_runs[name], search_overrides, overrides, search_seeds, timings
        )
    chosen = module.choose({n: configurations(runs[f"search/{n}"]) for n in searches}) if searches else {}
    _refuse_stale(out, expected, chosen)
    for sweep, sweep_overrides in module.SWEEPS.items():
        picked = chosen.get(sweep, [])
        if not finished(out / sweep, expected[sweep]):  # what it runs with, kept beside it
            (out / sweep).parent.mkdir(parents=True, exist_ok=True)
            chosen_record(out / sweep).write_text(json.dumps(picked) + "\n")
        runs[sweep] = _sweep(
            args.name, out / sweep, expected[sweep], [*sweep_overrides, *picked], overrides, args.seeds, timings
        )
    seconds = sum(t["seconds"] for t in timings)
    cpu_seconds = sum(t["cpu_seconds"] for t in timings)
    load_before = max((t["load_average"][0] for t in timings), default=os.getloadavg()[0])
    finding = module.analyze({k: configurations(v) for k, v in runs.items()}, out)

    command = " ".join(["python -m experiments.reproduce", *(sys.argv[1:] if argv is None else argv)])
    result = {
        "name": args.name,
        "paper": module.PAPER,
        "claim": module.CLAIM,
        "command": command,
        "seeds": args.seeds,
        "runs": sum(len(v) for v in runs.values()),
        "sweep_seconds": round(seconds, 1),
        # the sweeps' processes' CPU time (user + sys): on a loaded machine the wall time stretches, this
        # hardly does; a one-process sweep takes about this long on a quiet core
        "sweep_cpu_seconds": round(cpu_seconds, 1),
        "load_average_at_start": round(load_before, 1),  # the highest of the sweeps'
        "chosen": chosen,  # by a search: sweep -> the overrides it picked
        "holds": finding.holds,
        "verdict": finding.verdict,
        "plots": [str(p) for p in finding.plots],
    }
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    md = (
        f"# {module.PAPER}\n\nClaim (paraphrased): {module.CLAIM}\n\n`{command}`: {result['runs']} runs, "
        f"{seconds:.0f} s of sweeps, {cpu_seconds:.0f} s of CPU "
        f"(load average up to {load_before:.1f} at the sweeps' starts)\n\n"
        f"{finding.table}\n\n"
        f"**Verdict:** {finding.verdict}\n" + "".join(f"\n![{p.name}]({p.name})\n" for p in finding.plots)
    )
    (out / "result.md").write_text(md)
    if args.docs:
        DOCS.mkdir(parents=True, exist_ok=True)
        for plot in finding.plots:
            shutil.copy(plot, DOCS / f"{args.name}_{plot.name}")
    print(md)
    print(f"wrote {out / 'result.md'}, {out / 'result.json'}")
    return 0


def _sweep(
    name: str, folder: Path, expected: int, sweep: list[str], overrides: list[str], seeds: int, timings: list[dict]
) -> list[dict]:
    """Run one sweep over seeds 0 .. seeds-1 unless the folder holds its runs already; its runs, its timing appended."""
    timing_file = folder.with_suffix(".timing.json")
    if not finished(folder, expected):
        print(f"{name}: sweep {str(folder)!r} ({expected} runs) ...", flush=True)
        started, load, cpu = time.perf_counter(), os.getloadavg()[0], _children_cpu_s()
        run_sweep([*sweep, *fleet_threads(sweep + overrides), *overrides] + [f"seed=range({seeds})"], folder)
        timing = {
            "seconds": time.perf_counter() - started,
            "cpu_seconds": _children_cpu_s() - cpu,
            "load_average": [load, os.getloadavg()[0]],
        }
        timing_file.write_text(json.dumps(timing) + "\n")
    if timing_file.exists():  # a sweep read again keeps the time it took when it ran
        timings.append(json.loads(timing_file.read_text()))
    return load_runs(folder)


def chosen_record(sweep: Path) -> Path:
    """Where a sweep's folder keeps the values the search picked for it (OUT/SWEEP.chosen.json)."""
    return sweep.with_suffix(".chosen.json")


def _refuse_stale(out: Path, expected: dict[str, int], chosen: dict[str, list[str]] | None) -> None:
    """Refuse to reuse a finished sweep that ran with other values than `chosen` picks for it (None: not known
    yet, a search still to run: every finished sweep is refused), naming them all at once."""
    stale = []
    for sweep, runs in expected.items():
        folder = out / sweep
        record = chosen_record(folder)
        if not finished(folder, runs):
            continue
        ran = json.loads(record.read_text()) if record.exists() else []
        if chosen is None or ran != chosen.get(sweep, []):
            now = "" if chosen is None else f", now picked: {' '.join(chosen.get(sweep, [])) or 'its own settings'}"
            stale.append(f"{folder} (ran with {' '.join(ran) or 'its own settings'}{now})")
    if stale:
        why = "a search still to run picks their values" if chosen is None else "other values are picked now"
        raise SystemExit(
            f"finished sweeps ran with other settings ({why}): {'; '.join(stale)}. Delete them and their .chosen.json "
            "to run them again, or pass --out a fresh folder"
        )


if __name__ == "__main__":
    sys.exit(main())
