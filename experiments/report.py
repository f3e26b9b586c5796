"""Turn runs into a comparison: `python -m experiments.report DIR [--out FOLDER]`.

DIR is one run folder or a Hydra multirun folder; every folder below it holding a
`summary.json` is a run. Only the files runs write are read (summary.json, metrics.jsonl,
config.yaml), so a sweep made elsewhere can be reported here. The parameters that differ
between runs are the swept ones: they become the table's first columns and the plots' legend.
Runs that differ only by `seed` are one configuration: its row holds the mean over the seeds with a 95%
Student-t interval (experiments.intervals) and the number of seeds, and its curves a band of that interval.

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

from experiments.intervals import band, summarize
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
    source = "overrides" if all(r["overrides"] is not None for r in runs) else "config"
    keys = sorted({k for r in runs for k in r[source]})
    return [k for k in keys if not k.startswith(IGNORED_KEYS) and len({repr(r[source].get(k)) for r in runs}) > 1]


def value(run: dict, key: str):
    source = run["overrides"] if run["overrides"] is not None and key in run["overrides"] else run["config"]
    return source.get(key)


def label(run: dict, keys: list[str]) -> str:
    return " ".join(f"{k}={value(run, k)}" for k in keys) or run["dir"].name


def group_by_seed(runs: list[dict], keys: list[str]) -> tuple[list[str], list[list[dict]]]:
    """Runs that differ only by seed form one configuration. Returns the keys that tell the configurations
    apart (the swept keys less `seed`) and the configurations' runs, in the order they first appear."""
    config_keys = [k for k in keys if k != "seed"]
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault(tuple(repr(value(run, k)) for k in config_keys), []).append(run)
    return config_keys, list(groups.values())


def plot(groups: list[list[dict]], keys: list[str], out: Path) -> list[Path]:
    """One line per configuration: the mean over its seeds, in a band of the 95% interval where it has several."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = {
        "vs_steps": (
            "step",
            "step",
            [
                ("test_accuracy", "test accuracy (averaged model)"),
                ("peer_test_accuracy_mean", "test accuracy (mean of peers' models)"),
                ("test_loss", "test loss"),
                ("consensus_distance", "consensus distance"),
            ],
        ),
        "optimum_vs_steps": (  # data with a known optimum (heterogeneous_regression)
            "step",
            "step",
            [
                ("optimum_distance", "distance to x* (averaged model)"),
                ("peer_optimum_distance", "distance to x* (peers' models, rms)"),
            ],
        ),
        "vs_wall_time": (
            "wall_time_s",
            "wall time (s)",
            [("test_accuracy", "test accuracy (averaged model)"), ("test_loss", "test loss")],
        ),
        "vs_mb_sent": (
            "mb_sent_per_peer",
            "MB sent per peer",
            [("test_accuracy", "test accuracy (averaged model)"), ("test_loss", "test loss")],
        ),
        "vs_emulated_time": (
            "emulated_time_s",
            "emulated time (s, dpsgd.comm.netem)",
            [("test_accuracy", "test accuracy (averaged model)"), ("test_loss", "test loss")],
        ),
    }
    runs = [r for g in groups for r in g]
    seeds = max(len(g) for g in groups)
    written = []
    for name, (x_key, x_label, panels) in figures.items():
        if not any(m.get(x_key) is not None for r in runs for m in r["metrics"]) or not any(
            m.get(y_key) is not None for r in runs for m in r["metrics"] for y_key, _ in panels
        ):
            continue  # e.g. no emulated network, or no known optimum, in these runs
        fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
        for ax, (y_key, y_label) in zip(axes[0], panels):
            for group in groups:
                legend = label(group[0], keys) + (f" ({len(group)} seeds)" if seeds > 1 else "")
                draw_band(ax, group, x_key, y_key, legend)
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
        axes[0][0].legend(fontsize=8)
        title = f"{len(runs)} run(s)" + (f", swept: {', '.join(keys)}" if keys else "")
        fig.suptitle(title + (", bands: 95% interval over seeds" if seeds > 1 else ""))
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def draw_band(ax, runs: list[dict], x_key: str, y_key: str, legend: str) -> None:
    """One configuration's runs (its seeds) as one line on `ax`: the mean of `y_key` against `x_key` (metrics.jsonl
    fields), in a band of the 95% interval where there are several. Nothing when a run lacks the fields."""
    curves = [
        [(m[x_key], m[y_key]) for m in r["metrics"] if m.get(x_key) is not None and m.get(y_key) is not None]
        for r in runs
    ]
    if not all(curves):
        return
    # the seeds' i-th records are taken together (same step; wall time and bytes as their mean)
    x_mean, _ = band([[x for x, _ in c] for c in curves])
    y_mean, ci = band([[y for _, y in c] for c in curves])
    (line,) = ax.plot(x_mean, y_mean, marker=".", label=legend)
    if len(curves) > 1:
        ax.fill_between(x_mean, y_mean - ci, y_mean + ci, color=line.get_color(), alpha=0.2, linewidth=0)


def _values(run: dict, key: str):
    return [m[key] for m in run["metrics"] if m.get(key) is not None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.report", description=__doc__.split("\n")[0])
    parser.add_argument("dir", type=Path, help="a run folder or a multirun folder")
    parser.add_argument("--out", type=Path, default=None, help="where to write report.md/csv and plots (default DIR)")
    args = parser.parse_args(argv)
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
    keys, groups = group_by_seed(runs, swept_keys(runs))
    summaries = [summarize([{**r["summary"], **{k: value(r, k) for k in keys}} for r in g]) for g in groups]
    out = args.out or args.dir
    out.mkdir(parents=True, exist_ok=True)
    print(format_table(summaries, keys))
    (out / "report.md").write_text(format_markdown(summaries, keys))
    (out / "report.csv").write_text(format_csv(summaries, keys))
    pngs = plot(groups, keys, out)
    print(f"\nwrote {out / 'report.md'}, {out / 'report.csv'}, " + ", ".join(str(p) for p in pngs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
