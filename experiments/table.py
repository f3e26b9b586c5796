"""The comparison table printed after a run (and by the report for a sweep)."""

from __future__ import annotations

COLUMNS = [  # (header, summary key, format)
    ("algorithm", "algorithm", "{}"),
    ("topology", "topology", "{}"),
    ("peers", "peers", "{}"),
    ("test acc (avg model)", "test_accuracy", "{:.4f}"),
    ("test acc (peer mean)", "peer_test_accuracy_mean", "{:.4f}"),
    ("consensus dist", "consensus_distance", "{:.3e}"),
    ("MB sent/peer", "mb_sent_per_peer", "{:.2f}"),
    ("wall s", "wall_time_s", "{:.1f}"),
]


def format_table(summaries: list[dict]) -> str:
    rows = [[h for h, _, _ in COLUMNS]]
    for s in summaries:
        rows.append([fmt.format(s[key]) if s.get(key) is not None else "-" for _, key, fmt in COLUMNS])
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
