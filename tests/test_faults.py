"""Injected faults (dpsgd.faults) end as one clear line, in bounded time, on `local` and on real
processes; torn checkpoints are skipped; a run killed mid-way resumes to the numbers of an
uninterrupted one."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from runs import assert_same_numbers

from dpsgd import checkpoint
from dpsgd.backends.launch import failure_cause
from dpsgd.comm import LocalCommunicator, LocalWorld, PeerFailedError, PeerTimeoutError, run_local, transport
from dpsgd.config import parse
from dpsgd.faults import FaultInjector, FaultPlan, InjectedFault
from dpsgd.supervisor import Supervisor
from dpsgd.training import train


@pytest.fixture
def config(hydra_config):
    """`config(*overrides)`: the app's config on the local backend, 2 epochs, a record every 5 steps."""
    return lambda *overrides: hydra_config("epochs=2", "log_every=5", *overrides)


@pytest.fixture
def cli(app):
    """`cli(args, run_dir)` runs the app; returns the process, its wall time and the moment (time.time) it ended."""

    def run(args: list[str], run_dir: Path, timeout: float = 240) -> tuple[subprocess.CompletedProcess, float, float]:
        start = time.monotonic()
        proc = app(args, run_dir, timeout=timeout)
        return proc, time.monotonic() - start, time.time()

    return run


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


# --- the plan and the injector ---------------------------------------------------------------


@pytest.mark.parametrize(
    "section, words",
    [
        ({"kill_peer": 4}, "faults.kill_peer must be a peer rank in [0, 4)"),
        ({"kill_peer": 1, "kill_mode": "explode"}, "faults.kill_mode must be one of exit, hang"),
        ({"at_step": 0}, "faults.at_step must be an integer >= 1"),
        ({"delay_s": -1}, "faults.delay_s must be a number of seconds >= 0"),
        ({"drop_messages": 1.5}, "faults.drop_messages must be a fraction in [0, 1]"),
        ({"kill": 1}, "unknown faults option(s) ['kill']"),
    ],
)
def test_fault_plan_refuses_bad_options(section, words):
    with pytest.raises(ValueError) as info:
        FaultPlan.from_config(section, peers=4, backend=transport.get("local"))
    assert words in str(info.value)


def test_lost_messages_only_on_local():
    with pytest.raises(ValueError, match="backend=local only"):
        FaultPlan.from_config({"drop_messages": 0.1}, peers=4, backend=transport.get("mpi"))


def test_no_fault_configured_changes_nothing(config):
    cfg = config("peers=4")
    plain = run_local(4, train, parse(cfg), None)[0]
    delayed = run_local(
        4, train, parse(config("peers=4", "faults.delay_peer=1", "faults.delay_s=0.05", "faults.at_step=3")), None
    )[0]
    for key in ("test_accuracy", "train_loss", "consensus_distance", "mb_sent_per_peer"):
        assert plain[key] == delayed[key], key  # a slow peer slows the run, never its numbers
    # the delay was slept before each step from step 3: a floor load cannot break (plain's time can pass it)
    assert delayed["wall_time_s"] >= 0.05 * (delayed["steps"] - 2), delayed  # 1 s: 4x plain's whole run


def test_delay_past_the_timeout_names_the_slow_peer(config):
    cfg = config("peers=4", "faults.delay_peer=2", "faults.delay_s=1.5", "faults.at_step=3")
    with pytest.raises(PeerTimeoutError) as info:
        run_local(4, train, parse(cfg), None, timeout_s=0.5)
    assert "waiting for peer(s) [2] at step 3" in str(info.value)


