"""Config checks that run before any peer starts: one line saying what is wrong and how to fix it.

The config is parsed once (dpsgd.config.parse: unknown keys, types, bounds); what the app adds here is what
depends on where the run goes: the backend's capabilities and options, the launcher's hosts, elastic runs,
checkpoints; then peer 0 is built as every peer builds itself (dpsgd.build.check_build), so each part's own
refusal is the one line.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from dpsgd import backends
from dpsgd.config import ConfigError, RunConfig, parse, register

register()  # the typed schema conf/config.yaml composes onto (`run_schema`)

_HERE = Path(__file__).resolve().parent
# the app's configs: conf/ at the repository's top level, or experiments/conf/ in an installed wheel (setup.py)
CONF_DIR = _HERE / "conf" if (_HERE / "conf").is_dir() else _HERE.parent / "conf"
GROUPS = tuple(sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir()))

__all__ = ["CONF_DIR", "GROUPS", "ConfigError", "check_group_overrides", "check_same_run", "validate"]


def compose(overrides: list[str], hydra_config: bool = False):
    """The app's config (conf/, onto the typed schema) composed with `overrides` as Hydra's compose API gives it
    (a DictConfig; with `hydra_config`, Hydra's own node too: its sweeper's params)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return hydra_compose("config", overrides=overrides, return_hydra_config=hydra_config)


def group_options(group: str, extra: list[Path] | None = None) -> list[str]:
    """The options of config group `group`: the app's, and those of the config folders in `extra`."""
    return sorted({p.stem for d in [CONF_DIR, *(extra or [])] for p in (d / group).glob("*.yaml")})


def search_path(argv: list[str]) -> list[Path] | None:
    """The user's own config folders the command line adds to Hydra's search path (`hydra.searchpath=[file://DIR,
    pkg://PACKAGE]`, `--config-dir DIR`); None when it names its own primary config (`--config-path`), whose
    search path only Hydra knows."""
    found: list[Path] = []
    for i, arg in enumerate(argv):
        if arg in ("--config-path", "-cp") or arg.startswith("--config-path="):
            return None
        if arg in ("--config-dir", "-cd") and i + 1 < len(argv):
            found.append(Path(argv[i + 1]).expanduser())
        elif arg.startswith("--config-dir="):
            found.append(Path(arg.split("=", 1)[1]).expanduser())
        m = re.fullmatch(r"\+{0,2}hydra\.searchpath=\[?(.*?)\]?", arg)
        for entry in m.group(1).split(",") if m else []:
            entry = entry.strip().strip("'\"")
            if entry.startswith("file://"):
                found.append(Path(entry[len("file://") :]).expanduser())
            elif entry.startswith("pkg://"):
                found.append(_package_dir(entry[len("pkg://") :]))
    return found


def _package_dir(name: str) -> Path:
    import importlib.util

    package, _, sub = name.replace("/", ".").partition(".")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return Path(name)  # not importable here: Hydra says so when it composes
    return Path(list(spec.submodule_search_locations)[0], *filter(None, sub.split(".")))


def check_group_overrides(argv: list[str]) -> None:
    """`algorithm=nope` on the command line: name the valid options (the app's and the user's own config folders')
    before Hydra starts."""
    extra = search_path(argv)
    if extra is None:
        return
    groups = set(GROUPS) | {p.name for d in extra if d.is_dir() for p in d.iterdir() if p.is_dir()}
    for arg in argv:
        m = re.fullmatch(r"\+?(\w+)=([\w,]+)", arg)
        if not m or m.group(1) not in groups:
            continue
        group, valid = m.group(1), group_options(m.group(1), extra)
        for choice in m.group(2).split(","):
            if choice not in valid:
                raise ConfigError(f"unknown {group} {choice!r}; valid {group} options: {', '.join(valid)}")


