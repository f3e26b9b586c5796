"""A run folder is written only by its own run (experiments.train).

- Before Hydra starts, `prepare` fixes the folder a single run writes (`hydra.run.dir` as the config composes it) on
  the command line, so Hydra makes that one, and makes it here: a folder that cannot be made is one line, and the
  folders made are remembered so that a refused run removes them again (`remove_made`). Hydra writes nothing into
  the folder itself: `hydra.output_subdir` is null (conf/config.yaml), and its log file is opened at the first record.
- `claim` locks the folder for this run (flock on the folder, held until the process ends, touching no file): a
  second run into it at the same time is refused.
- `judge` refuses a new run into a folder that holds a run, a resume with another config, and a resume with no
  complete checkpoint (unless `resume=auto`), and says which checkpoint a resume continues from when newer ones
  cannot be resumed.
- Once the run is accepted, `record_hydra` writes what Hydra would have written (`.hydra/config.yaml`, `hydra.yaml`,
  `overrides.yaml`), each whole or not at all.

So a refused start or resume leaves every file of the folder as it was, byte for byte.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dpsgd import checkpoint, runfiles
from dpsgd.config import RunConfig
from experiments.validate import ConfigError, check_same_run, compose

RUN_FILES = ("metrics.jsonl", "checkpoints", "summary.json", "logs", "config.yaml")  # a folder with one holds a run
_made: list[Path] = []  # folders prepare() made, deepest first
_claimed: dict[Path, int] = {}  # folder -> the descriptor whose lock claims it (kept open until the process ends)


def prepare(argv: list[str]) -> list[str]:
    """The command line with its run folder fixed (see the module), the folder made. RunFileError (one line) when it
    cannot be made. A sweep, or a command line with Hydra's own flags, is left as it is."""
    if any(a.startswith("-") for a in argv):  # -m, --cfg, --config-name, ...: Hydra's to place
        return argv
    overrides = [a for a in argv if not a.lstrip("+~").startswith("hydra.run.dir=")]
    given = [a.partition("=")[2] for a in argv if a.lstrip("+").startswith("hydra.run.dir=")]
    folder = given[-1].strip("'\"") if given else str(compose(overrides, hydra_config=True).hydra.run.dir)
    if re.search(r"[\\'\"$]", folder):  # not written back safely in Hydra's grammar: Hydra places it
        return argv
    missing = []
    for path in [Path(folder), *Path(folder).parents]:
        if path.exists():
            break
        missing.append(path)
    runfiles.make_folder(folder)
    _made.extend(missing)
    return [*overrides, f"hydra.run.dir='{folder}'"]


def check_sweep_dir(argv: list[str], resume: bool) -> None:
    """A sweep into a `hydra.sweep.dir` given on the command line that holds runs already: refused (ConfigError)
    unless its jobs resume, before Hydra rewrites the folder's multirun.yaml. (A sweep folder the config names with
    the time is new.)"""
    given = [a.partition("=")[2].strip("'\"") for a in argv if a.lstrip("+").startswith("hydra.sweep.dir=")]
    folder = Path(given[-1]) if given else None
    if folder is None or resume or not folder.is_dir():
        return
    held = sorted(job.name for job in folder.iterdir() if job.is_dir() and any((job / f).exists() for f in RUN_FILES))
    if held:
        raise ConfigError(
            f"{folder} already holds a sweep's runs ({', '.join(held[:4])}{', ...' if len(held) > 4 else ''}); pass "
            "resume=true to continue them, or choose a new hydra.sweep.dir"
        )


def remove_made() -> None:
    """The folders prepare() made, where they are still empty (a refused run leaves nothing behind)."""
    for path in _made:
        with contextlib.suppress(OSError):
            path.rmdir()


def claim(run_dir: Path) -> None:
    """This run's lock on `run_dir`; ConfigError when another run holds it now."""
    if run_dir in _claimed:
        return
    try:
        fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise runfiles.RunFileError(run_dir, exc, "open the folder") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(
            f"{run_dir} is being written by another run now; wait for it to end, or choose another hydra.run.dir"
        ) from None
    except OSError:
        pass  # a file system without locks (some network ones): the judgement below still holds
    _claimed[run_dir] = fd


def judge(run_dir: Path, run: RunConfig) -> list[str]:
    """Whether `run` may write `run_dir` (ConfigError, one line, when not), and the notes to print when it may."""
    continuing = run.resume or run.elastic  # an elastic world continues its run in its folder
    held = [f for f in RUN_FILES if (run_dir / f).exists()]
    if not continuing and held:
        raise ConfigError(
            f"{run_dir} already holds a run; pass resume=true to continue it, or choose a new hydra.run.dir "
            f"(it holds {', '.join(held)})"
        )
    saved = run_dir / "config.yaml"
    if continuing and saved.exists():
        try:
            before = OmegaConf.to_container(OmegaConf.load(saved))
        except Exception as exc:  # noqa: BLE001 - a config file that is not YAML: said in one line
            raise ConfigError(f"{saved} cannot be read ({type(exc).__name__}); it is not this app's config") from None
        check_same_run(before, run, run_dir)  # type: ignore[arg-type]
    if not run.resume or run.elastic:  # an elastic world takes the newest complete checkpoint of any size
        return []
    found = checkpoint.survey(run_dir, run.peers)
    complete = [step for step, why in found if why is None]
    if not complete:
        seen = _found(run_dir, found)
        if run.resume == "auto":
            return [f"resume=auto: {run_dir} holds no complete checkpoint ({seen}); starting a new run"]
        raise ConfigError(
            f"resume=true, but {run_dir} holds no complete checkpoint to resume ({seen}); pass resume=auto to start a "
            "new run when there is none, or give the run's own folder as hydra.run.dir"
        )
    skipped = [(step, why) for step, why in found if step is not None and why is not None and step > complete[0]]
    if not skipped:
        return []
    said = "; ".join(f"step {step}: {why}" for step, why in skipped[:2]) + ("; ..." if len(skipped) > 2 else "")
    steps = "checkpoint" if len(skipped) == 1 else "checkpoints"
    return [f"the newest {steps} cannot be resumed ({said}); resuming from step {complete[0]}"]


def _found(run_dir: Path, found: list) -> str:
    """What the folder holds instead of a complete checkpoint, in a few words."""
    if not (run_dir / "checkpoints").is_dir():
        return "no checkpoints/ folder: was checkpoint.every set?"
    if not found:
        return "checkpoints/ is empty"
    said = "; ".join(f"step {step}: {why}" if step is not None else why for step, why in found[:2])
    return f"{said}{'; ...' if len(found) > 2 else ''}"


def record_hydra(run_dir: Path, cfg: DictConfig) -> None:
    """Hydra's record of the run in RUN/.hydra (the composed config, Hydra's own, the overrides), as Hydra writes it
    when `hydra.output_subdir` is set, each file whole or not at all (RunFileError)."""
    from hydra.core.hydra_config import HydraConfig

    hydra = HydraConfig.get()
    folder = run_dir / ".hydra"
    made = not folder.exists()
    written: list[Path] = []
    try:
        runfiles.make_folder(folder)
        for name, node in (
            ("config.yaml", cfg),
            ("hydra.yaml", OmegaConf.create({"hydra": hydra})),
            ("overrides.yaml", hydra.overrides.task),
        ):
            runfiles.write_atomic(folder / name, OmegaConf.to_yaml(node).encode())
            written.append(folder / name)
    except OSError:
        if made:  # all of the record or none of it: a run that could not start leaves no trace
            for path in written:
                with contextlib.suppress(OSError):
                    path.unlink()
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