def test_a_peer_busy_outside_any_wait_does_not_hold_back_the_others_error():
    """Peer 1 computes for 30 s; peer 0's barrier times out after 1 s: the caller has that error within about
    2 timeouts, not when peer 1 is done (a thread cannot be killed; run_local stops waiting for it)."""

    def peer(comm):
        if comm.rank == 1:
            time.sleep(30)
        comm.barrier()

    start = time.monotonic()
    with pytest.raises(PeerTimeoutError, match="rank 0: barrier timed out after 1 s"):
        run_local(2, peer, timeout_s=1.0)
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("peer_fails", [True, False])
def test_a_wait_downstream_of_an_earlier_wait_leaves_the_timeout_to_it(peer_fails):
    """Peer 1 waits (for someone else) with an earlier deadline than peer 0, which waits for peer 1: a busy machine
    can run peer 0 past its deadline first. Peer 0 then leaves the timeout to peer 1 (the run's first fault, nearer
    its cause) and is released when peer 1 fails; if peer 1 never does, peer 0 times out one timeout span later."""
    world = LocalWorld(2)
    comm = LocalCommunicator(world, 0, timeout_s=0.4)
    start = time.monotonic()
    world.waiting_until[1] = start + 0.2  # peer 1, waiting since before peer 0 (its thread not run: a busy machine)
    if peer_fails:
        threading.Timer(0.8, world.fail, args=(1,)).start()  # peer 1's own timeout, late
        with pytest.raises(PeerFailedError, match="abandoned because peer 1 failed"):
            comm.neighbor_exchange(torch.ones(3), [1], [1])
        assert 0.7 < time.monotonic() - start < 3
    else:
        with pytest.raises(PeerTimeoutError, match=r"rank 0: neighbor_exchange timed out after 0.4 s .* \[1\]"):
            comm.neighbor_exchange(torch.ones(3), [1], [1])
        assert 0.75 < time.monotonic() - start < 3  # its deadline (0.4 s), then one more span
    later = LocalWorld(2)
    later.waiting_until[1] = time.monotonic() + 10  # peer 1 waits since after peer 0: peer 0's own deadline, as before
    start = time.monotonic()
    with pytest.raises(PeerTimeoutError):
        LocalCommunicator(later, 0, timeout_s=0.2).neighbor_exchange(torch.ones(3), [1], [1])
    assert time.monotonic() - start < 0.35


def test_lost_messages_are_a_timeout_naming_the_sender(config):
    cfg = config("peers=4", "faults.drop_messages=1.0", "faults.at_step=4")
    start = time.monotonic()
    with pytest.raises(PeerTimeoutError) as info:
        run_local(4, train, parse(cfg), None, timeout_s=1.0)
    assert time.monotonic() - start < 10
    assert "neighbor_average timed out after 1 s" in str(info.value) and "at step 4" in str(info.value)


def test_dropping_is_seeded_and_starts_at_at_step():
    class Comm:
        rank, size, backend = 1, 4, "local"

    plan = FaultPlan(drop_messages=0.5, at_step=3)
    a, b = FaultInjector(plan, Comm(), seed=7), FaultInjector(plan, Comm(), seed=7)
    a.before_step(2)
    assert not any(a._drop(0) for _ in range(100))
    a.before_step(3)
    b.before_step(3)
    draws = [a._drop(0) for _ in range(200)]
    assert draws == [b._drop(0) for _ in range(200)] and 60 < sum(draws) < 140


def test_killed_local_peer_stops_the_world_at_once(config):
    cfg = config("peers=4", "faults.kill_peer=3", "faults.at_step=5")
    start = time.monotonic()
    with pytest.raises(InjectedFault, match="peer 3 exited at step 5"):
        run_local(4, train, parse(cfg), None, timeout_s=60)
    assert time.monotonic() - start < 30  # not the 60 s timeout: the world knows the peer failed


