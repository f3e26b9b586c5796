"""Config checks that run before any peer starts: one line saying what is wrong and how to fix it."""

from __future__ import annotations

import re
from pathlib import Path

from dpsgd.loggers import dotted_keys

_HERE = Path(__file__).resolve().parent
# the app's configs: conf/ at the repository's top level, or experiments/conf/ in an installed wheel (setup.py)
CONF_DIR = _HERE / "conf" if (_HERE / "conf").is_dir() else _HERE.parent / "conf"
GROUPS = tuple(sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir()))


class ConfigError(ValueError):
    """A config that cannot run; its message is the one line the user sees."""


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


# The config schema: (dotted key, kind, bound, null allowed, hint) of the keys the loop reads itself; every
# other option is checked by the constructor that takes it (build_peer below).
SCHEMA = (
    ("peers", "integer", ">= 1", False, ""),
    ("epochs", "integer", ">= 1", False, ""),
    ("batch_size", "integer", ">= 1", False, ""),
    ("log_every", "integer", ">= 1", False, ""),
    ("checkpoint.every", "integer", ">= 0", True, " (0: no checkpoints)"),
    ("max_restarts", "integer", ">= 0", True, ""),
    ("comm.timeout_s", "number of seconds", "> 0", False, ""),
    ("algorithm.lr", "number", "> 0", False, ""),
    ("algorithm.period", "integer", ">= 1", True, ""),
    ("algorithm.global_period", "integer", ">= 1", True, ""),
    ("algorithm.group_size", "integer", ">= 1", True, ""),
    ("algorithm.ratio", "fraction", "in (0, 1]", True, ""),
    ("data.split_seed", "integer", "", True, ", or null for the run's seed"),
)
WHAT = {"algorithm.ratio": "the fraction of entries a compressor sends"}  # named in the message
_BOUNDS = {
    ">= 1": lambda v: v >= 1,
    ">= 0": lambda v: v >= 0,
    "> 0": lambda v: v > 0,
    "in (0, 1]": lambda v: 0 < v <= 1,
}


def check_schema(cfg: dict) -> None:
    """The keys of SCHEMA have their kind and bound; `elastic` is true or false."""
    for key, kind, bound, nullable, note in SCHEMA:
        value: object = cfg
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is None and nullable:
            continue
        whole = isinstance(value, int) and not isinstance(value, bool)
        number = whole or (isinstance(value, float) and kind != "integer")
        if not number or (bound and not _BOUNDS[bound](value)):
            article = "an " if kind[0] in "aeiou" else "a "
            must = f"must be in {bound[3:]}" if bound.startswith("in") else f"must be {article}{kind} {bound}".rstrip()
            named = f"{key} ({WHAT[key]})" if key in WHAT else key
            raise ConfigError(f"{named} {must}{note}, got {value!r}")
    if not isinstance(cfg.get("elastic", False), bool):
        raise ConfigError(f"elastic must be true or false, got {cfg.get('elastic')!r}")


