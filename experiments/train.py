"""One experiment: `python -m experiments.train [overrides]` (Hydra; `-m` sweeps).

Without a launcher, this process is the driver: it validates the config, writes it resolved to
the run folder, and starts the peers as the backend's record says (dpsgd.backends: threads for
local, `mpiexec -n peers` for mpi, `peers` processes for torch, one simulation for fleet). Under a
user's mpiexec/srun or torchrun, every rank runs this app and joins the launcher's world; the ranks
agree on one output folder before Hydra starts. With `elastic=true` a world that loses peers re-forms
(dpsgd.elastic): torchrun's elastic agent restarts it, or this driver relaunches the survivors.
"""

from __future__ import annotations

if __name__ == "__main__":  # SIGINT/SIGTERM while the imports below take seconds: the same one line as later
    import os as _os
    import signal as _signal

    def _interrupted_early(signum, frame):
        name = _signal.Signals(signum).name
        _os.write(2, f"error: interrupted by {name} before the run started; nothing ran\n".encode())
        _os._exit(128 + signum)

    for _sig in (_signal.SIGINT, _signal.SIGTERM):
        _signal.signal(_sig, _interrupted_early)

import contextlib  # noqa: E402 - after the signal handling above
import math
import os
import shlex
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from dpsgd import backends, calibration, runfiles
from dpsgd.backends import Backend, Interrupted, exit_on_signals, stop_on_signals
from dpsgd.config import FaultsConfig, RunConfig, parse
from dpsgd.divergence import Diverged
from experiments import captions, folders, overrides
from experiments.table import format_table
from experiments.validate import CONF_DIR, ConfigError, check_group_overrides, validate


def fail(message: str, code: int = 2):
    """One line on stderr, and the exit `code`. The folders this invocation made for a run that never started are
    removed where they are still empty (experiments.folders), so nothing that looks like a result is left behind; a
    folder holding files is never touched."""
    folders.remove_made()
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def agree_on_run_dir(launcher: Backend) -> None:
    """All ranks of a launched world must write to one folder: rank 0's timestamp is sent to all."""
    if "DPSGD_RUN_DIR" in os.environ:
        return
    from dpsgd.comm import PeerTimeoutError

    timeout_s = _startup_timeout(sys.argv[1:])
    stamp = time.strftime("outputs/%Y-%m-%d/%H-%M-%S").encode().ljust(64)
    try:
        stamp = launcher.share(stamp, timeout_s)
    except PeerTimeoutError:
        fail(
            f"rank {launcher.world()[0]}: start-up timed out after {timeout_s:g} s waiting for rank 0 "
            f"to name the run folder; a peer did not start (raise comm.timeout_s if start-up is just slow)",
            code=1,
        )
    os.environ["DPSGD_RUN_DIR"] = stamp.decode().strip()


def _startup_timeout(argv: list[str]) -> float:
    """comm.timeout_s before Hydra has composed the config: the command line's, else the default."""
    from dpsgd.comm import DEFAULT_TIMEOUT_S

    for arg in argv:
        if arg.startswith("comm.timeout_s="):
            with contextlib.suppress(ValueError):
                value = float(arg.split("=", 1)[1])
                if value > 0:  # else the config check says what is wrong
                    return value
    return DEFAULT_TIMEOUT_S


def launched() -> Backend | None:
    """The launcher that made this process a rank (dpsgd.backends.launched), the command line's backend= first."""
    asked = [a.split("=", 1)[1] for a in sys.argv[1:] if a.lstrip("+").startswith("backend=")]
    return backends.launched(asked[-1] if asked else None)


def _elastic(argv: list[str]) -> bool:
    return any(a.lower() in ("elastic=true", "++elastic=true", "+elastic=true") for a in argv)


def check_elastic_launcher(launcher: Backend, argv: list[str]) -> None:
    """What an elastic run needs of the user's launcher, said before any rank waits for another."""
    if "DPSGD_RUN_DIR" not in os.environ and not any(a.startswith("hydra.run.dir=") for a in argv):
        fail(
            "elastic=true under a launcher needs a fixed run folder, which every re-formed world continues: "
            "pass hydra.run.dir=DIR"
        )
    problem = launcher.elastic_problem()
    if problem:
        fail(problem)


def fit_batch_size(run: RunConfig) -> tuple[RunConfig, str | None]:
    """Many peers on a small dataset: the batch becomes a peer's whole share (dpsgd.build.fitted_batch_size), with
    the note that says so. A config that cannot load its data is left for validate() to name."""
    from dpsgd.build import fitted_batch_size

    try:
        batch_size, note = fitted_batch_size(run)
    except Exception:  # noqa: BLE001 - reported by validate() in one line
        return run, None
    return run.replace(batch_size=batch_size), note


