"""Start peer processes on this machine, and say in one line why a run of them failed.

How it works: docs/guide/internals.md#launch.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

from dpsgd.supervisor import Supervisor

ERROR_FILE = "rank{rank}.error"  # a peer that fails writes its one-line error here (experiments.peer)
GRACE_S = 3.0  # a peer sent SIGTERM is killed (SIGKILL) after this long
# the process groups of the peers running now (dpsgd.backends.interrupt kills them on a 2nd signal)
LIVE: set[int] = set()
_PR_SET_PDEATHSIG = 1


def peer_env(extra: dict | None = None) -> dict:
    """The environment of the peers the toolkit spawns: this process's, with one OpenMP thread, MPICH on shared
    memory only, unbuffered output and glibc keeping freed large buffers for reuse (each where not set already),
    then `extra` (a None value removes that variable)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # n peers on few cores: OpenMP spinning costs 6x
    env.setdefault("UCX_TLS", "self,sm")  # MPICH: shared memory only, no listeners on the network
    env.setdefault("PYTHONUNBUFFERED", "1")
    # glibc hands a freed buffer over 32 MB back to the kernel and the next one page-faults in again
    # (4x a 44 MB exchange on this VM): keep freed memory for reuse, as jemalloc / tcmalloc do
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(2**34))
    env.setdefault("MALLOC_TRIM_THRESHOLD_", str(2**34))
    env.update(extra or {})
    return {key: value for key, value in env.items() if value is not None}  # None in `extra` removes a variable


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a rendezvous or a gloo store started next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the driver dies (even by SIGKILL), so no peer outlives it."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    for p in procs:  # the group's other members (mpiexec's proxies and ranks) go with it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        LIVE.discard(p.pid)


def stop_live(signum: int = signal.SIGTERM) -> None:
    """`signum` to every peer group running now; `run_processes` sees them end and stops the rest."""
    for group in list(LIVE):
        with contextlib.suppress(OSError):
            os.killpg(group, signum)