def validate(cfg: dict, world_size: int | None = None, launched: bool = False) -> None:
    """Everything that would otherwise fail inside the peers, checked in the driver (or, under a user's launcher,
    in every rank before it joins the others): the config schema, the backend's capabilities, then the plan and
    peer 0 built as a real peer builds them, whose constructors' ValueErrors become the one line."""
    from dpsgd import backends, divergence, loggers, placement
    from dpsgd.backends.hosts import placement as host_placement
    from dpsgd.build import build_peer, build_topology, check_algorithm
    from dpsgd.comm import LocalCommunicator, LocalWorld
    from dpsgd.comm.staging import check_mode
    from dpsgd.faults import FaultPlan

    check_schema(cfg)
    peers, elastic, every = cfg["peers"], cfg.get("elastic", False), (cfg.get("checkpoint") or {}).get("every", 0)
    if elastic and world_size is not None:
        peers = world_size  # the world the launcher formed now; `peers` still sets the run's budget
    if world_size is not None and world_size != peers:
        raise ConfigError(
            f"the launcher started {world_size} processes but peers={peers}; "
            f"pass peers={world_size} or start {peers} processes"
        )
    backend = cfg["backend"].get("name")
    _check_choice("backend", backend, backends.names())
    record = backends.get(backend)
    if not record.checkpoints and (every or cfg.get("resume")):
        keeping = ", ".join(n for n in backends.names() if backends.get(n).checkpoints)
        raise ConfigError(
            f"backend={backend} keeps no checkpoints; set checkpoint.every=0 and resume=false, "
            f"or use a backend that does ({keeping})"
        )
    hosts = (cfg.get("launcher") or {}).get("hosts")
    if hosts and not launched:  # under a user's launcher the ranks are placed already: hosts is not read
        if not record.processes:
            spawned = " or ".join(f"backend={n}" for n in backends.names() if backends.get(n).processes)
            raise ConfigError(
                f"launcher.hosts={list(hosts)} needs {spawned} (peer processes on those hosts), but backend={backend} "
                "runs every peer in this process; choose one of those backends or drop launcher.hosts"
            )
    problem = (None if launched else record.missing()) or loggers.missing_package(cfg)  # launched: runtime loaded
    if problem:
        raise ConfigError(problem)
    try:
        algorithm = check_algorithm(cfg)
        if elastic:
            _check_elastic(cfg, algorithm, record, every)
        if every and getattr(algorithm, "asynchronous", False) and cfg["algorithm"].get("budget") != "steps":
            raise ConfigError(  # peers stop at different steps: one would wait at a checkpoint for those gone
                f"checkpoint.every needs algorithm.budget=steps with an asynchronous algorithm (every peer then "
                f"reaches each checkpoint step), got budget={cfg['algorithm'].get('budget')!r}; set "
                "algorithm.budget=steps or checkpoint.every=0"
            )
        if getattr(algorithm, "asynchronous", False) and not record.real_peers:
            _check_simulated_steps(cfg)
        record.options(cfg)  # the backend reads its own options (e.g. the fleet's threads)
        if hosts and not launched:
            host_placement(list(hosts), peers)
        # the GPU of the first peer on this node: the refusals (no GPU, too few for nccl) come here
        check_mode(cfg["backend"].get("staging", "auto"))
        if record.processes:
            placement.peer_device(cfg, 0, peers, nccl=placement.uses_nccl(cfg))
        else:  # peers in one process share its device
            placement.single_device(cfg)
        FaultPlan.from_config(cfg.get("faults"), peers, record)
        divergence.check_mode(cfg)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ConfigError(str(exc).strip().splitlines()[0]) from None
    try:
        build_topology(cfg, peers)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"topology {cfg['topology'].get('name')!r} with peers={peers}: {exc}") from None
    # peer 0 as a real peer builds it in a world of `peers`: the run's plan (data, partition, budget), model, and
    # the algorithm with its options on this topology; alone (it must not wait for the others' parameters), on
    # the CPU (the driver keeps off the GPUs its peers will use)
    try:
        alone = {**cfg, "faults": None, "device": "cpu", "algorithm": {**cfg["algorithm"], "broadcast_initial": False}}
        build_peer(LocalCommunicator(LocalWorld(peers), 0, float(cfg["comm"]["timeout_s"])), alone)
        if not record.real_peers:  # every peer in one simulation: what the fleet refuses of a model
            from dpsgd.build import build_model, load_data
            from dpsgd.sim.fleet import check_model

            check_model(build_model(cfg, load_data(cfg)))
    except (ValueError, TypeError, FileNotFoundError, ImportError, NotImplementedError) as exc:
        raise ConfigError(str(exc).strip().splitlines()[0]) from None


def _check_simulated_steps(cfg: dict) -> None:
    """The event simulator (an asynchronous algorithm on the fleet) takes plain fp32 steps at the configured rate."""
    schedule = cfg.get("schedule") or {}
    given = {
        "schedule": schedule.get("name", "constant") != "constant" or bool(schedule.get("warmup_steps")),
        "precision": cfg.get("precision", "fp32") != "fp32",
        "clip_grad_norm": cfg.get("clip_grad_norm") is not None,
        "accumulate": cfg.get("accumulate", 1) != 1,
    }
    if any(given.values()):
        from dpsgd import backends

        names = ", ".join(k for k, v in given.items() if v)
        real = " or ".join(f"backend={n}" for n in backends.names() if backends.get(n).real_peers)
        raise ConfigError(
            f"{names}: the event simulator (an asynchronous algorithm on backend={cfg['backend']['name']}) takes plain "
            f"fp32 steps at a constant rate; run it on real peers ({real}) or drop those options"
        )


def _check_elastic(cfg: dict, algorithm, record, every) -> None:
    from dpsgd import backends, elastic
    from dpsgd.optim import ALGORITHMS

    name = cfg["algorithm"].get("_target_") or cfg["algorithm"].get("name")
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
    if not every:
        raise ConfigError(
            "elastic=true needs checkpoint.every > 0: a re-formed world continues from the newest checkpoint"
        )
    if (cfg.get("launcher") or {}).get("hosts"):
        raise ConfigError(
            "elastic=true with launcher.hosts is not supported: run torchrun --nnodes MIN:MAX on each host instead"
        )


# what a resumed run may set differently: none changes the math (launcher: where the peers run)
RESUME_MAY_CHANGE = ("resume", "faults", "comm", "launcher")


def check_same_run(saved: dict, cfg: dict, run_dir) -> None:
    """resume=true continues the run in `run_dir` only with the config it was started with."""
    before, now = dotted_keys(saved), dotted_keys(cfg)
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


def _check_choice(what: str, value, valid) -> None:
    if value not in valid:
        raise ConfigError(f"unknown {what} {value!r}; valid {what} options: {', '.join(valid)}")
