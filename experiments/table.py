"""The comparison table: printed after a run, and by the report for a sweep (text, Markdown, CSV)."""

from __future__ import annotations

import csv
import io

COLUMNS = [  # (header, summary key, format)
    ("algorithm", "algorithm", "{}"),
    ("topology", "topology", "{}"),
    ("peers", "peers", "{}"),
    ("seeds", "seeds", "{}"),  # the report's rows: runs that differ only by seed, as mean +- 95% interval
    ("test acc (avg model)", "test_accuracy", "{:.4f}"),
    ("test acc (peer mean)", "peer_test_accuracy_mean", "{:.4f}"),
    ("test ppl (avg model)", "test_perplexity", "{:.3f}"),  # language models
    ("dist to x* (avg model)", "optimum_distance", "{:.3e}"),  # data with a known optimum
    ("dist to x* (peers, rms)", "peer_optimum_distance", "{:.3e}"),
    ("consensus dist", "consensus_distance", "{:.3e}"),
    ("MB sent/peer", "mb_sent_per_peer", "{:.2f}"),
    ("wall s", "wall_time_s", "{:.3g}"),  # a fleet's runs take tenths of a second: significant digits
    ("emulated s", "emulated_time_s", "{:.3g}"),  # only with an emulated network (dpsgd.comm.netem)
    # the report's --target (experiments.reaching): seeds that reached it, and means over those that did
    ("reached", "reached", "{}"),
    ("steps to target", "steps_to_target", "{:.4g}"),
    ("time to target s", "time_to_target_s", "{:.3g}"),
    ("MB to target", "mb_to_target", "{:.3g}"),
    ("status", "status", "{}"),  # a run that diverged or did not learn (dpsgd.divergence); shown only when one did
]
# columns left out when no row has them
OPTIONAL = {
    "emulated_time_s",
    "seeds",
    "test_perplexity",
    "optimum_distance",
    "peer_optimum_distance",
    "status",
    "reached",
    "steps_to_target",
    "time_to_target_s",
    "mb_to_target",
}
TO_TARGET = {"steps_to_target", "time_to_target_s", "mb_to_target"}  # shown ("-") wherever a target was asked for


def _cells(summaries: list[dict], extra: list[str]) -> tuple[list[str], list[list[str]]]:
    """Header and formatted rows; `extra` keys (swept parameters) come first."""
    columns = [
        (h, key, fmt)
        for h, key, fmt in COLUMNS
        if h not in extra
        and (
            key not in OPTIONAL
            or any(s.get(key) not in (None, "ok") for s in summaries)
            or (key in TO_TARGET and any("reached" in s for s in summaries))
        )
    ]
    header = list(extra) + [h for h, _, _ in columns]
    rows = []
    for s in summaries:
        row = ["-" if s.get(k) is None else str(s[k]) for k in extra]
        row += [_cell(s, key, fmt) for h, key, fmt in columns]
        rows.append(row)
    return header, rows


def _cell(summary: dict, key: str, fmt: str) -> str:
    """The value, and where the row is a mean over seeds, +- the half width of its 95% interval."""
    if summary.get(key) is None:
        return "-"
    ci = summary.get(f"{key}_ci95")
    text = fmt.format(summary[key])
    if ci is None:
        return text
    if fmt.endswith("g}") and "." in text and "e" not in text:  # the half width to the mean's decimals
        return f"{text} ± {ci:.{len(text.split('.')[1])}f}"
    return f"{text} ± {fmt.format(ci)}"


def format_table(summaries: list[dict], extra: list[str] = ()) -> str:
    header, rows = _cells(summaries, list(extra))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    numeric = [all(_is_number(r[i]) for r in rows) and rows != [] for i in range(len(header))]
    lines = [
        "  ".join(c.rjust(w) if numeric[i] else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def format_markdown(summaries: list[dict], extra: list[str] = ()) -> str:
    header, rows = _cells(summaries, list(extra))
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def format_csv(summaries: list[dict], extra: list[str] = ()) -> str:
    """Raw (unformatted) values: every summary key with a single value (not lists such as class histograms),
    swept parameters first."""
    keys = list(extra) + sorted(
        {k for s in summaries for k, v in s.items() if k not in extra and not isinstance(v, list | dict)}
    )
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=keys, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for s in summaries:
        writer.writerow({k: s.get(k, "") for k in keys})
    return out.getvalue()


def _is_number(text: str) -> bool:
    try:
        [float(part) for part in text.split(" ± ")]
        return True
    except ValueError:
        return text == "-"
