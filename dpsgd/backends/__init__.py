"""Backends as records: everything the toolkit asks of a backend, in one `Backend` per module; the rest
of the code asks these, never a backend's name. A new backend is one module here that calls
`register(...)` and one config file, conf/backend/NAME.yaml."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from dpsgd.comm import Communicator
from dpsgd.hosts import placement
from dpsgd.launch import failure_cause, stop_live
from dpsgd.supervisor import ENV, Supervisor
from dpsgd.watchdog import Watchdog

_REGISTRY: dict[str, Backend] = {}


class RunFailed(RuntimeError):
    """The peers of a run failed; the message is the one line for the user (who failed, why, where the logs are).
    `died`: the rank whose death (a signal, no error message) caused it, else None."""

    def __init__(self, line: str, died: int | None = None):
        super().__init__(line)
        self.died = died


class Backend:
    """One backend. Subclasses set `name` and override what differs from these defaults."""

    name: str = "?"
    threads = False  # peers are threads of this process: a killed one raises, messages can be dropped (faults)
    processes = False  # peers are processes the driver spawns (`spawn`), which faults can kill or hang
    checkpoints = True  # runs keep checkpoints and resume from them
    compresses = True  # its peers' messages can be compressed (`compression=`)

    @property
    def real_peers(self) -> bool:
        """Peers that faults can kill, hang or delay (a simulation has none)."""
        return self.threads or self.processes

    def connect(self, timeout_s: float, **options) -> Communicator:
        """This process's communicator (`dpsgd.comm.init`)."""
        raise NotImplementedError

    def options(self, cfg: dict) -> dict:
        """The `connect` options a run's config sets."""
        return {}

    def world(self) -> tuple[int, int] | None:
        """(rank, size) when a launcher made this process one rank of its world, else None."""
        return None

    def share(self, data: bytes, timeout_s: float) -> bytes:
        """Rank 0's `data` in every rank of a launched world, before any communicator exists."""
        raise NotImplementedError

    def exit(self) -> None:
        """End a launched rank whose results are written (default: the interpreter's own exit)."""

    def missing(self) -> str | None:
        """Why the driver cannot start this backend's peers here (one line, with the fix), or None."""
        return None

    def spawn(
        self,
        n: int,
        argv: list[str],
        timeout_s: float | None = None,
        env: dict | None = None,
        log_dir: Path | None = None,
        codes_out: list | None = None,
    ) -> int:
        """Run `argv` (a python command line without the interpreter) on n processes of one world on this
        machine, rank r's stderr to log_dir/rank{r}.log; the exit code (the first failure stops all)."""
        valid = ", ".join(n for n in names() if get(n).processes)
        raise ValueError(f"cannot spawn processes for backend {self.name!r}; valid: {valid}")

    def spawn_on_hosts(
        self,
        launcher: dict,
        n: int,
        argv: list[str],
        timeout_s: float | None = None,
        env: dict | None = None,
        log_dir: Path | None = None,
        codes_out: list | None = None,
    ) -> int:
        """`spawn`, the n ranks on `launcher["hosts"]` (dpsgd.hosts: placement, runner, environment)."""
        valid = " or ".join(f"backend={n}" for n in names() if get(n).processes)
        raise ValueError(f"launcher.hosts needs {valid} (processes on hosts), got backend={self.name}")

    def start(self, cfg: dict, run_dir: Path, argv: list[str], peers: int | None = None) -> dict:
        """From the driver, run every peer of the experiment `cfg` (written to run_dir/config.yaml) and
        return its summary; `argv` is one peer process's command line; `peers`: how many (default
        cfg["peers"]; an elastic run's relaunch has fewer). Raises RunFailed: one line naming the peer
        that failed first (followed by dpsgd.supervisor), the step and why."""
        n = int(cfg["peers"]) if peers is None else peers
        logs = run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        codes: list = []  # each process's exit code when the first failure was seen, where `spawn` knows them
        with Supervisor() as sup:
            progress = "1" if sys.stdout.isatty() else "0"  # decided here: the peers' stdout is a pipe
            env = {"DPSGD_PROGRESS": progress, ENV: sup.path}
            # the watchdog stops the peers when none progresses (every one hung): spawn then returns
            with Watchdog(
                cfg["comm"]["timeout_s"], lambda: sup.last_progress, lambda _: stop_live(), sup.steps.copy
            ) as dog:
                code = self._spawn_here_or_on_hosts(cfg, n, argv, env, logs, codes)
            if dog.line is not None:
                raise RunFailed(f"{dog.line}; all peers stopped after {time.monotonic() - start:.1f} s (logs: {logs})")
            if code != 0:
                settle = time.monotonic() + 1.0  # the supervisor's thread reads closings: let it see the last
                while len(sup.ended) + len(sup.finished) < len(sup.steps) and time.monotonic() < settle:
                    time.sleep(0.01)
                hosts = (cfg.get("launcher") or {}).get("hosts")
                on = placement(list(hosts), n) if hosts else None
                failure, died = failure_cause(logs, sup, code, n, codes, on)
                raise RunFailed(
                    f"{failure}; all peers stopped after {time.monotonic() - start:.1f} s (logs: {logs})", died
                )
        return json.loads((run_dir / "summary.json").read_text())

    def _spawn_here_or_on_hosts(self, cfg: dict, n: int, argv: list[str], env: dict, logs: Path, codes: list) -> int:
        """The n peers on this machine, or on `launcher.hosts` (dpsgd.hosts) when the config names hosts."""
        launcher = cfg.get("launcher") or {}
        if launcher.get("hosts"):
            return self.spawn_on_hosts(launcher, n, argv, env=env, log_dir=logs, codes_out=codes)
        return self.spawn(n, argv, env=env, log_dir=logs, codes_out=codes)


def register(backend: Backend) -> Backend:
    _REGISTRY[backend.name] = backend
    return backend


def names() -> list[str]:
    return list(_REGISTRY)


def get(name: str) -> Backend:
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; valid backends: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def launched() -> Backend | None:
    """The backend whose launcher made this process one rank of its world, or None (a plain process)."""
    return next((b for b in _REGISTRY.values() if b.world() is not None), None)


def connect(cfg: dict) -> Communicator:
    """The communicator of one peer of the run `cfg`."""
    backend = get(cfg["backend"]["name"])
    return backend.connect(float(cfg["comm"]["timeout_s"]), **backend.options(cfg))


def spawn(
    name: str,
    n: int,
    argv: list[str],
    timeout_s: float | None = None,
    env: dict | None = None,
    log_dir: Path | None = None,
) -> int:
    """`argv` on n processes of backend `name` on this machine (see Backend.spawn)."""
    return get(name).spawn(n, argv, timeout_s, env, log_dir)


def error_line(rank: int, exc: BaseException) -> str:
    """'rank 2: PeerTimeoutError: neighbor_average timed out ... at step 41; ...': one line."""
    text = (str(exc).strip().splitlines() or [""])[0]
    text = text.removeprefix(f"rank {rank}: ")
    return f"rank {rank}: {type(exc).__name__}: {text}"


from . import local, mpi, torch_dist, fleet  # noqa: E402,F401,I001 - the built-in backends register themselves
