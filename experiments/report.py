"""Turn runs into a comparison: `python -m experiments.report DIR [--out FOLDER]`.

DIR is one run folder or a Hydra multirun folder; every folder below it holding a
`summary.json` is a run. Only the files runs write are read (summary.json, metrics.jsonl,
config.yaml), so a sweep made elsewhere can be reported here. The parameters that differ
between runs are the swept ones: they become the table's first columns and the plots' legend.
Runs that differ only by `seed` are one configuration: its row holds the mean over the seeds with a 95%
Student-t interval (experiments.intervals) and the number of seeds, and its curves a band of that interval.
Runs that differ only by an option their algorithm does not read (the topology of all-reduce: an optimizer's
`uses_topology`) are the same run: each is reported once, with a line saying which overrides it ignored.
The table, report.md and every figure say what was run, what ± means and which clock a time is on
(experiments.captions); figures are 7 inches wide, for a paper's page (experiments.plots).

Writes into the output folder (default DIR): report.md, report.csv, and PNG plots
vs_steps.png (test accuracy of the averaged model and of the peers, test loss, consensus distance),
optimum_vs_steps.png (distances to a known optimum, where the data has one), vs_wall_time.png,
vs_emulated_time.png (with an emulated network) and
vs_mb_sent.png (test accuracy and loss).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from omegaconf import OmegaConf

from experiments import captions
from experiments.intervals import summarize
from experiments.plots import Page, draw_band, limits_words
from experiments.reaching import Target, over_seeds
from experiments.table import format_csv, format_markdown, format_table

IGNORED_KEYS = ("hydra", "comm.timeout_s", "log_every")  # settings that do not change the results


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v if not isinstance(v, list) else str(v)
    return out


def load_runs(root: Path) -> list[dict]:
    """Each run as {dir, summary, config (flat), metrics (list of records)}, in folder order."""
    runs = []
    for summary_file in sorted(root.rglob("summary.json"), key=lambda p: _natural_key(p.parent, root)):
        run_dir = summary_file.parent
        config_file = run_dir / "config.yaml"
        config = OmegaConf.to_container(OmegaConf.load(config_file)) if config_file.exists() else {}
        metrics_file = run_dir / "metrics.jsonl"
        metrics = (
            [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
            if metrics_file.exists()
            else []
        )
        metrics = [r for r in metrics if "event" not in r]  # an elastic world's membership records: no metrics
        overrides_file = run_dir / ".hydra" / "overrides.yaml"
        overrides = OmegaConf.to_container(OmegaConf.load(overrides_file)) if overrides_file.exists() else None
        runs.append(
            {
                "dir": run_dir,
                "summary": json.loads(summary_file.read_text()),
                "config": _flatten(config),
                "overrides": _parse_overrides(overrides),
                "metrics": metrics,
            }
        )
    return runs


def _natural_key(path: Path, root: Path):
    """Hydra numbers jobs 0, 1, ..., 10: sort them as numbers, not as strings."""
    return [int(p) if p.isdigit() else p for p in path.relative_to(root).parts]


def _parse_overrides(overrides: list[str] | None) -> dict | None:
    """Hydra's command-line overrides of a run ('algorithm=dpsgd', 'peers=8') as a dict."""
    if overrides is None:
        return None
    pairs = (o.lstrip("+~").split("=", 1) for o in overrides if "=" in o)
    return {k: v for k, v in pairs if not k.startswith("hydra.")}


def swept_keys(runs: list[dict]) -> list[str]:
    """What differs between runs: the command-line overrides where every run has Hydra's record
    of them (what the user swept, by the names they used), else the differing config keys."""
    source = "overrides" if all(r.get("overrides") is not None for r in runs) else "config"
    keys = sorted({k for r in runs for k in r[source]})
    return [k for k in keys if not k.startswith(IGNORED_KEYS) and len({repr(r[source].get(k)) for r in runs}) > 1]


def value(run: dict, key: str):
    source = run["overrides"] if run.get("overrides") is not None and key in run["overrides"] else run["config"]
    return source.get(key)


def label(run: dict, keys: list[str]) -> str:
    """A configuration's name in words ('D-PSGD, ring', 'all-reduce'): its swept values, or with nothing swept
    its algorithm and topology."""
    swept = captions.legend(run, {k: value(run, k) for k in keys if k != "seed"})
    values = {"algorithm": captions.setting(run, "algorithm.name"), "topology": captions.setting(run, "topology.name")}
    return swept or captions.legend(run, values) or run["dir"].name


def collapse_identical(runs: list[dict], keys: list[str]) -> tuple[list[dict], list[str]]:
    """Runs that differ only in keys their algorithm does not read are one run: the first is kept (the others are
    copies, not further seeds), with `ignored` {key: values the copies had}. Returns the kept runs and one line
    per algorithm saying what was collapsed."""
    kept: dict[tuple, dict] = {}
    for run in runs:
        skip = captions.ignored(run, keys)
        identity = tuple((k, repr(value(run, k))) for k in keys if k not in skip)
        first = kept.setdefault(identity, {**run, "ignored": {}})
        for k in skip:
            first["ignored"].setdefault(k, [])
            if value(run, k) not in first["ignored"][k]:
                first["ignored"][k].append(value(run, k))
    notes: dict[str, set] = {}
    for run in kept.values():
        for k, values in run["ignored"].items():
            if len(values) > 1:
                name = captions.algorithm_words(captions.setting(run, "algorithm.name"))
                notes.setdefault(name, set()).add(f"{k}={','.join(map(str, values))}")
    lines = [
        f"{name} does not read {', '.join(sorted(o))}: those runs are the same run, reported once"
        for name, o in notes.items()
    ]
    return list(kept.values()), lines


