"""Config checks that run before any peer starts: one line saying what is wrong and how to fix it."""

from __future__ import annotations

import re
from pathlib import Path

from dpsgd.loggers import dotted_keys

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
GROUPS = tuple(sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir()))


class ConfigError(ValueError):
    """A config that cannot run; its message is the one line the user sees."""


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def check_group_overrides(argv: list[str]) -> None:
    """`algorithm=nope` on the command line: name the valid options before Hydra starts."""
    for arg in argv:
        m = re.fullmatch(r"\+?(\w+)=([\w,]+)", arg)
        if not m or m.group(1) not in GROUPS:
            continue
        group, valid = m.group(1), group_options(m.group(1))
        for choice in m.group(2).split(","):
            if choice not in valid:
                raise ConfigError(f"unknown {group} {choice!r}; valid {group} options: {', '.join(valid)}")


def validate(cfg: dict, world_size: int | None = None, launched: bool = False) -> None:
    """Everything that would otherwise fail inside the peers, checked in the driver (or, under a
    user's launcher, in every rank before it joins the others)."""
    from dpsgd import backends, data, loggers, models, placement
    from dpsgd.backends.hosts import placement as host_placement
    from dpsgd.build import build_model, build_peer, build_topology, check_algorithm, load_data
    from dpsgd.comm import LocalCommunicator, LocalWorld
    from dpsgd.comm.staging import check_mode
    from dpsgd.faults import FaultPlan
    from dpsgd.optim import BASE_OPTIMIZERS

    peers = cfg.get("peers")
    if not isinstance(peers, int) or isinstance(peers, bool) or peers < 1:
        raise ConfigError(f"peers must be an integer >= 1, got {peers!r}")
    elastic = cfg.get("elastic", False)
    if not isinstance(elastic, bool):
        raise ConfigError(f"elastic must be true or false, got {elastic!r}")
    if elastic and world_size is not None:
        peers = world_size  # the world the launcher formed now; `peers` still sets the run's budget
    if world_size is not None and world_size != peers:
        raise ConfigError(
            f"the launcher started {world_size} processes but peers={peers}; "
            f"pass peers={world_size} or start {peers} processes"
        )
    try:
        algorithm = check_algorithm(cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    _check_choice("algorithm.optimizer", cfg["algorithm"].get("optimizer", "sgd"), BASE_OPTIMIZERS)
    lr = cfg["algorithm"].get("lr")
    if not _is_number(lr) or not lr > 0:
        raise ConfigError(f"algorithm.lr must be a number > 0, got {lr!r}")
    for key in ("period", "global_period", "group_size"):
        value = cfg["algorithm"].get(key)
        if value is not None and (not _is_int(value) or value < 1):
            raise ConfigError(f"algorithm.{key} must be an integer >= 1, got {value!r}")
    ratio = cfg["algorithm"].get("ratio")
    if ratio is not None and (not _is_number(ratio) or not 0 < ratio <= 1):
        raise ConfigError(
            f"algorithm.ratio (the fraction of entries a compressor sends) must be in (0, 1], got {ratio!r}"
        )
    backend = cfg["backend"].get("name")
    _check_choice("backend", backend, backends.names())
    record = backends.get(backend)
    try:  # the backend reads its own options (e.g. the fleet's threads)
        record.options(cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if not record.checkpoints and ((cfg.get("checkpoint") or {}).get("every") or cfg.get("resume")):
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
        try:
            host_placement(list(hosts), peers)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    problem = None if launched else record.missing()  # under a launcher the runtime is already loaded
    if problem:
        raise ConfigError(problem)
    problem = loggers.missing_package(cfg)
    if problem:
        raise ConfigError(problem)
    try:  # the GPU of the first peer on this node: the refusals (no GPU, too few for nccl) come here
        check_mode(cfg["backend"].get("staging", "auto"))
        if record.processes:
            placement.peer_device(cfg, 0, peers, nccl=placement.uses_nccl(cfg))
        else:  # peers in one process share its device
            placement.single_device(cfg)
    except (ValueError, RuntimeError) as exc:
        raise ConfigError(str(exc)) from None
    if not cfg["model"].get("_target_"):
        _check_choice("model", cfg["model"].get("name"), models.MODELS)
    _check_choice("dataset", cfg["data"].get("name"), data.DATASETS)
    for key in ("epochs", "batch_size", "log_every"):
        value = cfg.get(key)
        if not _is_int(value) or value < 1:
            raise ConfigError(f"{key} must be an integer >= 1, got {value!r}")
    every = (cfg.get("checkpoint") or {}).get("every", 0)
    if not _is_int(every) or every < 0:
        raise ConfigError(f"checkpoint.every must be an integer >= 0 (0: no checkpoints), got {every!r}")
    if elastic:
        _check_elastic(cfg, algorithm, record, every)
    if every and getattr(algorithm, "asynchronous", False) and cfg["algorithm"].get("budget") != "steps":
        raise ConfigError(  # peers stop at different steps: one would wait at a checkpoint for those gone
            f"checkpoint.every needs algorithm.budget=steps with an asynchronous algorithm (every peer then "
            f"reaches each checkpoint step), got budget={cfg['algorithm'].get('budget')!r}; set "
            "algorithm.budget=steps or checkpoint.every=0"
        )
    timeout = cfg.get("comm", {}).get("timeout_s")
    if not _is_number(timeout) or timeout <= 0:
        raise ConfigError(f"comm.timeout_s must be a number of seconds > 0, got {timeout!r}")
    try:
        FaultPlan.from_config(cfg.get("faults"), peers, record)
    except (ValueError, TypeError) as exc:
        raise ConfigError(str(exc)) from None
    try:
        build_topology(cfg, peers)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"topology {cfg['topology'].get('name')!r} with peers={peers}: {exc}") from None
    _check_choice("data.partition", cfg["data"].get("partition", "iid"), data.PARTITIONS)
    if cfg["data"].get("name") == "heterogeneous_regression" and cfg["data"].get("partition") != "blocks":
        raise ConfigError(  # any other partition mixes the peers' problems, and x* is no longer the known optimum
            f"data=heterogeneous_regression gives peer i the i-th block, its own problem: it needs "
            f"data.partition=blocks, got {cfg['data'].get('partition')!r}"
        )
    fraction = cfg["data"].get("validation_fraction") or 0
    if not _is_number(fraction) or not 0 <= fraction < 1:
        raise ConfigError(
            f"data.validation_fraction must be in [0, 1) (0: evaluate on the test split), got {fraction!r}"
        )
    fixed = cfg["data"].get("split_seed")
    if fixed is not None and not _is_int(fixed):
        raise ConfigError(f"data.split_seed must be an integer, or null for the run's seed, got {fixed!r}")
    # build what peer 0 will build (cheap at this size) in a world of `peers`: data files, partition,
    # model shapes, and the algorithm with its options on this topology
    try:
        if not any(True for _ in build_model(cfg, load_data(cfg)).parameters()):
            raise ValueError(
                f"the model {cfg['model'].get('_target_') or cfg['model'].get('name')!r} has no parameters to train"
            )
        # peer 0 alone: it must not wait for the others' parameters
        # on the CPU: the driver keeps off the GPUs its peers will use
        alone = {**cfg, "faults": None, "device": "cpu", "algorithm": {**cfg["algorithm"], "broadcast_initial": False}}
        build_peer(LocalCommunicator(LocalWorld(peers), 0, float(timeout)), alone)
    except (ValueError, TypeError, FileNotFoundError, ImportError, NotImplementedError) as exc:
        raise ConfigError(str(exc).strip().splitlines()[0]) from None


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
    restarts = cfg.get("max_restarts", 0)
    if not _is_int(restarts) or restarts < 0:
        raise ConfigError(f"max_restarts must be an integer >= 0, got {restarts!r}")
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


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_choice(what: str, value, valid) -> None:
    if value not in valid:
        raise ConfigError(f"unknown {what} {value!r}; valid {what} options: {', '.join(valid)}")