def resume_line(run: RunConfig, run_dir: Path, launcher: Backend | None) -> str:
    """The one line an interrupted run ends with: what stopped it, what is kept, the command that resumes it."""
    from dpsgd import checkpoint

    steps = checkpoint.complete_steps(run_dir, None if run.elastic else run.peers, verify=False)
    kept = f"the newest complete checkpoint is step {steps[-1]}" if steps else "no complete checkpoint yet"
    args = [a for a in sys.argv[1:] if not a.startswith(("resume=", "hydra.run.dir=", "hydra.job.name="))]
    # with no checkpoint to continue from, resume=auto starts the run again in its folder
    again = ["resume=true" if steps else "resume=auto", f"hydra.run.dir={run_dir}"]
    if launcher is not None and run.elastic:  # torchrun stops the workers when its world re-forms
        return f"stopped by {{signal}}; {kept}; an elastic world continues from it when the launcher re-forms it"
    if launcher is not None:  # the user's launcher command is not ours to repeat
        return f"interrupted by {{signal}}; {kept}; resume with your launcher command plus: {shlex.join(again)}"
    program = ["dpsgd-train"] if Path(sys.argv[0]).name == "dpsgd-train" else ["python", "-m", "experiments.train"]
    command = shlex.join([*program, *args, *again])
    return f"interrupted by {{signal}}; {kept}; resume with: {command}"


