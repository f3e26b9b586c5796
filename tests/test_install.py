"""Installed, not only cloned: the wheel built from the repository carries the app's configs and its console
command, and runs the default experiment from a folder outside the repository, in a fresh venv.

Nothing is downloaded: the wheel is built with this venv's setuptools (no build isolation), installed with
--no-deps --no-index, and the fresh venv reuses this venv's packages (torch, mpi4py, hydra, ...) through a
.pth line, below its own site-packages, so `dpsgd` and `experiments` come from the wheel."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _copy_sources(target: Path) -> None:
    """The repository's files (tracked and not ignored) in `target`: the build's build/ folder stays out of the
    worktree, where parallel tests and the user's own builds live."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for name in listed:
        if (ROOT / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target / name)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip wheel . --no-deps` builds from the repository (offline: this venv's setuptools)."""
    src, wheels = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheels")
    _copy_sources(src)
    build = [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-w", str(wheels), "-q"]
    subprocess.run(build, cwd=src, check=True, timeout=300)
    (built,) = wheels.glob("dpsgd-*.whl")
    return built


@pytest.mark.processes  # its fixture builds the wheel with pip
def test_wheel_carries_the_configs_and_the_console_command(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    for path in (ROOT / "conf").rglob("*.yaml"):
        assert f"experiments/conf/{path.relative_to(ROOT / 'conf').as_posix()}" in names, path
    assert "dpsgd/training.py" in names and "experiments/train.py" in names and "topologies/__init__.py" in names
    assert "dpsgd-train = experiments.train:main" in entry_points


@pytest.mark.slow  # about 45 s on 2 loaded cores (the build, a venv, the app's 4 mpi peers); `make soak` runs it
def test_wheel_runs_the_default_experiment_from_another_folder(wheel, tmp_path):
    venv, elsewhere = tmp_path / "venv", tmp_path / "elsewhere"
    elsewhere.mkdir()

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "reuse_test_venv.pth").write_text(sysconfig.get_path("purelib") + "\n")  # after the wheel's own files
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q"]
    subprocess.run([*install, str(wheel)], check=True, timeout=300)

    env = {
        **os.environ,
        "PATH": f"{venv / 'bin'}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        # the MPI wheel's mpiexec and library live under this venv's prefix, where a venv of its own would have them
        "DPSGD_MPIEXEC": str(Path(sys.executable).parent / "mpiexec"),
        "LD_LIBRARY_PATH": os.pathsep.join(
            filter(None, [str(Path(sys.prefix) / "lib"), os.environ.get("LD_LIBRARY_PATH")])
        ),
        "DPSGD_PROGRESS": "0",
    }
    env.pop("PYTHONPATH", None)
    where = subprocess.run(
        [str(python), "-c", "import dpsgd, experiments.train as t; print(dpsgd.__file__, t.CONF_DIR)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert all(str(site) in w for w in where), where  # the wheel's modules and configs, not the repository's
    proc = subprocess.run(
        [str(venv / "bin" / "dpsgd-train"), "epochs=3", "hydra.run.dir=run"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (elsewhere / "run" / "summary.json").exists() and "test acc (avg model)" in proc.stdout
    assert yaml.safe_load((elsewhere / "run" / "config.yaml").read_text())["backend"]["name"] == "mpi"  # the default