def group_by_seed(runs: list[dict], keys: list[str]) -> tuple[list[str], list[list[dict]]]:
    """Runs that differ only by seed form one configuration. Returns the keys that tell the configurations
    apart (the swept keys less `seed`) and the configurations' runs, in the order they first appear."""
    config_keys = [k for k in keys if k != "seed"]
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault(tuple(repr(value(run, k)) for k in config_keys), []).append(run)
    return config_keys, list(groups.values())


# name: (x key, x axis label, [(y key, y axis label)], title)
FIGURES = {
    "vs_steps": (
        "step",
        "step",
        [
            ("test_accuracy", "test accuracy (averaged model)"),
            ("peer_test_accuracy_mean", "test accuracy (mean of peers' models)"),
            ("test_loss", "test loss (averaged model)"),
            ("consensus_distance", "consensus distance"),
        ],
        "Accuracy, loss and consensus against steps",
    ),
    "optimum_vs_steps": (  # data with a known optimum (heterogeneous_regression)
        "step",
        "step",
        [
            ("optimum_distance", "distance to x* (averaged model)"),
            ("peer_optimum_distance", "distance to x* (peers' models, rms)"),
        ],
        "Distance to the optimum against steps",
    ),
    "vs_wall_time": (
        "wall_time_s",
        "wall time (s)",
        [("test_accuracy", "test accuracy (averaged model)"), ("test_loss", "test loss (averaged model)")],
        "Accuracy and loss against wall time",
    ),
    "vs_mb_sent": (
        "mb_sent_per_peer",
        "MB sent per peer",
        [("test_accuracy", "test accuracy (averaged model)"), ("test_loss", "test loss (averaged model)")],
        "Accuracy and loss against MB sent per peer",
    ),
    "vs_emulated_time": (
        "emulated_time_s",
        "emulated time (s)",
        [("test_accuracy", "test accuracy (averaged model)"), ("test_loss", "test loss (averaged model)")],
        "Accuracy and loss against emulated time",
    ),
}


def plot(
    groups: list[list[dict]], keys: list[str], out: Path, copies: int = 0, notes: tuple[str, ...] = ()
) -> list[Path]:
    """One figure per FIGURES entry the runs have data for; one line per configuration: the mean over its
    seeds, in a band of the 95% interval where it has several. `copies` and `notes`: runs collapsed as copies of
    others (collapse_identical), said in each caption."""
    runs = [r for g in groups for r in g]
    seed_counts = [len(g) for g in groups]
    written = []
    for name, (x_key, x_label, y_panels, title) in FIGURES.items():
        if not any(m.get(x_key) is not None for r in runs for m in r["metrics"]) or not any(
            m.get(y_key) is not None for r in runs for m in r["metrics"] for y_key, _ in y_panels
        ):
            continue  # e.g. no emulated network, or no known optimum, in these runs
        timed = [r for r in runs if _values(r, x_key)]  # the runs with this axis (emulated time: not all)
        clock = " ".join(captions.clocks(timed, {x_key}))
        bounds = limits_words([y for y, _ in y_panels])
        caption = captions.figure_caption(runs, keys, seed_counts, clock, bounds, copies)
        caption += "".join(f" Note: {n}." for n in notes)
        if x_key in ("wall_time_s", "emulated_time_s"):
            x_label = captions.clock_label(timed, x_key)
            title = title.replace("emulated time", x_label.split(" (")[0])
        page = Page(len(y_panels), title, caption, len(groups))
        for ax, (y_key, y_label) in zip(page.axes, y_panels):
            for group in groups:
                several = len(set(seed_counts)) > 1
                draw_band(
                    ax, group, x_key, y_key, label(group[0], keys) + (f" ({len(group)} seeds)" if several else "")
                )
            xs = [x for r in runs for x in _values(r, x_key) if x > 0]
            if x_key == "mb_sent_per_peer" and xs and max(xs) / min(xs) > 100:
                ax.set_xscale("log", nonpositive="mask")  # e.g. averaging periods spanning 1 to 64
            ax.set_xlabel(x_label)
            ax.set_ylabel(y_label)
            if y_key in ("consensus_distance", "optimum_distance", "peer_optimum_distance"):
                ys = [y for r in runs for y in _values(r, y_key)]
                if ys and min(ys) > 0:
                    ax.set_yscale("log")
                elif any(y > 0 for y in ys):  # all-reduce runs sit at exactly 0
                    ax.set_yscale("symlog", linthresh=min(y for y in ys if y > 0))
            ax.grid(alpha=0.3)
        written.append(page.save(out / f"{name}.png"))
    return written


