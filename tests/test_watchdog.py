"""The driver's watchdog: when every peer is stuck (peers=1 hanging: no communication timeout can
fire), the run ends with one line after comm.timeout_s plus the margin, and no process is left."""

from __future__ import annotations

import threading
import time

import pytest
from test_interrupt import processes_of

from dpsgd.backends.watchdog import MARGIN_S, Watchdog
from dpsgd.comm import CommError, LocalWorld, run_local

TIMEOUT_S = 1


def test_watchdog_fires_once_progress_stops_and_not_before():
    beat = [time.monotonic()]
    fired: list[str] = []
    with Watchdog(TIMEOUT_S - MARGIN_S + 0.5, lambda: beat[0], fired.append, lambda: {0: 7}) as dog:
        until = time.monotonic() + 1.5
        while time.monotonic() < until:  # progress every 0.1 s: no alarm
            beat[0] = time.monotonic()
            time.sleep(0.1)
        assert fired == []
        time.sleep(2.5)  # silence past the limit (1.5 s) and the watchdog's next look (every 0.2 s)
    assert len(fired) == 1 and fired[0] == dog.line
    assert "no peer made progress for 2 s" in fired[0] and "peer 0 step 7" in fired[0], fired[0]


def test_a_stopped_local_world_releases_its_caller_from_a_stuck_peer():
    """A thread stuck in computation cannot be killed: run_local stops waiting for it."""
    world = LocalWorld(2)
    threading.Timer(0.3, world.stop, ["stuck"]).start()

    def stuck(comm):
        while True:
            time.sleep(0.05)

    start = time.monotonic()
    with pytest.raises(CommError, match="stuck"):
        run_local(2, stuck, world=world)
    assert time.monotonic() - start < 1


@pytest.mark.processes
@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", [pytest.param("local", marks=pytest.mark.slow), "mpi"])
def test_the_only_peer_hanging_ends_the_run_with_one_line(app, tmp_path, backend):
    run_dir = tmp_path / "run"
    args = [f"backend={backend}", "peers=1", "epochs=2", f"comm.timeout_s={TIMEOUT_S}"]
    args += ["faults.kill_peer=0", "faults.at_step=3", "faults.kill_mode=hang"]
    start = time.monotonic()
    proc = app(args, run_dir, timeout=120)
    took = time.monotonic() - start
    print(f"\n{backend}: peers=1 hung at step 3; the run ended {took:.1f} s after it started: {proc.stderr}")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: no peer made progress for "), proc.stderr
    assert "peer 0 step 3" in lines[0] and "raise comm.timeout_s" in lines[0], lines[0]
    assert not (run_dir / "summary.json").exists()
    assert processes_of(run_dir) == [], "processes left behind"