def run(config: RunConfig, run_dir: Path, launcher: Backend | None) -> dict | None:
    """Run the experiment; return the summary where this process has it (driver or rank 0)."""
    import torch

    torch.set_num_threads(1)
    if launcher is not None:
        exit_on_signals((lambda: resume_line(config, run_dir, launcher)) if launcher.world()[0] == 0 else None)
        return backends.join(config, run_dir, save_config=True)
    config.save(run_dir / "config.yaml")
    try:
        with stop_on_signals(lambda: resume_line(config, run_dir, launcher)):
            if config.elastic:
                return relaunching(config, run_dir)
            return backends.get(config.backend.name).start(config, run_dir, PEER_ARGV + [str(run_dir)])
    except (backends.RunFailed, Diverged) as exc:  # Diverged: a run in this process (the fleet)
        fail(str(exc), code=1)
    except Interrupted as exc:  # every peer is stopped by now (dpsgd.backends.launch) or dies with this process (local)
        line = resume_line(config, run_dir, launcher).format(signal=signal_name(exc.signum))
        print(f"error: {line}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(128 + exc.signum)  # local peers are threads still running: the interpreter's teardown aborts


PEER_ARGV = ["-m", "experiments.peer"]
CHECKED = False  # start() validated the run (check_run) before Hydra started


def relaunching(run: RunConfig, run_dir: Path) -> dict:
    """elastic=true with peers the app starts: when a world fails, relaunch it from the newest complete
    checkpoint, without the peer that died (with every peer when an error, not a death, ended it), at most
    `max_restarts` times; each world continues as dpsgd.elastic says. Injected faults act in the first
    world only (the relaunched config has none), and each failed world's logs move to logs/world{k}/."""
    from dpsgd import checkpoint, elastic

    backend, n = backends.get(run.backend.name), run.peers
    for restart in range(run.max_restarts + 1):
        try:
            return backend.start(run, run_dir, PEER_ARGV + [str(run_dir)], peers=n)
        except backends.RunFailed as exc:
            found = checkpoint.newest(run_dir)
            survivors = n - (exc.died is not None)
            if restart == run.max_restarts or found is None or survivors < 1:
                why = (
                    "no complete checkpoint yet"
                    if found is None
                    else "no peer left"
                    if survivors < 1
                    else f"max_restarts={restart} reached"
                )
                raise backends.RunFailed(f"{exc} (elastic: not relaunched, {why})") from None
            try:
                elastic.check_world(run.topology, survivors)
            except ValueError as problem:
                raise backends.RunFailed(f"{exc}; {problem}") from None
            print(
                f"note: {exc}; elastic: relaunching {survivors} peers from the checkpoint of step {found[0]} "
                f"(restart {restart + 1} of max_restarts={run.max_restarts})",
                file=sys.stderr,
                flush=True,
            )
            old = run_dir / "logs" / f"world{restart}"
            old.mkdir()
            for f in (run_dir / "logs").iterdir():
                if f.is_file():
                    f.rename(old / f.name)
            if run.faults != FaultsConfig():
                run = run.replace(faults=FaultsConfig())
                run.save(run_dir / "config.yaml")
            n = survivors
    raise AssertionError("unreachable: the last restart returns or raises")


def signal_name(signum: int) -> str:
    import signal

    return signal.Signals(signum).name


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def hydra_main(cfg: DictConfig) -> float | None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    launcher = launched()
    rank, world_size = launcher.world() if launcher is not None else (0, None)
    try:
        config, note = fit_batch_size(parse(cfg))  # parsed once, here
        config = calibration.resolved(config)  # the emulated clock's compute: the workload's, measured once
        if launcher is not None and config.backend.name != launcher.name:
            # srun's tasks are a world for mpi and torch alike: the config's backend, where it sees one
            launcher = backends.launched(config.backend.name) or launcher
            rank, world_size = launcher.world() or (rank, world_size)
        if launcher is not None and config.backend.name != launcher.name:
            raise ConfigError(
                f"started by a {launcher.name} launcher but backend={config.backend.name}; pass backend={launcher.name}"
            )
        if note and rank == 0:
            print(f"note: {note}", file=sys.stderr, flush=True)
        if not CHECKED:  # start() checked a plain run before Hydra made its folder
            validate(config, world_size, launched=launcher is not None)
        # the run folder: judged by the driver, or by rank 0 alone (another rank could look after rank 0 has begun
        # writing; if rank 0 refuses, the launcher stops the others), with no file of it written before
        if rank == 0:
            runfiles.make_folder(run_dir)  # a sweep's job folder (a single run's: made before Hydra started)
            folders.claim(run_dir)
            for line in folders.judge(run_dir, config):
                print(f"note: {line}", file=sys.stderr, flush=True)
            folders.record_hydra(run_dir, cfg)
    except ConfigError as exc:
        fail(str(exc))
    except OSError as exc:  # the folder cannot be written: a full disk, a read-only file system, no permission
        fail(runfiles.describe(exc), code=1)
    open_log(f"rank {rank} of {world_size or config.peers}: a run of {config.algorithm.name} in {run_dir}")
    try:
        summary = run(config, run_dir, launcher)
    except OSError as exc:  # the driver's own files (config.yaml, logs/): one line, as a peer's are
        fail(runfiles.describe(exc), code=1)
    if summary is None:
        return None
    described = {"config": {"algorithm._target_": config.algorithm.target}, "summary": summary}
    shown = summary if captions.uses_topology(described) else {**summary, "topology": "unused"}
    print(format_table([shown]), flush=True)  # as the report shows an algorithm's unread topology
    print(f"outputs: {run_dir}", flush=True)
    if summary.get("status") in ("diverged", "not_learning"):  # on_divergence=mark: the run went on; say so once
        first = summary["diverged"]
        who = "the run was not learning" if first["peer"] is None else f"peer {first['peer']} diverged"
        print(f"note: {who} at step {first['step']}: {first['what']}", file=sys.stderr)
        return math.nan  # Optuna: a failed trial
    return summary["test_accuracy"]


def open_log(line: str) -> None:
    """Hydra's log file of this process (RUN/train.log, or train_rank{r}.log under a launcher), opened with its first
    line once the run is accepted: Hydra opens it lazily (conf/config.yaml), so a refused run never makes one. A log
    that cannot be written (a full disk) is dropped, empty file and all: the run's own files say what failed."""
    import logging

    root = logging.getLogger()
    record = logging.LogRecord("experiments.train", logging.INFO, __file__, 0, line, None, None)
    for handler in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:
        try:
            if handler.stream is None:
                handler.stream = handler._open()
            handler.stream.write(handler.format(record) + handler.terminator)
            handler.stream.flush()
        except OSError:
            root.removeHandler(handler)
            with contextlib.suppress(OSError):
                handler.close()  # flushes again, and fails again
            with contextlib.suppress(OSError):
                if os.path.getsize(handler.baseFilename) == 0:
                    os.unlink(handler.baseFilename)


def expand_seeds(argv: list[str]) -> list[str]:
    """`seeds=N` is a sweep over seeds 0 .. N-1: Hydra's `seed=range(N)`, with -m added where it is missing."""
    given = [a for a in argv if a.startswith("seeds=")]
    if not given:
        return argv
    text = given[-1].split("=", 1)[1]
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"seeds must be a positive whole number of seeds (seeds=3 runs seeds 0, 1, 2), got {text!r}")
    if len(given) > 1 or any(a.startswith(("seed=", "+seed=")) for a in argv):
        raise ConfigError("give the seeds once: seeds=N (seeds 0 .. N-1) or seed=A,B,C with -m, not both")
    argv = [f"seed=range({int(text)})" if a == given[0] else a for a in argv]
    return argv if "-m" in argv or "--multirun" in argv else ["-m", *argv]


