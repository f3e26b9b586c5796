"""Figures of runs for a paper's page: panels in a grid 7 inches wide, one legend in words under them, and a
caption in the figure itself (what was run, what the bands are, which clock), so a PNG copied alone still says
what it shows. Used by experiments.report and the reproductions (experiments.reproduce)."""

from __future__ import annotations

import math
from pathlib import Path

from experiments.captions import wrap
from experiments.intervals import band, clipped_band

PAGE_WIDTH_IN = 7.0  # a paper's text width (two columns of a conference page)
DPI = 200  # 1400 pixels across: sharp in print and on screen, small files
COLUMNS = 2
PANEL_HEIGHT_IN = 2.4
CAPTION_CHARS = 140  # characters per caption line at CAPTION_FONT over PAGE_WIDTH_IN
CAPTION_FONT = 6.5


def limits(key: str) -> tuple[float | None, float | None]:
    """What a metric can take: accuracies lie in [0, 1]; every other quantity a run records (losses, perplexity,
    distances, times, bytes) is >= 0. A band is cut at these limits."""
    return (0.0, 1.0) if key.endswith("accuracy") or "accuracy_" in key else (0.0, None)


def limits_words(keys: list[str]) -> str:
    both = any(limits(k)[1] is not None for k in keys)
    return "cut at 0 (and accuracies at 1)" if both else "cut at 0"


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 8, "axes.titlesize": 8, "legend.fontsize": 7})
    return plt


class Page:
    """A figure of `n` panels (`axes`) in a grid of at most COLUMNS columns, PAGE_WIDTH_IN wide, with room at
    its foot for one legend of `legend_entries` entries and the wrapped caption."""

    def __init__(self, n: int, title: str, caption: str, legend_entries: int):
        plt = pyplot()
        cols = min(n, COLUMNS)
        rows = math.ceil(n / cols)
        text = wrap(caption, CAPTION_CHARS) if caption else ""
        caption_in = 0.12 * (text.count("\n") + 1) if text else 0.0
        legend_in = 0.2 * math.ceil(legend_entries / 3)
        title_in, axis_in, margin_in = 0.35, 0.45, 0.1
        height = title_in + rows * PANEL_HEIGHT_IN + axis_in + legend_in + caption_in + 2 * margin_in
        self.fig = fig = plt.figure(figsize=(PAGE_WIDTH_IN, height))
        grid = fig.add_gridspec(
            rows,
            cols,
            left=0.09,
            right=0.98,
            top=1 - title_in / height,
            bottom=(axis_in + legend_in + caption_in + 2 * margin_in) / height,
            hspace=0.38,
            wspace=0.28,
        )
        self.axes = [fig.add_subplot(grid[i // cols, i % cols]) for i in range(n)]
        fig.suptitle(title, y=1 - 0.08 / height, va="top")
        self.title, self.caption = title, caption
        if text:
            fig.text(0.01, (margin_in + caption_in) / height, text, va="top", fontsize=CAPTION_FONT)
        self.legend_top = (margin_in + caption_in + margin_in + legend_in) / height

    def save(self, path: Path) -> Path:
        """One legend for all panels under the grid (the labels of the first panel with lines), then the file,
        with the title, caption and legend also as the PNG's text (Title, Description, Legend: one entry a line),
        for whoever reads the figure without seeing it."""
        handles, labels = next(
            ((h, lb) for h, lb in (ax.get_legend_handles_labels() for ax in self.axes) if h), ([], [])
        )
        if handles:
            self.fig.legend(
                handles, labels, loc="upper center", bbox_to_anchor=(0.5, self.legend_top), ncol=3, frameon=False
            )
        metadata = {"Title": self.title, "Description": self.caption, "Legend": "\n".join(labels)}
        self.fig.savefig(path, dpi=DPI, metadata=metadata)
        pyplot().close(self.fig)
        return path


def draw_band(ax, runs: list[dict], x_key: str, y_key: str, legend: str) -> None:
    """One configuration's runs (its seeds) as one line on `ax`: the mean of `y_key` against `x_key` (metrics.jsonl
    fields), in a band of the 95% interval where there are several, cut where the quantity ends (`limits`).
    Nothing when a run lacks the fields."""
    curves = [
        [(m[x_key], m[y_key]) for m in r["metrics"] if m.get(x_key) is not None and m.get(y_key) is not None]
        for r in runs
    ]
    if not all(curves):
        return
    # the seeds' i-th records are taken together (same step; wall time and bytes as their mean)
    x_mean, _ = band([[x for x, _ in c] for c in curves])
    y_mean, lower, upper = clipped_band([[y for _, y in c] for c in curves], *limits(y_key))
    (line,) = ax.plot(x_mean, y_mean, marker=".", markersize=3, linewidth=1.2, label=legend)
    if len(curves) > 1:
        ax.fill_between(x_mean, lower, upper, color=line.get_color(), alpha=0.2, linewidth=0)
