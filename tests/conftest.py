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

Parallel runs: `make test` runs the suite in 2 pytest-xdist workers (`-n 2`). The scheduler here
(`pytest_xdist_make_scheduler`) keeps on one worker, one after the other, the tests that share a module-scoped
fixture and those that make test hosts (`xdist_scope`). A test never uses a fixed port, path or namespace name.

Measuring: `--cpu-times FILE` writes each test's wall and CPU seconds (its own and its processes') to FILE.
"""

from __future__ import annotations

import ast
import functools
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

    from dpsgd.config import register

    register()  # the typed schema conf/config.yaml composes onto

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


# --- parallel runs (pytest-xdist): which tests must share one worker -----------------------------------


@functools.cache
def _shared_by(path: str) -> tuple[bool, frozenset]:
    """For the test file `path`: whether it makes test hosts (imports tools/testhosts.py), and the names of its
    functions that use one of its module- or class-scoped fixtures (directly or through its other fixtures)."""
    try:
        tree = ast.parse((ROOT / path).read_text())
    except (OSError, SyntaxError):
        return False, frozenset()
    hosts = any(
        isinstance(node, (ast.Import, ast.ImportFrom))
        and "testhosts" in [getattr(node, "module", None), *(a.name for a in node.names)]
        for node in ast.walk(tree)
    )
    functions = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)]
    shared = {
        f.name
        for f in functions
        for d in f.decorator_list
        if isinstance(d, ast.Call)
        and any(k.arg == "scope" and getattr(k.value, "value", None) in ("module", "class") for k in d.keywords)
    }
    users: set = set()
    while True:  # a function that takes a shared fixture, or a fixture that does, takes part in the sharing
        more = {f.name for f in functions if {a.arg for a in f.args.args} & (shared | users)} - users
        if not more:
            return hosts, frozenset(users)
        users |= more


def xdist_scope(nodeid: str) -> str:
    """The work unit of a test in `make test`'s parallel run: tests with the same unit run on one worker, one
    after the other. A test that makes test hosts: "testhosts" (rate-capped links whose timings a second set
    would disturb); one that uses a module-scoped fixture of its file: the file (the fixture then runs once,
    not once per worker); any other test: its own."""
    path, _, rest = nodeid.partition("::")
    hosts, users = _shared_by(path)
    if hosts:
        return "testhosts"
    if rest.split("::")[-1].split("[")[0] in users:
        return path
    return nodeid


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`-n N` (--dist load): xdist's scope scheduler with the work units of `xdist_scope`."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Shared(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return Shared(config, log)


def pytest_collection_modifyitems(config, items):
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


_LEFT_BY_WORKERS: list[str] = []  # under xdist: the namespaces each worker found left behind (and removed)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    _LEFT_BY_WORKERS.extend(getattr(node, "workeroutput", {}).get("testhosts_left", []))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    left = list(_LEFT_BY_WORKERS)
    if os.geteuid() == 0:
        sys.path.insert(0, str(ROOT / "tools"))
        import testhosts

        # only this process's sets: another session on the machine (a benchmark, a second pytest) keeps its own
        mine = testhosts.made_here()
        here = testhosts.leftovers(mine) if mine and testhosts.unavailable() is None else []
        if here:
            testhosts.down(mine)  # removed, and the session fails so that the leak is fixed where it happened
        left += here
    if hasattr(session.config, "workeroutput"):  # an xdist worker: its controller reports them (above)
        session.config.workeroutput["testhosts_left"] = left
    elif left:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print(f"\nERROR: test host namespaces were left behind by a test: {left} (removed now)")
