"""Run folders that never lie (experiments.folders, dpsgd.runfiles, dpsgd.checkpoint): a resume that cannot resume
says so in one line, one that skips a torn checkpoint says which, a refused start or resume changes no byte of the
folder, a second run into a folder in use is refused, and a full disk or a read-only folder is one line (exit 1) that
leaves no empty or torn file under a final name (on a small tmpfs, where this machine lets the test mount one)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from dpsgd import checkpoint

pytestmark = pytest.mark.processes

BASE = ["backend=local", "epochs=2", "log_every=5", "checkpoint.every=5"]  # 22 steps: checkpoints 15 and 20 kept


@pytest.fixture(scope="module")
def finished(app, tmp_path_factory) -> Path:
    """A finished run of BASE with its checkpoints; tests work on copies of it."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    proc = app(BASE, run_dir)
    assert proc.returncode == 0, proc.stderr
    assert checkpoint.complete_steps(run_dir, 4) == [15, 20]
    return run_dir


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(run_dir, target)
    return target


def fingerprint(folder: Path) -> dict[str, str]:
    """Every file and folder under `folder`: a file's SHA-256, a folder's 'dir'."""
    return {
        str(p.relative_to(folder)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
    }


def error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


# --- resume says what it resumed ------------------------------------------------------------------


@pytest.mark.slow  # soak: make test keeps the torn newest checkpoint
def test_resume_with_every_checkpoint_corrupt_is_refused_in_one_line(app, finished, tmp_path):
    run_dir = copy_of(finished, tmp_path)
    for f in (run_dir / "checkpoints").rglob("*"):
        if f.is_file():
            f.write_bytes(os.urandom(f.stat().st_size))  # every file of every checkpoint: random bytes
    before = fingerprint(run_dir)
    proc = app([*BASE, "resume=true"], run_dir)
    assert proc.returncode == 2, proc.stderr
    line = error_line(proc)
    assert "resume=true, but" in line and "holds no complete checkpoint" in line and "resume=auto" in line, line
    assert "step 20: " in line, line  # what it found
    assert fingerprint(run_dir) == before


def test_resume_skips_a_torn_newest_checkpoint_and_says_so(app, finished, tmp_path):
    run_dir = copy_of(finished, tmp_path)
    newest = run_dir / "checkpoints" / "step_00000020" / "rank1.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # one rank's file of the newest step cut to 100 bytes
    proc = app([*BASE, "resume=true"], run_dir)
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(notes) == 1 and notes[0].startswith("note: the newest checkpoint cannot be resumed (step 20: "), notes
    assert notes[0].endswith("resuming from step 15"), notes
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"] == 15 and summary["steps"] == 22
    assert json.loads((finished / "summary.json").read_text())["resumed_from"] is None  # a new run resumed nothing


def test_resume_auto_starts_over_only_where_there_is_no_checkpoint(app, finished, tmp_path):
    run_dir = copy_of(finished, tmp_path)
    shutil.rmtree(run_dir / "checkpoints")
    refused = app([*BASE, "resume=true"], run_dir)
    assert refused.returncode == 2 and "no checkpoints/ folder" in error_line(refused)
    again = app([*BASE, "resume=auto"], run_dir)
    assert again.returncode == 0, again.stderr
    assert "note: resume=auto: " in again.stderr and "starting a new run" in again.stderr
    assert json.loads((run_dir / "summary.json").read_text())["resumed_from"] is None
    continued = app([*BASE, "resume=auto"], copy_of(finished, tmp_path / "second"))  # with one: a plain resume
    assert continued.returncode == 0 and "note:" not in continued.stderr, continued.stderr


# --- a run folder is written only by its own run -------------------------------------------------------


@pytest.mark.parametrize(
    "args, words",
    [
        (["seed=7", "algorithm=allreduce", "epochs=8"], "already holds a run; pass resume=true"),  # a new start
        (["epochs=8", "resume=true"], "was started with a different config (epochs=2 there, 8 here"),  # a resume
    ],
)
def test_a_refused_run_leaves_the_folder_byte_for_byte(app, finished, tmp_path, args, words):
    run_dir = copy_of(finished, tmp_path)
    before = fingerprint(run_dir)
    proc = app([a for a in BASE if not a.startswith("epochs=")] + args, run_dir)
    assert proc.returncode == 2 and words in error_line(proc), proc.stderr
    assert fingerprint(run_dir) == before  # .hydra/ included: Hydra writes nothing before the app has judged


def test_a_folder_in_use_by_another_run_is_refused(app, tmp_path):
    """Another run holds the folder (its lock, as a running app holds it): a second run into it changes nothing."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        proc = app(["backend=local", "epochs=1"], run_dir)
    finally:
        os.close(fd)
    assert proc.returncode == 2 and "is being written by another run now" in error_line(proc), proc.stderr
    assert fingerprint(run_dir) == {}


# --- I/O failures in one line (a small tmpfs) --------------------------------------------------------


@contextlib.contextmanager
def small_disk(size: str = "200k"):
    """A tmpfs of `size` mounted for the test (skipped where mounting is refused: not root, a container without the
    right; never in CI as root, where it must run), unmounted afterwards whatever happened."""
    folder = Path(tempfile.mkdtemp(prefix="dpsgd-disk-"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        folder.rmdir()
        if os.environ.get("CI") and os.geteuid() == 0:
            pytest.fail(f"mounting a tmpfs as root failed: {mounted.stderr.decode().strip()}")
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
        with contextlib.suppress(OSError):
            folder.rmdir()


def damaged_files(folder: Path) -> list[str]:
    """Files under a final name that are empty or torn, and temporary files left behind."""
    bad = []
    for f in sorted(folder.rglob("*")) if folder.exists() else []:
        if f.is_dir():
            continue
        data = f.read_bytes()
        if f.name.endswith(".tmp") or not data:
            bad.append(f"{f.name}: {'temporary' if data else 'empty'}")
        elif f.suffix == ".json":
            json.loads(data)
        elif f.name == "metrics.jsonl":
            assert data.endswith(b"\n"), f"{f} ends mid-line"
            [json.loads(line) for line in data.splitlines()]
        elif f.suffix == ".pt" and f.with_suffix(".sha256").exists():
            size, digest = f.with_suffix(".sha256").read_text().split()
            assert len(data) == int(size) and hashlib.sha256(data).hexdigest() == digest, f"{f} torn"
    return bad


@pytest.mark.slow  # soak: a whole run on a filled tmpfs
@pytest.mark.timeout(600)
def test_a_full_disk_is_one_line_and_leaves_no_torn_file(app, tmp_path):
    """The base run into a 200 KB tmpfs filled to several levels, so that the disk fills while writing the config,
    Hydra's record, the metrics or a checkpoint: each run ends with exit 1 and one line naming the file and the
    error (or finishes, where it fits), and leaves no empty, torn or temporary file."""
    ended = []
    with small_disk() as disk:
        # KB left free, and the run: its four checkpoints alone are more than 200 KB; without checkpoints and with a
        # record each step the metrics outgrow 24 KB
        for left_kb, args in ((8, []), (16, []), (24, ["checkpoint.every=0", "log_every=1"]), (90, [])):
            for f in disk.iterdir():
                shutil.rmtree(f) if f.is_dir() else f.unlink()
            total_kb = os.statvfs(disk).f_blocks * os.statvfs(disk).f_frsize // 1024
            with contextlib.suppress(OSError):
                (disk / "filler").write_bytes(b"\0" * (total_kb - left_kb) * 1024)
            run_dir = disk / "run"
            proc = app(["backend=local", "epochs=3", "log_every=2", "checkpoint.every=10", *args], run_dir)
            assert proc.returncode == 1, proc.stderr
            line = error_line(proc)
            assert "No space left on device (errno 28)" in line and f"cannot write {run_dir}" in line, line
            assert damaged_files(run_dir) == [], (left_kb, proc.stderr)
            ended.append((left_kb, line.split(f"cannot write {run_dir}/", 1)[1].split(":", 1)[0]))
    print(f"\nKB free -> the file the disk was full at: {ended}")
    assert {Path(name).parts[0] for _, name in ended} >= {"metrics.jsonl", "checkpoints"}, ended


@pytest.mark.timeout(300)
def test_a_read_only_folder_is_one_line(app, tmp_path):
    with small_disk() as disk:
        (disk / "existing").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        for run_dir in (disk / "existing", disk / "new" / "run"):
            before = fingerprint(disk)
            proc = app(["backend=local", "epochs=1"], run_dir)
            assert proc.returncode == 1, proc.stderr
            assert "Read-only file system (errno 30)" in error_line(proc) and str(run_dir) in error_line(proc)
            assert fingerprint(disk) == before