# --- the app: one line, exit code 1, bounded time ---------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "args, words",
    [
        (["faults.kill_peer=2", "faults.at_step=5"], ["rank 2: InjectedFault: peer 2 exited at step 5"]),
        (
            ["faults.kill_peer=2", "faults.at_step=5", "faults.kill_mode=hang"],
            ["PeerTimeoutError: neighbor_average timed out after 2 s waiting for peer(s) [2] at step 5"],
        ),
        pytest.param(  # make soak: the same line as the hang's; in process, test_lost_messages_... checks it
            ["faults.drop_messages=1.0", "faults.at_step=5"],
            ["PeerTimeoutError: neighbor_average timed out after 2 s", "at step 5"],
            marks=pytest.mark.slow,
        ),
    ],
)
def test_local_fault_ends_the_run_with_one_line(cli, args, words, tmp_path):
    proc, seconds, _ = cli(["backend=local", "comm.timeout_s=2", "epochs=2", *args], tmp_path / "run")
    assert proc.returncode == 1, proc.stderr
    line = one_error_line(proc)
    for w in words:
        assert w in line, (w, line)
    assert "all peers stopped after" in line and "traceback.log" in line
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "backend, mode, words",
    [
        pytest.param(  # soak: make test keeps the hanging mpi peer of test_watchdog
            "mpi",
            "hang",
            ["rank 0: PeerTimeoutError: neighbor_average timed out after 4 s waiting for peer(s) [1] at step 5"],
            marks=pytest.mark.slow,
        ),
        (
            "torch",
            "exit",
            [
                "peer 1 died at step 5 without an error message (killed by SIGKILL)",
                "its log ends: fault: peer 1 exited at step 5",
            ],
        ),
    ],
)
def test_process_fault_ends_the_run_with_one_line(cli, backend, mode, words, tmp_path):
    """A peer process that dies (SIGKILL) or hangs: the whole run ends, well within 2x comm.timeout_s
    of the fault, with one line naming the peer and the step (a dead MPI peer: the 8-peer test below)."""
    timeout_s, run_dir = 4, tmp_path / "run"
    proc, _, ended = cli(
        [
            f"backend={backend}",
            "peers=2",
            f"comm.timeout_s={timeout_s}",
            "epochs=2",
            "faults.kill_peer=1",
            "faults.at_step=5",
            f"faults.kill_mode={mode}",
        ],
        run_dir,
    )
    assert proc.returncode == 1, proc.stderr
    line = one_error_line(proc)
    for w in words:
        assert w in line, (w, line)
    assert f"logs: {run_dir / 'logs'}" in line
    fault_at = (run_dir / "logs" / "rank1.log").stat().st_mtime  # its last line is the fault's
    assert "fault: peer 1" in (run_dir / "logs" / "rank1.log").read_text()
    assert ended - fault_at < 4 * timeout_s, ended - fault_at  # 2x on a quiet machine: room for a loaded one


# --- checkpoints: torn ones are skipped ---------------------------------------------------------


def _saved_world(tmp_path, steps=(10, 20), peers=2):
    def save_all(comm):
        for step in steps:
            checkpoint.save(comm, tmp_path, step, {"step": step, "w": torch.full((3,), float(step + comm.rank))})

    run_local(peers, save_all)
    return tmp_path / "checkpoints"


@pytest.mark.parametrize(
    "tear, why",
    [
        (lambda d: (d / "COMPLETE").unlink(), "no COMPLETE marker"),
        (lambda d: (d / "rank1.pt").write_bytes((d / "rank1.pt").read_bytes()[:50]), "truncated"),
        (lambda d: (d / "rank0.pt").write_bytes(bytes(reversed((d / "rank0.pt").read_bytes()))), "altered"),
        (lambda d: (d / "rank1.pt").unlink(), "missing"),
        (lambda d: (d / "rank0.sha256").unlink(), "missing"),
    ],
)
def test_torn_checkpoint_falls_back_to_the_previous_complete_one(tmp_path, tear, why):
    root = _saved_world(tmp_path)
    assert checkpoint.complete_steps(tmp_path, 2) == [10, 20]
    tear(root / "step_00000020")
    assert why in checkpoint.torn(root / "step_00000020", 2)
    assert checkpoint.complete_steps(tmp_path, 2) == [10]
    for rank in (0, 1):  # every peer chooses the same step: never a mix
        state = checkpoint.load_latest(tmp_path, rank, 2)
        assert state["step"] == 10 and state["w"].tolist() == [10.0 + rank] * 3


