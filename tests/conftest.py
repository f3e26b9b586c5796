"""Shared fixtures, and the `processes` marker that `make test-fast` leaves out.

Fixtures:
  app          the Hydra app run as a user runs it, in a subprocess: `app(args, run_dir)`
  hydra_config the app's composed config (conf/, `backend=local` first) as a dict, in process

The marker `processes` (registered in pyproject.toml) is on every test that starts OS processes:
mpiexec, torch.distributed ranks, the app or a benchmark in a subprocess. It is applied here, at
collection, to the tests that
  - carry it already (`@pytest.mark.processes`, or a module's `pytestmark`), or
  - use the `app` fixture (directly or through another fixture), or
  - call a process starter (`spawn(...)`, `subprocess.run(...)`, `Popen(...)`, ...) in their body or in a
    function of their module that they call (followed to any depth).
`make test-fast` (`-m "not slow and not processes"`) runs the rest: the in-process tests. To check the
split, `pytest --forbid-processes -m "not slow and not processes"` fails any selected test that starts a
process (it stops fork, posix_spawn and subprocess in the tests left unmarked).

Parallel runs: `make test` runs the suite in 2 pytest-xdist workers with `--dist loadgroup`; the tests that
share a module-scoped fixture, and those that make test hosts, get an `xdist_group` mark here so that one
worker runs each such group (see `_xdist_group`). A test never uses a fixed port, path or namespace name.

Measuring: `--cpu-times FILE` writes each test's wall and CPU seconds (its own and its processes') to FILE.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import resource
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# calls that start OS processes
_STARTERS = re.compile(
    r"\b(spawn|spawn_mpi|spawn_torch|spawn_ranks|run_peers)\(|\bsubprocess\.(run|Popen|call|check_call|check_output)\b"
    r"|\bPopen\(|\bos\.(fork|system|posix_spawnp?|exec\w*)\("
)
_CALLED = re.compile(r"\b([A-Za-z_]\w*)\(")


# --- fixtures -----------------------------------------------------------------------------------------


class App:
    """`[LAUNCHER...] python -m experiments.train ARGS [hydra.run.dir=RUN_DIR]` from the repository root,
    with the environment the toolkit gives its peers (dpsgd.backends.launch.peer_env)."""

    root = ROOT

    @staticmethod
    def command(args: list[str], run_dir: Path | None = None, launcher: list[str] | None = None) -> list[str]:
        run = [f"hydra.run.dir={run_dir}"] if run_dir is not None else []
        return [*(launcher or []), sys.executable, "-m", "experiments.train", *args, *run]

    @staticmethod
    def env() -> dict:
        from dpsgd.backends.launch import peer_env

        return peer_env()

    def __call__(
        self, args: list[str], run_dir: Path | None = None, launcher: list[str] | None = None, timeout: float = 180
    ) -> subprocess.CompletedProcess:
        """Run it to the end; stdout and stderr are captured as text."""
        cmd = self.command(args, run_dir, launcher)
        return subprocess.run(cmd, cwd=ROOT, env=self.env(), capture_output=True, text=True, timeout=timeout)

    def start(self, args: list[str], run_dir: Path, **popen) -> subprocess.Popen:
        """Start it and return at once (popen: subprocess.Popen's keyword arguments)."""
        return subprocess.Popen(self.command(args, run_dir), cwd=ROOT, env=self.env(), **popen)


@pytest.fixture(scope="session")
def app() -> App:
    """The Hydra app in a subprocess; a test that uses it is marked `processes`."""
    return App()


@pytest.fixture(scope="session")
def hydra_config():
    """`hydra_config(*overrides)`: the app's config composed from conf/ with `backend=local` and the
    overrides (later ones win), resolved to a plain dict."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    def composed(*overrides: str) -> dict:
        with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=["backend=local", *overrides])
        return OmegaConf.to_container(cfg, resolve=True)

    return composed


# --- the `processes` marker ---------------------------------------------------------------------------


def _source(fn) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def _starts_processes(fn, module: types.ModuleType | None, seen: set) -> bool:
    """Whether `fn` calls a process starter, itself or through a function of `module` it calls."""
    if fn in seen:
        return False
    seen.add(fn)
    source = _source(fn)
    if _STARTERS.search(source):
        return True
    for name in set(_CALLED.findall(source)):
        helper = getattr(module, name, None)
        if inspect.isfunction(helper) and helper.__module__ == module.__name__:
            if _starts_processes(helper, module, seen):
                return True
    return False


def pytest_addoption(parser):
    parser.addoption(
        "--forbid-processes",
        action="store_true",
        help="fail a test not marked `processes` that starts an OS process (checks the marking)",
    )
    parser.addoption(
        "--cpu-times",
        metavar="FILE",
        help="append each test's wall and CPU seconds (set-up, call and tear-down; the CPU of pytest's process and"
        " of the processes it started and reaped) to FILE as JSON lines: on a loaded machine CPU seconds are the"
        " honest measure of a test's cost, wall minus CPU of the time it waits",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = item.config.getoption("--cpu-times")
    if not path:
        yield
        return

    def cpu() -> float:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    wall, used = time.perf_counter(), cpu()
    yield
    row = {
        "test": item.nodeid,
        "wall": round(time.perf_counter() - wall, 3),
        "cpu": round(cpu() - used, 3),
        "markers": sorted({m.name for m in item.iter_markers()} & {"slow", "processes", "gpu"}),
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        "load": round(os.getloadavg()[0], 2),
    }
    with open(path, "a") as out:  # one short write per line: lines from parallel workers do not interleave
        out.write(json.dumps(row) + "\n")


def _xdist_group(item) -> str | None:
    """The worker group of a test under `make test`'s `pytest -n N --dist loadgroup` (pytest-xdist): one worker
    runs a group's tests one after the other. Groups: the tests that share a module- or class-scoped fixture of
    their module (it then runs once, not once per worker), and every test that makes test hosts (network
    namespaces with rate-capped links whose timings a second set on the same cores would disturb)."""
    module = getattr(item, "module", None)
    if module is None:
        return None
    if "testhosts" in vars(module):
        return "testhosts"
    for defs in item._fixtureinfo.name2fixturedefs.values():
        if defs and defs[-1].scope in ("module", "class") and defs[-1].baseid == item.nodeid.split("::")[0]:
            return module.__name__
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = _xdist_group(item)
        if group and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(group))
    verdicts: dict = {}
    for item in items:
        if item.get_closest_marker("processes"):
            continue
        fn = getattr(item, "function", None)
        if fn is None:
            continue
        module = getattr(item, "module", None)
        # the test's own code, and the fixtures it uses (a module-scoped one may start the peers)
        fixtures = [defs[-1].func for defs in item._fixtureinfo.name2fixturedefs.values() if defs]
        for code in [fn, *(f for f in fixtures if getattr(f, "__module__", None) == getattr(module, "__name__", ""))]:
            if code not in verdicts:
                verdicts[code] = _starts_processes(code, module, set())
        if any(verdicts[c] for c in verdicts if c is fn or c in fixtures) or "app" in item.fixturenames:
            item.add_marker(pytest.mark.processes)


@pytest.fixture(autouse=True)
def _no_processes_unless_marked(request, monkeypatch):
    """With --forbid-processes: starting a process in a test not marked `processes` is an error."""
    if not request.config.getoption("--forbid-processes") or request.node.get_closest_marker("processes"):
        yield
        return

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} starts an OS process but is not marked `processes`")

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refuse)
    import multiprocessing.util

    monkeypatch.setattr(multiprocessing.util, "spawnv_passfds", refuse)
    yield


# --- test hosts (tools/testhosts.py): none may outlive the session ----------------------------------


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.geteuid() != 0:
        return
    sys.path.insert(0, str(ROOT / "tools"))
    import testhosts

    # only this session's sets: another session on the machine (a benchmark, a second pytest) keeps its own
    mine = testhosts.made_here()
    left = testhosts.leftovers(mine) if mine and testhosts.unavailable() is None else []
    if left:
        testhosts.down(mine)  # remove them, and fail the session so the leak is fixed where it happened
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print(f"\nERROR: test host namespaces were left behind by a test: {left} (removed now)")