def _values(run: dict, key: str):
    return [m[key] for m in run["metrics"] if m.get(key) is not None]


def rows(groups: list[list[dict]], keys: list[str], target: Target | None = None) -> list[dict]:
    """The table's rows: each configuration's summary over its seeds, its swept values, and "unused" for a
    setting its algorithm does not read (all-reduce's topology) with `ignored` naming the collapsed copies; with a
    `target`, how many seeds reached it and their steps, time and MB to it (experiments.reaching)."""
    out = []
    for group in groups:
        first = group[0]
        summaries = [{**captions.settings(r), **r["summary"], **{k: value(r, k) for k in keys}} for r in group]
        for s in summaries:  # the run's own target_accuracy figures: superseded by --target's
            for k in ("steps_to_target", "time_to_target_s", "emulated_time_to_target_s", "samples_to_target"):
                s.pop(k, None)
        row = summarize(summaries)
        if target is not None:
            row.update(over_seeds(target, [r["metrics"] for r in group]))
        unused = [k for k in (*keys, "topology") if k in row and captions.ignored(first, [k])]
        row.update({k: "unused" for k in unused})
        if unused:
            row.pop("spectral_gap", None)  # the unused topology's
        failed = [s for r in group if (s := r["summary"].get("status", "ok")) != "ok"]
        words = " or ".join(sorted({s.replace("_", " ") for s in failed}))
        row["status"] = (
            (f"{words} ({len(failed)} of {len(group)} seeds)" if len(group) > 1 else words) if failed else "ok"
        )
        collapsed = {k: v for k, v in first.get("ignored", {}).items() if len(v) > 1}
        if collapsed:
            row["ignored"] = "; ".join(f"{k}={','.join(map(str, v))}" for k, v in collapsed.items())
        out.append(row)
    return out


def caption(
    runs: list[dict],
    groups: list[list[dict]],
    keys: list[str],
    notes: list[str],
    columns: set[str],
    copies: int,
    target: Target | None = None,
) -> str:
    """The table's caption: what was run, what ± means, which clocks its times are on, what was collapsed."""
    parts = [captions.what_was_run(runs, keys, copies), captions.interval_sentence([len(g) for g in groups])]
    if target is not None:
        parts.append(captions.target_sentence(str(target), runs))
    parts += captions.clocks(runs, columns)
    parts += [f"Note: {n}." for n in notes]
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.report", description=__doc__.split("\n")[0])
    parser.add_argument("dir", type=Path, help="a run folder or a multirun folder")
    parser.add_argument("--out", type=Path, default=None, help="where to write report.md/csv and plots (default DIR)")
    parser.add_argument(
        "--target",
        metavar="METRIC=VALUE",
        help="steps, samples, MB and time to a record's metric reaching VALUE (e.g. test_accuracy=0.85; perplexity "
        "and loss are reached from above), with the count of seeds that reached it",
    )
    args = parser.parse_args(argv)
    try:
        target = Target.parse(args.target) if args.target else None
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.dir.is_dir():
        print(
            f"error: {args.dir} is not a folder; pass a run or multirun folder (outputs/... or multirun/...)",
            file=sys.stderr,
        )
        return 2
    runs = load_runs(args.dir)
    if not runs:
        print(
            f"error: no run under {args.dir} has a summary.json (unfinished or failed runs have none)", file=sys.stderr
        )
        return 2
    swept = swept_keys(runs)
    kept, notes = collapse_identical(runs, swept)
    diverged = [r for r in kept if r["summary"].get("status", "ok") != "ok"]
    if diverged:
        notes.append(
            f"{len(diverged)} of {len(kept)} runs diverged or did not learn (status: diverged or not_learning in "
            "their summary.json, which names the first peer and step); their numbers are those of their last record"
        )
    keys, groups = group_by_seed(kept, swept)
    summaries = rows(groups, keys, target)
    if target is not None and not any(any(target.metric in m for m in r["metrics"]) for r in kept):
        print(f"error: --target {args.target}: no record of these runs has {target.metric}", file=sys.stderr)
        return 2
    columns = {k for s in summaries for k, v in s.items() if v is not None}
    text = caption(kept, groups, swept, notes, columns, len(runs) - len(kept), target)
    out = args.out or args.dir
    out.mkdir(parents=True, exist_ok=True)
    print(format_table(summaries, keys))
    print("\n" + "\n\n".join(captions.wrap(p, 110) for p in text.split("\n\n")))
    pngs = plot(groups, keys, out, len(runs) - len(kept), tuple(notes))
    figures = "".join(f"\n![{p.stem}]({p.name})\n" for p in pngs)
    (out / "report.md").write_text(
        f"# Report of {len(runs)} run{'s' if len(runs) != 1 else ''} in {args.dir}\n\n{text}\n\n"
        + format_markdown(summaries, keys)
        + figures
    )
    (out / "report.csv").write_text(format_csv(summaries, keys))
    print(f"\nwrote {out / 'report.md'}, {out / 'report.csv'}, " + ", ".join(str(p) for p in pngs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