def validate(source: RunConfig | Mapping, world_size: int | None = None, launched: bool = False) -> RunConfig:
    """The run `source` describes, parsed (dpsgd.config.parse) and checked for everything that would otherwise fail
    inside the peers, in the driver (or, under a user's launcher, in every rank before it joins the others): the
    backend's capabilities and options, then peer 0 built as a real peer builds itself. ConfigError: one line."""
    from dpsgd import build, divergence, loggers
    from dpsgd.comm.netem import NetworkEmulator
    from dpsgd.faults import FaultPlan
    from dpsgd.options import refuse_unknown

    run = parse(source)
    peers, every = run.peers, run.checkpoint.every
    if run.elastic and world_size is not None:
        peers = world_size  # the world the launcher formed now; `peers` still sets the run's budget
    if world_size is not None and world_size != peers:
        raise ConfigError(
            f"the launcher started {world_size} processes but peers={peers}; "
            f"pass peers={world_size} or start {peers} processes"
        )
    name = run.backend.name
    if name not in backends.names():
        raise ConfigError(f"unknown backend {name!r}; valid backend options: {', '.join(backends.names())}")
    record = backends.get(name)
    if not record.checkpoints and (every or run.resume):
        keeping = ", ".join(n for n in backends.names() if backends.get(n).checkpoints)
        raise ConfigError(
            f"backend={name} keeps no checkpoints; set checkpoint.every=0 and resume=false, "
            f"or use a backend that does ({keeping})"
        )
    hosts = run.launcher.hosts
    if hosts and not launched:  # under a user's launcher the ranks are placed already: hosts is not read
        if not record.processes:
            spawned = " or ".join(f"backend={n}" for n in backends.names() if backends.get(n).processes)
            raise ConfigError(
                f"launcher.hosts={list(hosts)} needs {spawned} (peer processes on those hosts), but backend={name} "
                "runs every peer in this process; choose one of those backends or drop launcher.hosts"
            )
    problem = (None if launched else record.missing()) or loggers.missing_package(run.logger)  # launched: loaded
    if problem:
        raise ConfigError(problem)
    try:
        refuse_unknown(f"backend={name}", run.backend.options, list(record.config_options))
        algorithm = build.algorithm_class(run.algorithm)
        asynchronous = getattr(algorithm, "asynchronous", False)
        if run.elastic:
            _check_elastic(run, algorithm, record)
        if every and asynchronous and run.algorithm.options.get("budget") != "steps":
            raise ConfigError(  # peers stop at different steps: one would wait at a checkpoint for those gone
                f"checkpoint.every needs algorithm.budget=steps with an asynchronous algorithm (every peer then "
                f"reaches each checkpoint step), got budget={run.algorithm.options.get('budget')!r}; set "
                "algorithm.budget=steps or checkpoint.every=0"
            )
        if asynchronous and not record.real_peers:
            _check_simulated_steps(run)
        if not asynchronous and not record.real_peers and NetworkEmulator.from_config(run.network).active:
            real = " or ".join(f"backend={n}" for n in backends.names() if backends.get(n).real_peers)
            raise ConfigError(
                f"network={run.network.name} on backend={name}: the fleet steps a synchronous algorithm's peers in "
                f"lockstep in one process and emulates no network (no emulated time); run it on real peers ({real}) "
                "with that network, or price it on many networks at once with python -m experiments.map"
            )
        record.options(run.backend.options, run.device)  # the backend reads its own options (staging, threads)
        if hosts and not launched:
            backends.host_placement(list(hosts), peers)
        FaultPlan.from_config(run.faults, peers, record)
        divergence.check_mode(run.on_divergence)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ConfigError(str(exc).strip().splitlines()[0]) from None
    try:
        build.build_topology(run.topology, peers)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"topology {run.topology.name!r} with peers={peers}: {exc}") from None
    try:
        build.check_build(run, peers, processes=record.processes, simulated=asynchronous and not record.real_peers)
        if not record.real_peers:  # every peer in one simulation: what the fleet refuses of a model
            from dpsgd.sim import check_model

            check_model(
                build.build_model(run.model, build.load_data(run.data, run.seed, peers), run.seed, run.data.name)
            )
    except (ValueError, TypeError, RuntimeError, FileNotFoundError, ImportError, NotImplementedError) as exc:
        raise ConfigError(str(exc).strip().splitlines()[0]) from None
    return run


def _check_simulated_steps(run: RunConfig) -> None:
    """The event simulator (an asynchronous algorithm on the fleet) takes plain fp32 steps at the configured rate."""
    given = {
        "schedule": run.schedule.name != "constant" or bool(run.schedule.options.get("warmup_steps")),
        "precision": run.precision != "fp32",
        "clip_grad_norm": run.clip_grad_norm is not None,
        "accumulate": run.accumulate != 1,
    }
    if any(given.values()):
        names = ", ".join(k for k, v in given.items() if v)
        real = " or ".join(f"backend={n}" for n in backends.names() if backends.get(n).real_peers)
        raise ConfigError(
            f"{names}: the event simulator (an asynchronous algorithm on backend={run.backend.name}) takes plain "
            f"fp32 steps at a constant rate; run it on real peers ({real}) or drop those options"
        )


def _check_elastic(run: RunConfig, algorithm, record) -> None:
    from dpsgd import elastic
    from dpsgd.optim import ALGORITHMS

    name = run.algorithm.name
    if not elastic.supported(algorithm):
        valid = ", ".join(n for n, cls in ALGORITHMS.items() if elastic.supported(cls))
        raise ConfigError(
            f"elastic=true supports algorithm {valid}; {name} keeps per-peer state with no rule for a peer count "
            f"that changes mid-run; choose one of those or set elastic=false"
        )
    if not record.processes:
        valid = " or ".join(f"backend={n}" for n in backends.names() if backends.get(n).processes)
        raise ConfigError(
            f"elastic=true needs peers that are processes ({valid}, started by the app or by torchrun), "
            f"got backend={record.name}"
        )
    if not run.checkpoint.every:
        raise ConfigError(
            "elastic=true needs checkpoint.every > 0: a re-formed world continues from the newest checkpoint"
        )
    if run.launcher.hosts:
        raise ConfigError(
            "elastic=true with launcher.hosts is not supported: run torchrun --nnodes MIN:MAX on each host instead"
        )


# what a resumed run may set differently: none changes the math (launcher: where the peers run)
RESUME_MAY_CHANGE = ("resume", "faults", "comm", "launcher")


def check_same_run(saved: Mapping, run: RunConfig | Mapping, run_dir) -> None:
    """resume=true continues the run in `run_dir` only with the config it was started with."""
    from dpsgd.loggers import dotted_keys

    before = dotted_keys(parse(saved).as_dict())
    now = dotted_keys(parse(run).as_dict())
    changed = [
        k
        for k in sorted(set(before) | set(now))
        if k.split(".")[0] not in RESUME_MAY_CHANGE and before.get(k) != now.get(k)
    ]
    if changed:
        shown = ", ".join(f"{k}={before.get(k)!r} there, {now.get(k)!r} here" for k in changed[:3])
        raise ConfigError(
            f"resume=true, but {run_dir} was started with a different config ({shown}"
            f"{', ...' if len(changed) > 3 else ''}); resume with the run's own settings "
            f"({run_dir}/config.yaml) or start a new run in a new folder"
        )
