"""Config checks that run before any peer starts: one line saying what is wrong and how to fix it."""

from __future__ import annotations

import re
from pathlib import Path

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


def validate(cfg: dict, world_size: int | None = None) -> None:
    """Everything that would otherwise fail inside the peers, checked in the driver."""
    from dpsgd import data, models
    from dpsgd.build import build_model, build_topology, check_algorithm, load_data, partition
    from dpsgd.comm import BACKENDS
    from dpsgd.optim import BASE_OPTIMIZERS

    peers = cfg.get("peers")
    if not isinstance(peers, int) or isinstance(peers, bool) or peers < 1:
        raise ConfigError(f"peers must be an integer >= 1, got {peers!r}")
    if world_size is not None and world_size != peers:
        raise ConfigError(f"the launcher started {world_size} processes but peers={peers}; "
                          f"pass peers={world_size} or start {peers} processes")
    try:
        check_algorithm(cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    _check_choice("algorithm.optimizer", cfg["algorithm"].get("optimizer", "sgd"), BASE_OPTIMIZERS)
    lr = cfg["algorithm"].get("lr")
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not lr > 0:
        raise ConfigError(f"algorithm.lr must be a number > 0, got {lr!r}")
    _check_choice("backend", cfg["backend"].get("name"), (*BACKENDS, "fleet"))
    if cfg["backend"]["name"] == "fleet":
        _check_fleet(cfg)
    if not cfg["model"].get("_target_"):
        _check_choice("model", cfg["model"].get("name"), models.MODELS)
    _check_choice("dataset", cfg["data"].get("name"), data.DATASETS)
    for key in ("epochs", "batch_size", "log_every"):
        value = cfg.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{key} must be an integer >= 1, got {value!r}")
    timeout = cfg.get("comm", {}).get("timeout_s")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ConfigError(f"comm.timeout_s must be a number of seconds > 0, got {timeout!r}")
    try:
        topology = build_topology(cfg, peers)
        if cfg["algorithm"]["name"] == "adpsgd" and peers > 1:
            topology.bipartite()  # AD-PSGD pairs active with passive peers: every edge must cross
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"topology {cfg['topology'].get('name')!r} with peers={peers}: {exc}") from None
    _check_choice("data.partition", cfg["data"].get("partition", "iid"), data.PARTITIONS)
    # build what the peers will build (cheap at this size): data files, partition, model shapes
    try:
        split = load_data(cfg)
        partition(cfg, split, peers)
        if not any(True for _ in build_model(cfg, split).parameters()):
            raise ValueError(f"the model {cfg['model'].get('_target_') or cfg['model'].get('name')!r} "
                             f"has no parameters to train")
    except (ValueError, TypeError, FileNotFoundError, ImportError) as exc:
        raise ConfigError(str(exc).splitlines()[0]) from None


def _check_fleet(cfg: dict) -> None:
    """What the fleet (dpsgd.sim) cannot do: other algorithms, checkpoints."""
    from dpsgd.sim import ALGORITHMS

    supported = (*ALGORITHMS, "adpsgd")
    if cfg["algorithm"].get("_target_") or cfg["algorithm"].get("name") not in supported:
        raise ConfigError(f"backend=fleet runs the algorithms {', '.join(supported)}, not "
                          f"{cfg['algorithm'].get('_target_') or cfg['algorithm'].get('name')!r}; use backend=local")
    if (cfg.get("checkpoint") or {}).get("every") or cfg.get("resume"):
        raise ConfigError("backend=fleet keeps no checkpoints (a fleet run is minutes); set checkpoint.every=0 "
                          "and resume=false, or use backend=local")


def _check_choice(what: str, value, valid) -> None:
    if value not in valid:
        raise ConfigError(f"unknown {what} {value!r}; valid {what} options: {', '.join(valid)}")
