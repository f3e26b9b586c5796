"""A run says how long it will take (dpsgd.progress): its planned steps at once, then an estimate of the time left
after the first steps and now and then (on stdout away from a terminal), checked against the arithmetic on a clock
the test moves; and a run of the app prints them."""

from __future__ import annotations

import pytest

from dpsgd import progress


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    ticking = Clock()
    monkeypatch.setattr(progress.time, "monotonic", ticking)
    return ticking


def test_lines_plan_then_estimate_then_now_and_then(clock, capsys):
    shown = progress.Lines(1000, 0, "4 peers")
    assert capsys.readouterr().out == "training: 1,000 steps planned (4 peers)\n"
    clock.now += 1.5
    shown.update(100)  # a tenth of the run, but too soon to tell
    clock.now += 3.5
    shown.update(50)
    assert capsys.readouterr().out == ""
    clock.now += 1.0
    shown.update(100)  # 6 s for 100 steps: 900 steps left take 54 s
    assert capsys.readouterr().out == "step 100 of 1,000 (10%), 6 s so far, about 54 s left\n"
    clock.now += 2.0
    shown.update(150)  # within AT_LEAST_S of the last line
    clock.now += 12.0
    shown.update(190)  # 10 s since the last line, but not another tenth yet
    assert capsys.readouterr().out == ""
    clock.now += 2.0
    shown.update(200, "acc 0.900  loss 0.300")  # 22 s for 200: 800 left take 88 s
    assert capsys.readouterr().out == "step 200 of 1,000 (20%), 22 s so far, about 88 s left; acc 0.900  loss 0.300\n"
    clock.now += progress.AT_MOST_S
    shown.update(201)  # minutes without a line: one, though the run moved little
    assert capsys.readouterr().out.startswith("step 201 of 1,000 (20%), 5 min so far")


def test_a_resumed_run_estimates_from_its_own_steps(clock, capsys):
    """Resumed at step 600 of 1000: 50 steps in 10 s since the start of this process, 350 left: 70 s."""
    shown = progress.Lines(1000, 600)
    clock.now += 10.0
    shown.update(650)
    assert capsys.readouterr().out.splitlines() == [
        "training: 400 steps left of 1,000 planned (resumed at step 600)",
        "step 650 of 1,000 (65%), 10 s so far, about 70 s left",
    ]


def test_huge_runs_are_told_in_years(clock, capsys):
    shown = progress.Lines(10**14, 0)
    clock.now += 20.0
    shown.update(2000)
    assert capsys.readouterr().out.splitlines()[-1] == (
        "step 2,000 of 100,000,000,000,000 (0%), 20 s so far, about 31,688 years left"
    )


@pytest.mark.parametrize("chosen, tty, expected", [("", True, "bar"), ("", False, "lines"), ("off", True, "off")])
def test_mode(monkeypatch, chosen, tty, expected):
    monkeypatch.setenv(progress.ENV, chosen)
    monkeypatch.setattr(progress.sys.stdout, "isatty", lambda: tty)
    assert progress.mode() == expected


def test_the_app_prints_its_planned_steps(app, tmp_path):
    proc = app(["backend=local", "epochs=3"], tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "training: 33 steps planned (4 peers, 3 epochs of 11 steps of 32 samples)"
    assert proc.stderr == ""  # progress on stdout: a failure stays the one line on stderr