def run_processes(
    commands: list[tuple[list[str], dict | None, Path | None]],
    timeout_s: float | None,
    codes_out: list | None = None,
    stdout_to_log: bool = False,
) -> int:
    """Start each (command line, extra environment, log file) in its own session, its stderr (and with
    `stdout_to_log` its stdout) to its log, and wait for all; the first failure (or the deadline) stops
    the rest. Returns the exit code; `codes_out` receives each process's exit code as it was when the
    first failure was seen."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    procs: list[subprocess.Popen] = []
    with contextlib.ExitStack() as logs:
        try:
            for cmd, env, log in commands:
                out = logs.enter_context(log.open("w")) if log is not None else None
                stdout = out if stdout_to_log else None
                procs.append(
                    subprocess.Popen(
                        cmd,
                        env=peer_env(env),
                        start_new_session=True,
                        stdout=stdout,
                        stderr=out,
                        preexec_fn=_die_with_parent,  # noqa: PLW1509 - prctl only, no locks taken
                    )
                )
                LIVE.add(procs[-1].pid)
            while True:
                codes = [p.poll() for p in procs]
                if codes_out is not None:
                    codes_out[:] = codes
                if all(c == 0 for c in codes):
                    LIVE.difference_update(p.pid for p in procs)
                    return 0
                failed = [c for c in codes if c not in (None, 0)]
                if failed or (deadline is not None and time.monotonic() > deadline):
                    _stop(procs)
                    return failed[0] if failed else 124
                time.sleep(0.05)
        except BaseException:
            _stop(procs)
            raise


def failure_cause(
    log_dir: Path, sup: Supervisor, code: int, n: int, codes: list | None = None, hosts: list[str] | None = None
) -> tuple[str, int | None]:
    """The one line that explains a failed run, and the rank whose death caused it (None: a peer's error
    did): the error of the peer that failed first, or, when the first peer to end died without a word
    (a signal, the OOM killer), its rank and last step. With `hosts` (each rank's host, for a run on
    several hosts), a silent death names every peer of that host that died without a word too: a lost
    host takes all its peers."""
    errors = dict(getattr(sup, "errors", {}))  # (when, line) each peer sent the driver as it failed
    for r in range(n):
        path = log_dir / ERROR_FILE.format(rank=r)
        if r not in errors and path.exists():
            errors[r] = (path.stat().st_mtime, path.read_text().strip())
    silent = min(((t, r) for r, t in dict(sup.ended).items() if r not in errors), default=None)  # (when, rank)
    signalled = [r for r, c in enumerate(codes or []) if c is not None and c < 0]  # torch: not by us, yet
    if signalled:
        silent = (sup.ended.get(signalled[0], 0.0), signalled[0])
    first_error = min(errors.values()) if errors else None
    # a silent death is the cause when it came first, or when the first error says a peer failed (a
    # survivor may notice the death before the driver's thread does); a peer that timed out is the
    # cause of the silent deaths that follow (the launcher kills the others, the hung one included)
    caused = first_error is not None and ": PeerFailedError: " in first_error[1]
    if silent is not None and (first_error is None or caused or signalled or silent[0] <= first_error[0]):
        rank = silent[1]
        reason = _exit_reason(log_dir, codes[rank] if codes and codes[rank] else code, rank)
        if hosts is not None:
            dead = (set(sup.ended) | set(signalled)) - set(errors)
            lost = sorted(r for r in dead if hosts[r] == hosts[rank])
            if len(lost) > 1:
                where = "every peer on" if len(lost) == hosts.count(hosts[rank]) else "on"
                steps = ", ".join(str(sup.steps[r]) if r in sup.steps else "none" for r in lost)
                return (
                    f"peers {', '.join(map(str, lost))} ({where} host {hosts[rank]}) died at steps {steps} without "
                    f"an error message ({reason}): the host or its link was lost"
                ), rank
        step = sup.steps.get(rank)
        last = _last_line(log_dir / f"rank{rank}.log")
        return (
            f"peer {rank} died {f'at step {step} ' if step else 'before its first step '}without an error "
            f"message ({reason}){'; its log ends: ' + last if last else ''}"
        ), rank
    if first_error is not None:
        return first_error[1], None
    return f"the peers failed without an error message ({_exit_reason(log_dir, code)})", None


def _last_line(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def _exit_reason(log_dir: Path, code: int, rank: int | None = None) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}" if -code in signal.valid_signals() else f"signal {-code}"
    launcher = log_dir / "launcher.log"
    text = launcher.read_text(errors="replace") if launcher.exists() else ""
    for line in text.splitlines():  # MPICH: "YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)"
        if "EXIT STRING:" in line:
            return line.split("EXIT STRING:", 1)[1].strip()
    told = forker_exit(text, rank)  # mpiexec.gforker (dpsgd.backends.mpi): "[0]2:Return code = 0, signaled with Killed"
    if told:
        return told
    if launcher.exists():  # mpiexec did not say how the rank ended (another rank's exit reached it first)
        return f"its process ended; mpiexec exited with code {code}"
    return f"exit code {code}"


# gforker's account of a rank it reaped ("[0]2:Return code = 0, signaled with Killed"): world, rank, code, signal
_FORKER_EXIT = re.compile(r"\[\d+\](\d+):Return code = (-?\d+)(?:, signaled with (.+))?$")


def forker_exit(text: str, rank: int | None = None) -> str | None:
    """How MPICH's mpiexec.gforker says in its output `text` that rank `rank` (None: the first it names) ended
    abnormally, as hydra's mpiexec says it ('Killed (signal 9)', 'exit code 3'); None where it says nothing."""
    numbers = {signal.strsignal(s): int(s) for s in signal.valid_signals() if signal.strsignal(s)}
    for line in text.splitlines():
        m = _FORKER_EXIT.match(line.strip())
        if m is None or (rank is not None and int(m.group(1)) != rank):
            continue
        name = m.group(3)
        if name:
            return f"{name} (signal {numbers[name]})" if name in numbers else f"signal {name}"
        if int(m.group(2)):
            return f"exit code {m.group(2)}"
    return None