def check_run(argv: list[str]) -> bool:
    """The run the command line describes, checked as hydra_main checks it (validate), before Hydra makes its folder:
    a mistake ends in one line, exit 2, and leaves no folder behind. False where the command line is not for the
    basic composition to list (Hydra's own flags, another primary config): hydra_main checks it then."""
    try:
        jobs = overrides.sweep_jobs(argv)
    except Exception:  # noqa: BLE001 - a composition Hydra refuses: left to Hydra's own run to report
        return False
    if jobs and len(jobs) > 1:  # a comma list without -m: Hydra would end in its traceback
        listed = [a for a in argv if "," in a.partition("=")[2] and not a.partition("=")[2].startswith("[")]
        fail(
            f"{' '.join(listed) or 'the command line'} describes {len(jobs)} runs but -m is not given: add -m to "
            "run each, or write a list value as key=[a,b] and a string with a comma as key='a,b'"
        )
    if not jobs or len(jobs) != 1:
        return False
    try:
        config, _ = fit_batch_size(calibration.resolved(parse(jobs[0][1])))
        validate(config)
    except (ConfigError, ValueError) as exc:
        fail(str(exc))
    return True


def check_sweep(argv: list[str]) -> None:
    """Every job of a sweep checked as its run would check it, before the first starts: a mistake in the last
    combination ends the sweep in one line with nothing run, not hours in."""
    try:
        jobs = overrides.sweep_jobs(argv)
    except Exception as exc:  # noqa: BLE001 - a composition Hydra refuses: left to Hydra's own run to report
        print(f"note: the sweep's jobs were not checked in advance ({type(exc).__name__})", file=sys.stderr)
        return
    runs = []
    for i, (job, cfg) in enumerate(jobs or []):
        try:
            runs.append(validate(fit_batch_size(parse(cfg))[0]))
        except ConfigError as exc:
            fail(f"sweep job {i} of {len(jobs)} ({' '.join(job)}): {exc}; nothing was run")
    try:
        folders.check_sweep_dir(argv, bool(runs) and all(r.resume for r in runs))
    except ConfigError as exc:
        fail(f"{exc}; nothing was run")
    inner = sorted({inner_optimizer(r) for r in runs})
    if len(inner) > 1:
        print(
            f"note: the sweep's runs step {len(inner)} different inner optimizers ({'; '.join(inner)}): it compares "
            "optimizers as well as algorithms; give one to all with optimizer=NAME (and optimizer.lr=...) to compare "
            "the algorithms alone",
            file=sys.stderr,
            flush=True,
        )


def inner_optimizer(run: RunConfig) -> str:
    """'sgd lr 0.1 momentum 0.9': the base optimizer a run steps, with its options."""
    options = " ".join(f"{k} {v}" for k, v in sorted(run.optimizer.options.items()) if v is not None)
    return f"{run.optimizer.target or run.optimizer.name} {options}".strip()


def main() -> None:
    launcher = None
    try:
        # a signal before the run's own handling begins ends the same way: one line, the exit code a shell reports
        with stop_on_signals(lambda: "interrupted by {signal} before the run started; nothing ran"):
            launcher = launched()
            start(launcher)
    except Interrupted as exc:
        folders.remove_made()
        if launcher is None or launcher.world()[0] == 0:  # one line for a world, from rank 0
            name = signal_name(exc.signum)
            print(f"error: interrupted by {name} before the run started; nothing ran", file=sys.stderr)
        sys.stdout.flush()
        os._exit(128 + exc.signum)
    if launcher is not None:
        launcher.exit()


def start(launcher: Backend | None) -> None:
    """Check the command line, fix the run folder, and hand the run to Hydra (hydra_main)."""
    try:
        argv = overrides.check(expand_seeds(sys.argv[1:]))  # Hydra's own errors, as one line
        check_group_overrides(argv)
    except ConfigError as exc:
        fail(str(exc))
    if launcher is None and ("-m" in argv or "--multirun" in argv):
        check_sweep(argv)
    elif launcher is None:
        global CHECKED  # noqa: PLW0603 - hydra_main then skips the peer-0 build it would repeat
        CHECKED = check_run(argv)
    if launcher is not None:
        if "-m" in argv or "--multirun" in argv:
            fail(
                f"a sweep (-m) cannot run inside a {launcher.name} launcher; run the sweep without it "
                f"and the app starts the peers of each run itself"
            )
        if _elastic(argv):
            check_elastic_launcher(launcher, argv)
        agree_on_run_dir(launcher)
        # one log file per rank (rank 0's .hydra/ is written once the run is accepted: experiments.folders)
        argv += [f"hydra.job.name=train_rank{launcher.world()[0]}"]
    try:
        argv = folders.prepare(argv)
    except OSError as exc:  # the folder cannot be made: a read-only file system, no permission, a full disk
        fail(runfiles.describe(exc), code=1)
    sys.argv[1:] = argv  # Hydra reads the command line itself
    hydra_main()


if __name__ == "__main__":
    main()