def test_a_checkpoint_removed_while_listed_is_skipped(tmp_path, monkeypatch):
    """Rank 0 prunes old steps while a signal's handler lists the complete ones (local peers are threads that run
    on): a file that vanishes between its exists() and its stat() leaves that step out, not a FileNotFoundError."""
    from pathlib import Path

    _saved_world(tmp_path)
    real_stat, seen = Path.stat, []

    def vanishing(self, *args, **kwargs):  # there for exists(), gone by the size check's stat()
        if self.parent.name == "step_00000010" and self.name == "rank0.pt":
            seen.append(self)
            if len(seen) > 1:
                raise FileNotFoundError(2, "No such file or directory", str(self))
        return real_stat(self, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", vanishing)
    assert checkpoint.complete_steps(tmp_path, 2, verify=False) == [20]
    assert len(seen) == 2


def test_checkpoint_of_another_world_size_is_not_resumed(tmp_path):
    _saved_world(tmp_path)
    assert checkpoint.load_latest(tmp_path, 0, 3) is None


def test_checkpoint_keeps_two_and_leaves_no_temporary_files(tmp_path):
    root = _saved_world(tmp_path, steps=(10, 20, 30))
    assert sorted(p.name for p in root.iterdir()) == ["step_00000020", "step_00000030"]
    assert not list(root.rglob("*.tmp"))


def test_checkpoint_cannot_run_code(tmp_path):
    """A checkpoint is loaded with weights_only=True: a pickled object that would run code is refused."""
    root = _saved_world(tmp_path, steps=(10,))
    evil = root / "step_00000010" / "rank0.pt"
    torch.save({"step": 10, "w": _RunsCode()}, evil)
    data = evil.read_bytes()
    (root / "step_00000010" / "rank0.sha256").write_text(f"{len(data)} {hashlib.sha256(data).hexdigest()}\n")
    with pytest.raises(Exception, match="Weights only load failed"):
        checkpoint.load_latest(tmp_path, 0, 2)


class _RunsCode:
    def __reduce__(self):
        return (print, ("this ran",))


# --- resume after a crash: the numbers of an uninterrupted run ------------------------------------


@pytest.mark.slow  # soak: make test keeps the killed run's resume and the torn checkpoint (test_run_folders)
@pytest.mark.timeout(200)
def test_local_peer_killed_then_torn_checkpoint_then_resume_gives_same_numbers(cli, tmp_path):
    args = ["backend=local", "epochs=12", "log_every=10", "checkpoint.every=10"]
    full = tmp_path / "full"
    assert cli(args, full)[0].returncode == 0
    run_dir = tmp_path / "killed"
    proc, _, _ = cli(args + ["faults.kill_peer=1", "faults.at_step=35"], run_dir)
    assert proc.returncode == 1 and "peer 1 exited at step 35" in proc.stderr
    assert checkpoint.complete_steps(run_dir, 4) == [20, 30]
    # the newest checkpoint is torn too (a peer died while writing): step 20 is used
    pt = run_dir / "checkpoints" / "step_00000030" / "rank2.pt"
    pt.write_bytes(pt.read_bytes()[:100])
    assert_resumes_to_the_same_numbers(cli, args, full, run_dir)


@pytest.mark.slow  # 62 s: in make soak; make test kills and resumes smaller runs (local, mpi, a lost test host)
@pytest.mark.timeout(400)
def test_kill_one_of_8_mpi_peers_ends_the_run_and_resume_finishes_it(cli, tmp_path):
    """The issue's acceptance test: one of 8 MPI peers dies mid-run; the run ends within 2x
    comm.timeout_s with one line naming it; resume=true ends with the uninterrupted run's numbers."""
    timeout_s = 10
    args = ["backend=mpi", "peers=8", "epochs=10", "log_every=5", "checkpoint.every=10", f"comm.timeout_s={timeout_s}"]
    full = tmp_path / "full"
    proc, _, _ = cli(args, full)
    assert proc.returncode == 0, proc.stderr
    run_dir = tmp_path / "killed"
    proc, seconds, ended = cli(args + ["faults.kill_peer=5", "faults.at_step=37"], run_dir)
    assert proc.returncode == 1, proc.stderr
    line = one_error_line(proc)
    assert "peer 5 died at step 37 without an error message (Killed (signal 9))" in line, line
    fault_at = (run_dir / "logs" / "rank5.log").stat().st_mtime
    print(
        f"\nkill 1 of 8 mpi peers: exit {ended - fault_at:.2f} s after the fault "
        f"(run {seconds:.1f} s in all); limit {2 * timeout_s} s\n{line}"
    )
    assert ended - fault_at < 2 * timeout_s
    assert checkpoint.complete_steps(run_dir, 8) == [20, 30]
    assert_resumes_to_the_same_numbers(cli, args, full, run_dir)


def assert_resumes_to_the_same_numbers(cli, args: list[str], full: Path, run_dir: Path) -> None:
    """resume=true in `run_dir` ends with the numbers of the uninterrupted run in `full`."""
    resumed, _, _ = cli(args + ["resume=true"], run_dir)
    assert resumed.returncode == 0, resumed.stderr
    assert_same_numbers(full, run_dir)


# --- the driver's diagnosis -------------------------------------------------------------------------


class _Seen:
    """What a Supervisor saw: last steps, and when each peer's process ended without finishing."""

    def __init__(self, steps, ended):
        self.steps, self.ended, self.finished = steps, ended, set()


def _error_file(log_dir: Path, rank: int, line: str, at: float) -> None:
    path = log_dir / f"rank{rank}.error"
    path.write_text(line + "\n")
    os.utime(path, (at, at))


def first_line(*args, **kwargs) -> str:
    return failure_cause(*args, **kwargs)[0]


def test_failure_cause_is_the_silent_death_that_came_first(tmp_path):
    (tmp_path / "rank3.log").write_text("fault: peer 3 exited at step 40\n")
    _error_file(tmp_path, 1, "rank 1: PeerTimeoutError: neighbor_average timed out", at=1000.5)
    seen = _Seen({0: 41, 1: 41, 2: 41, 3: 40}, {3: 1000.0, 0: 1000.6})
    line = first_line(tmp_path, seen, 9, 4)
    assert line.startswith("peer 3 died at step 40 without an error message (exit code 9)")
    assert line.endswith("its log ends: fault: peer 3 exited at step 40")


def test_failure_cause_a_timeout_is_the_cause_of_the_deaths_after_it(tmp_path):
    timeout = "rank 1: PeerTimeoutError: neighbor_average timed out ... [2] at step 5"
    _error_file(tmp_path, 1, timeout, at=1000.0)
    seen = _Seen({0: 5, 1: 5, 2: 5, 3: 5}, {2: 1000.1, 0: 1000.1, 3: 1000.2})  # mpiexec's cleanup
    assert first_line(tmp_path, seen, 1, 4) == timeout


def test_failure_cause_a_survivor_reporting_a_failed_peer_defers_to_it(tmp_path):
    _error_file(tmp_path, 0, "rank 0: PeerFailedError: peer(s) [1] failed or cannot be reached", at=1000.0)
    seen = _Seen({0: 151, 1: 151}, {1: 1000.3})  # the driver's thread saw the death late
    assert first_line(tmp_path, seen, 1, 2).startswith("peer 1 died at step 151 without an error message")


def test_failure_cause_torch_process_killed_by_a_signal(tmp_path):
    _error_file(tmp_path, 0, "rank 0: PeerTimeoutError: Connection closed by peer", at=999.0)
    seen = _Seen({0: 7, 1: 7}, {1: 1000.0})
    assert "peer 1 died at step 7 without an error message (killed by SIGKILL)" in first_line(
        tmp_path, seen, 1, 2, codes=[None, -9]
    )


def test_failure_cause_a_lost_host_names_all_its_peers(tmp_path):
    """Host b lost (both its peers killed): the line names peers 2 and 3 and the host; a silent death
    on one host among several names that peer alone."""
    _error_file(tmp_path, 0, "rank 0: PeerTimeoutError: Connection closed by peer", at=1001.0)
    seen = _Seen({0: 23, 1: 23, 2: 23, 3: 22}, {3: 1000.0, 2: 1000.1})
    on = ["a", "a", "b", "b"]
    line = first_line(tmp_path, seen, 1, 4, codes=[None, None, -9, -9], hosts=on)
    assert line == (
        "peers 2, 3 (every peer on host b) died at steps 23, 22 without an error message (killed by SIGKILL): "
        "the host or its link was lost"
    )
    seen = _Seen({0: 23, 1: 23, 2: 23, 3: 22}, {3: 1000.0})
    assert first_line(tmp_path, seen, 1, 4, codes=[None, None, None, -9], hosts=on).startswith(
        "peer 3 died at step 22 without an error message (killed by SIGKILL)"
    )


def test_supervisor_hears_steps_and_deaths():
    import socket
    import struct

    with Supervisor() as sup:
        conns = []
        for rank in (0, 1):
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(sup.path)
            conn.sendall(struct.pack("<iq", rank, 12))
            conns.append(conn)
        conns[0].sendall(struct.pack("<iq", 0, -1))  # finished
        for conn in conns:
            conn.close()
        deadline = time.monotonic() + 5
        while (1 not in sup.ended or 0 not in sup.finished) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sup.steps == {0: 12, 1: 12} and sup.finished == {0} and list(sup.ended) == [1]
    assert not Path(sup.path).exists()


def test_a_peers_error_line_reaches_the_driver_without_a_file(tmp_path, monkeypatch):
    """A peer that can write no file (a full disk) sends its line through the supervisor's socket: the driver's
    failure line is that line, with no rank{r}.error file in the logs."""
    from dpsgd import supervisor

    with Supervisor() as sup:
        monkeypatch.setenv(supervisor.ENV, sup.path)
        monkeypatch.setattr(supervisor, "_conn", None)
        try:
            supervisor.report_step(2, 5)
            line = "rank 2: cannot write RUN/metrics.jsonl: No space left on device (errno 28); free space ..."
            supervisor.report_error(2, line)
            supervisor.report_error(2, "a second line: the first one stays")
            deadline = time.monotonic() + 5
            while 2 not in sup.errors and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            supervisor._conn[0].close()
        assert sup.steps == {2: 5} and sup.errors[2][1] == line
        seen = _Seen({0: 5, 1: 5, 2: 5}, {2: sup.errors[2][0] + 0.1})
        seen.errors = sup.errors
        assert first_line(tmp_path, seen, 1, 3) == line


# mpiexec.gforker's account of its ranks (MPICH 5.0.2 from the wheel, 2026-12-06: `mpiexec.gforker -n 4 python S`
# where S's rank 2 sends itself SIGKILL; gforker then stops the others with SIGINT and SIGQUIT, and exits 0)
GFORKER_KILLED = """\
[0]0:Return code = 0, signaled with Quit
[0]1:Return code = 0, signaled with Quit
[0]2:Return code = 0, signaled with Killed
[0]3:Return code = 0, signaled with Quit
"""


def test_failure_cause_reads_gforkers_account_of_a_killed_rank(tmp_path):
    from dpsgd.backends.launch import forker_exit

    assert forker_exit(GFORKER_KILLED, 2) == "Killed (signal 9)"
    assert forker_exit(GFORKER_KILLED) == "Quit (signal 3)"  # the first it names
    assert forker_exit("[0]1:Return code = 5\n", 1) == "exit code 5" and forker_exit("done\n") is None
    (tmp_path / "launcher.log").write_text(GFORKER_KILLED)
    seen = _Seen({0: 9, 1: 9, 2: 8, 3: 9}, {2: 1000.0, 0: 1000.2, 1: 1000.2, 3: 1000.3})
    assert first_line(tmp_path, seen, 1, 4).startswith(
        "peer 2 died at step 8 without an error message (Killed (signal 9))"
    )


@pytest.mark.slow  # soak: make test keeps the process faults on mpi
@pytest.mark.timeout(200)
def test_mpi_rank_killed_from_outside_is_named(app, tmp_path):
    """No injection: `kill -9` of one rank (as the OOM killer would) mid-run."""
    run_dir = tmp_path / "run"
    args = ["backend=mpi", "peers=2", "epochs=300", "comm.timeout_s=10"]
    proc = app.start(args, run_dir, stderr=subprocess.PIPE, text=True)
    victim, deadline = None, time.monotonic() + 150
    while victim is None and time.monotonic() < deadline:
        time.sleep(0.2)
        if not (run_dir / "metrics.jsonl").exists():
            continue
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"experiments.peer" in cmdline and str(run_dir).encode() in cmdline and b"PMI_RANK=1" in environ:
                victim = int(pid)
    assert victim is not None, "rank 1 never started"
    time.sleep(0.5)
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    stderr = proc.communicate(timeout=120)[1]
    seconds = time.monotonic() - killed_at
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1, stderr
    # MPICH reports the signal unless rank 0's own exit reaches it first (seen once in ~10 runs)
    assert lines[0].startswith("error: peer 1 died at step "), lines[0]
    assert "(Killed (signal 9))" in lines[0] or "mpiexec exited with code" in lines[0], lines[0]
    assert seconds < 20, seconds
