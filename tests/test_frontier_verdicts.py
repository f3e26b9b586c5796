"""The verdicts of noloco2025, demo2024, sparseloco2025 and douillard2023_text on hand-made measurements whose
verdict is known (fast; the real runs are `python -m experiments.reproduce NAME`)."""

from __future__ import annotations

import pytest

from experiments.reproduce import Configuration
from experiments.reproductions import _text, demo2024, douillard2023_text, noloco2025, sparseloco2025

OPENING = {True: "holds", False: "does not hold", None: "partly holds"}


@pytest.fixture(autouse=True)
def no_drawing(monkeypatch, request):
    """Verdicts only: the plots (a second each on a loaded machine) are drawn by one case and the real runs."""
    if "drawn" not in request.node.name:
        monkeypatch.setattr(_text, "plot_curves", lambda *args, **kwargs: args[3])  # the four draw through _text


def config(algorithm: str, period: int | None = None, aggregate: str | None = None, **summary) -> Configuration:
    """One setting's measured means (half widths as KEY_ci95) with a one-point curve, as load_runs reads a run."""
    summary = {"steps": 250, "seeds": 3, "peers": 8, **summary}
    setting = {"algorithm": algorithm, "algorithm.name": algorithm}
    if period is not None:
        setting["algorithm.period"] = period
    if aggregate is not None:
        setting["algorithm.aggregate"] = aggregate
    run = {"dir": "run", "summary": summary, "config": dict(setting), "overrides": None}
    return Configuration(setting, summary, [{**run, "metrics": [{"step": 250, **summary}]}])


def ppl(value: float, mb: float, ci: float = 0.05, **more) -> dict:
    loss = __import__("math").log(value)
    return {
        "test_perplexity": value,
        "test_perplexity_ci95": ci,
        "test_loss": loss,
        "test_loss_ci95": ci / value,
        "mb_sent_per_peer": mb,
        **more,
    }


@pytest.mark.parametrize(("noloco_ppl", "holds"), [(9.0, True), (9.2, True), (10.0, None)])
def test_noloco2025_decides_on_perplexity_and_the_sync_time(tmp_path, noloco_ppl, holds):
    configs = {
        "main": [config("noloco", 50, **ppl(noloco_ppl, 4.5)), config("diloco", 50, **ppl(9.2, 3.9))],
        "synchronous": [config("allreduce", **ppl(8.5, 200.0))],
    }
    finding = noloco2025.analyze(configs, tmp_path)
    assert finding.holds is holds and finding.verdict.startswith(OPENING[holds])
    # M = 4.5 MB / 5 rounds / 2 = 0.45 MB; at 1024 replicas: 50 ms + 0.9 MB / 12.5 MB/s against 2046 x 50 ms +
    # 2 x 1023 / 1024 x 0.45 MB / 12.5 MB/s
    assert "| 1024 | 0.122 | 102.372 | 839.1x |" in finding.table


@pytest.mark.parametrize(("demo_ppl", "demo_mb", "holds"), [(9.0, 2.0, True), (9.0, 50.0, None), (12.0, 50.0, False)])
def test_demo2024_decides_on_comparable_perplexity_and_bytes(tmp_path, demo_ppl, demo_mb, holds):
    configs = {"demo": [config("demo", **ppl(demo_ppl, demo_mb))], "adamw": [config("allreduce", **ppl(9.0, 200.0))]}
    finding = demo2024.analyze(configs, tmp_path)
    assert finding.holds is holds and finding.verdict.startswith(OPENING[holds])


@pytest.mark.parametrize(
    ("ratio", "mean_ppl", "templar_ppl", "holds"),
    [
        (100, 9.0, 9.0, True),
        (40, 9.0, 9.0, None),
        (40, 10.0, 10.0, False),
        (100, 10.0, 9.0, None),
        (40, 10.0, 9.0, None),
    ],
)
def test_sparseloco2025_decides_on_perplexity_at_every_h_and_the_ratio_for_each_aggregation(
    tmp_path, ratio, mean_ppl, templar_ppl, holds
):
    configs = {
        "sparseloco": [config("sparseloco", h, **ppl(mean_ppl, 4.0 / h)) for h in (15, 30, 50)],
        "sparseloco_templar": [
            config("sparseloco", h, **ppl(templar_ppl, 4.0 / h), aggregate="templar") for h in (15, 30, 50)
        ],
        "diloco": [config("diloco", h, **ppl(9.0, 4.0 * ratio / h)) for h in (15, 30, 50)],
    }
    finding = sparseloco2025.analyze(configs, tmp_path)
    assert finding.holds is holds and finding.verdict.startswith(OPENING[holds])
    assert f"{ratio:.1f}x" in finding.verdict
    for value, name in ((mean_ppl, "the paper's mean"), (templar_ppl, "templar's aggregation")):
        arm = {(True, True): "holds", (False, False): "does not hold"}.get((value <= 9.0, ratio >= 97), "partly holds")
        assert f"with {name} it {arm}," in finding.verdict
    assert "| 15 | templar |" in finding.table and "| 15 | mean |" in finding.table


@pytest.mark.parametrize(("h50_ppl", "holds"), [(9.1, True), (12.0, None)])
def test_douillard2023_text_decides_near_synchronous_bytes_and_outer_step(tmp_path, h50_ppl, holds):
    configs = {
        "diloco": [config("diloco", h, **ppl(9.0 if h < 50 else h50_ppl, 20.0 / h)) for h in (15, 30, 50)],
        "synchronous": [config("allreduce", **ppl(8.9, 200.0))],
        "averaging": [config("local_sgd", 50, **ppl(14.0, 0.4))],
    }
    finding = douillard2023_text.analyze(configs, tmp_path)
    assert finding.holds is holds and finding.verdict.startswith(OPENING[holds])


def test_noloco2025_draws_its_plots_drawn(tmp_path):
    configs = {
        "main": [config("noloco", 50, **ppl(9.0, 4.5)), config("diloco", 50, **ppl(9.2, 3.9))],
        "synchronous": [config("allreduce", **ppl(8.5, 200.0))],
    }
    finding = noloco2025.analyze(configs, tmp_path)
    assert [p.name for p in finding.plots] == ["vs_steps.png", "vs_mb_sent.png"] and all(
        p.exists() for p in finding.plots
    )
