"""Command line: `python -m topologies show NAME --n 16 [--OPTION VALUE ...] [--plot FILE.png]`,
`python -m topologies compare NAME ... --n 16 32 64`, and `python -m topologies list`."""

from __future__ import annotations

import argparse
import sys

import numpy as np

from . import analysis
from .base import Topology
from .registry import make, names, options_of

__all__ = ["main"]


def _value(text: str):
    """An option value from the command line: int, float, bool, None, or the string itself."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _options(extra: list[str]) -> dict:
    """--key value pairs (or --key=value) into a dict; dashes in keys become underscores."""
    options, i = {}, 0
    while i < len(extra):
        token = extra[i]
        if not token.startswith("--") or token == "--":
            raise ValueError(f"expected --OPTION VALUE, got {token!r}")
        if "=" in token:
            key, text = token[2:].split("=", 1)
            i += 1
        elif i + 1 < len(extra):
            key, text = token[2:], extra[i + 1]
            i += 2
        else:
            raise ValueError(f"option {token} needs a value")
        options[key.replace("-", "_")] = _value(text)
    return options


def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _show(topology: Topology, eps: float) -> str:
    d = analysis.describe(topology, eps)
    options = ", ".join(f"{k}={v}" for k, v in d["options"].items()) or "-"
    exact = d["exact_averaging_steps"]
    rows = [
        ("topology", f"{d['name']} (n={d['n']})"),
        ("options", options),
        ("directed", "yes (column stochastic, push-sum)" if d["directed"] else "no (doubly stochastic)"),
        ("period", "random schedule" if d["period"] is None else d["period"]),
        ("degree", f"{d['degree']} message(s) sent per peer per step"),
        ("spectral gap", _fmt(d["spectral_gap"], 6) + " (per step)"),
        (
            "consensus steps",
            f"{_fmt(d['consensus_steps'])} (to shrink the distance to the average by {eps:g})",
        ),
        ("exact averaging", f"after {exact} steps" if exact is not None else "no (asymptotic)"),
        ("bipartite", "yes (active/passive split exists)" if d["bipartite"] else "no"),
    ]
    return "\n".join(f"  {key:<17}{value}" for key, value in rows)


def _plot(topology: Topology, path: str, eps: float) -> None:
    """The graph (links coloured by step) beside the consensus decay ||Z_t - J||_2."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = topology.n
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 5))
    grid = {"rows", "cols"} <= set(topology.options)
    if grid:  # torus: wrap-around links drawn as arcs
        cols = topology.options["cols"]
        xy = np.array([(i % cols, -(i // cols)) for i in range(n)], dtype=float)
    else:
        angle = np.pi / 2 - 2 * np.pi * np.arange(n) / n
        xy = np.c_[np.cos(angle), np.sin(angle)]
    steps = min(topology.period or analysis.RANDOM_WINDOW, 8)
    colors = plt.get_cmap("tab10")
    for t in range(steps):
        w = topology.mixing_matrix(t)
        for i, j in np.argwhere(w > 0):
            if i != j:  # j sends to i
                bend = 0.3 if grid and np.abs(xy[i] - xy[j]).sum() > 1.5 else 0.0
                left.annotate(
                    "",
                    xy=xy[i],
                    xytext=xy[j],
                    arrowprops={
                        "arrowstyle": "-|>" if steps > 1 or topology.directed else "-",
                        "color": colors(t % 10),
                        "alpha": 0.6,
                        "lw": 1,
                        "shrinkA": 6,
                        "shrinkB": 6,
                        "connectionstyle": f"arc3,rad={bend}",
                    },
                )
    left.scatter(xy[:, 0], xy[:, 1], s=180, c="white", edgecolors="black", zorder=3)
    for i in range(n):
        left.text(xy[i, 0], xy[i, 1], str(i), ha="center", va="center", fontsize=7, zorder=4)
    shown = f", links of steps 0..{steps - 1} by colour" if steps > 1 else ""
    left.set_title(f"{topology.name} (n={n}{shown})")
    left.set_aspect("equal")
    left.margins(0.15)
    left.axis("off")

    reach = analysis.consensus_steps(topology, eps, max_steps=2000)
    horizon = int(min(2000, max(10, 1.5 * (reach or 2000), 2 * (topology.period or 1))))
    curve = analysis.consensus_curve(topology, horizon)
    right.semilogy(np.arange(horizon + 1), np.maximum(curve, 1e-17), marker="." if horizon <= 60 else None)
    right.axhline(eps, color="gray", ls="--", lw=1, label=f"eps = {eps:g}")
    right.set_xlabel("step t")
    right.set_ylabel("||Z_t - J||_2 (worst-case consensus distance factor)")
    right.set_title("consensus decay")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _compare(topologies: list[str], sizes: list[int], eps: float) -> str:
    header = ["topology", "n", "degree", "period", "spectral gap", f"steps to {eps:g}", "exact after"]
    rows, notes = [], []
    for name in topologies:
        for n in sizes:
            try:
                d = analysis.describe(make(name, n), eps)
            except ValueError as err:
                rows.append([name, str(n), "", "", "", "", "n/a"])
                notes.append(f"{name} n={n}: {err}")
                continue
            period = "random" if d["period"] is None else str(d["period"])
            rows.append(
                [
                    name,
                    str(n),
                    str(d["degree"]),
                    period,
                    _fmt(d["spectral_gap"]),
                    _fmt(d["consensus_steps"]),
                    _fmt(d["exact_averaging_steps"]),
                ]
            )
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]

    def line(cells: list[str]) -> str:  # name left-aligned, figures right-aligned
        return "  ".join(
            v.ljust(w) if c == 0 else v.rjust(w) for c, (v, w) in enumerate(zip(cells, widths, strict=True))
        )

    lines = [line(header), "  ".join("-" * w for w in widths), *map(line, rows)]
    return "\n".join(lines + [""] * bool(notes) + notes)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m topologies", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the topologies and their options")
    show = sub.add_parser("show", help="describe one topology (extra --OPTION VALUE pairs go to make)")
    show.add_argument("name", choices=names(), metavar="NAME")
    show.add_argument("--n", type=int, required=True, help="number of peers")
    show.add_argument("--eps", type=float, default=1e-3, help="consensus target (default 1e-3)")
    show.add_argument("--plot", metavar="FILE.png", help="draw the graph and the consensus decay")
    compare = sub.add_parser("compare", help="a table of several topologies at several sizes")
    compare.add_argument("names", nargs="+", choices=names(), metavar="NAME")
    compare.add_argument("--n", type=int, nargs="+", required=True, help="numbers of peers")
    compare.add_argument("--eps", type=float, default=1e-3, help="consensus target (default 1e-3)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m topologies list | show NAME | compare NAMES --n N...`; returns the exit code."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "show":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if args.command == "list":
            for name in names():
                opts = ", ".join(f"{k}={v!r}" for k, v in options_of(name).items()) or "-"
                print(f"{name:<31}{opts}")
        elif args.command == "compare":
            print(_compare(args.names, args.n, args.eps))
        else:
            topology = make(args.name, args.n, **_options(extra))
            print(_show(topology, args.eps))
            if args.plot:
                _plot(topology, args.plot, args.eps)
                print(f"  {'plot':<17}{args.plot}")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
