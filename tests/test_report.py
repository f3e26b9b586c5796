"""experiments.report on a real two-run sweep: table, Markdown, CSV and plots from the run files."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_sweep_to_table_and_plots(app, tmp_path):
    sweep = tmp_path / "sweep"
    proc = app(
        ["-m", "algorithm=allreduce,dpsgd", "backend=local", "epochs=2", "log_every=4", f"hydra.sweep.dir={sweep}"]
    )
    assert proc.returncode == 0, proc.stderr
    report = subprocess.run(
        [sys.executable, "-m", "experiments.report", str(sweep)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert report.returncode == 0, report.stderr
    lines = report.stdout.splitlines()
    assert lines[0].split()[0] == "algorithm"  # the swept parameter leads the table
    assert any(line.startswith("allreduce") for line in lines) and any(line.startswith("dpsgd") for line in lines)
    rows = list(csv.DictReader((sweep / "report.csv").open()))
    assert [r["algorithm"] for r in rows] == ["allreduce", "dpsgd"]
    assert float(rows[0]["consensus_distance"]) == 0 and float(rows[1]["consensus_distance"]) > 0
    assert (sweep / "report.md").read_text().startswith("| algorithm |")
    for name in ("vs_steps", "vs_wall_time", "vs_mb_sent"):
        png = sweep / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert not (sweep / "optimum_vs_steps.png").exists()  # digits has no known optimum


def test_report_says_what_is_missing(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.report", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "no run under" in proc.stderr
