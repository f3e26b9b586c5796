"""The typed run config: Hydra structured configs for every section of an experiment, parsed and checked once.

`RunConfig` is one run: its top-level settings (peers, seed, epochs, ...) and one typed section per config group.
Two kinds of section:

- fixed sections, whose keys are the same for every option of their group: `data`, `network`, `comm`,
  `checkpoint`, `launcher`, `faults`, `logger` (dataclasses here);
- choices, where each option of the group has keys of its own: `algorithm`, `optimizer`, `topology`, `model`,
  `compression`, `robust`, `schedule`, `backend`. A `Choice` holds the option's `name`, the class a `_target_`
  names (a user's own) and the option's keys; whoever builds the part checks those keys against what it takes
  (dpsgd.options: the constructor's signature, or the part's declared options).

`parse(mapping)` turns a composed (or saved, or hand-written) config into a `RunConfig`: an unknown key, a value
of the wrong type or out of its bounds raises `ConfigError`, one line naming the key, what was expected and the
closest valid keys. The app registers the schema with Hydra (`register()`; conf/config.yaml lists `run_schema`
first in its defaults), so Hydra composes onto it and refuses the same mistakes as early as it can.

The library's functions take the section they need (`run.data`, `run.network`, ...), never the whole run, except
those that build a whole run's parts (dpsgd.build) and the loop that drives it (dpsgd.training).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

SCHEMA_NAME = "run_schema"  # the name conf/config.yaml's defaults list gives the schema
RESUME_VALUES = "true, false or auto"  # the bound of `resume` (a value, not a type: Hydra reads true as a bool)
CHECK = "check"  # a field's metadata key: its bound (">= 1", "> 0", ">= 0", "in (0, 1]")


class ConfigError(ValueError):
    """A config that cannot run; its message is the one line the user sees."""


def bound(check: str, default: Any = dataclasses.MISSING, **kwargs) -> Any:
    """A field whose value must satisfy `check` (">= 1", "> 0", ">= 0", "in (0, 1]"; None passes where allowed)."""
    return field(default=default, metadata={CHECK: check}, **kwargs)


@dataclass(frozen=True)
class Choice:
    """A config group's chosen option: its `name`, the class or function its `_target_` names (None: a built-in
    one), and the option's own keys (`options`), which whoever builds the part checks against what it takes."""

    name: str
    target: str | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, section: Mapping[str, Any] | Choice | str | None, default: str) -> Choice:
        """The Choice a config section holds: `{name: ..., _target_: ..., **options}` (or a bare name)."""
        if isinstance(section, Choice):
            return section
        if section is None or isinstance(section, str):
            return cls(section or default)
        rest = dict(section)
        target = rest.pop("_target_", None)
        name = rest.pop("name", None) or (str(target).rpartition(".")[2] if target else default)
        return cls(str(name), None if target is None else str(target), rest)

    def as_dict(self) -> dict[str, Any]:
        """The section as the config file writes it."""
        return {"name": self.name, **({"_target_": self.target} if self.target else {}), **self.options}


@dataclass
class DataConfig:
    """`data=`: the dataset, its held-out split and its partition across peers (dpsgd.data)."""

    name: str = "digits"
    test_fraction: float = 0.2  # held-out test split of bundled and generated datasets
    partition: str = "iid"  # iid, dirichlet, shards or blocks
    alpha: float = 0.5  # dirichlet concentration
    shards_per_peer: int = 2  # shards: shards per peer
    split_seed: int | None = None  # seed of the test (and validation) split; None: the run's seed
    validation_fraction: float = 0.0  # > 0: this share of the training split is evaluated in the test split's place
    root: str | None = None  # the folder of a file-based dataset (mnist, cifar10; fashion_mnist: Debian's by default)
    num_samples: int | None = None  # generated datasets: their size
    num_features: int | None = None
    num_classes: int | None = None
    seq_len: int | None = None  # text: tokens per sample
    test_samples: int | None = bound(">= 1", None)  # held-out samples every record scores, evenly spaced; None: all
    augment: str = "none"  # none, or crop_flip: random 4-pixel crops and mirror flips of each image batch
    image_shape: list[int] | None = None  # synthetic: samples shaped as images
    samples_per_peer: int | None = None  # heterogeneous_regression
    heterogeneity: float | None = None  # heterogeneous_regression

    def seed_of_split(self, run_seed: int) -> int:
        """The seed of the test (and validation) split: `split_seed`, else the run's seed."""
        return run_seed if self.split_seed is None else int(self.split_seed)


@dataclass
class NetworkConfig:
    """`network=`: the emulated links and compute (dpsgd.comm.netem)."""

    name: str = "loopback"
    mode: str = "sleep"  # model: costs go to an emulated clock only; sleep: peers really wait
    latency_s: float = 0.0  # per-message latency alpha
    bandwidth_bytes_per_s: float | None = None  # link bandwidth beta; None: unlimited
    jitter_s: float = 0.0
    slow_peers: list[int] = field(default_factory=list)
    compute_scale: float = 1.0  # how many times slower the slow peers are
    compute_time: float = 0.0  # per-step compute in seconds (sleep mode: a floor); 0: as `compute` says
    compute: str = "calibrated"  # model mode: calibrated (once per workload, dpsgd.calibration) or measured each step
    calibrated_s: float | None = None  # the calibrated compute, filled in by the run itself (what its clock took)
    peers_per_host: int = 1
    intra_latency_s: float = 0.0
    intra_bandwidth_bytes_per_s: float | None = None
    allreduce: str = "ring"  # ring, or halving_doubling (MPICH's)


@dataclass
class CommConfig:
    """`comm:`: how long a peer waits for another before it raises, naming the peer."""

    timeout_s: float = bound("> 0", 120.0)


@dataclass
class CheckpointConfig:
    every: int = bound(">= 0", 0)  # steps between checkpoints of every peer (0: none)


@dataclass
class LauncherConfig:
    """`launcher:`: where the driver starts the peers (dpsgd.backends.hosts); no hosts: all on this machine."""

    hosts: list[str] | None = None  # e.g. [10.0.0.1,10.0.0.2] or [node1:2,node2:2]; null or []: this machine
    runner: str = "ssh"  # runs a shell line on a host as `RUNNER HOST LINE`
    port: int = 0  # backend=torch: the master's port; 0: a free one


@dataclass
class FaultsConfig:
    """`faults:`: injected failures (dpsgd.faults), all off by default."""

    kill_peer: int | None = None
    kill_mode: str = "exit"  # exit or hang
    at_step: int = 10
    delay_peer: int | None = None
    delay_s: float = 0.0
    drop_messages: float = 0.0  # backend=local: fraction of messages lost
    corrupt_peer: Any = None  # a rank or a list of ranks
    corrupt_mode: str = "scale"  # nan, scale, sign, noise, alie
    corrupt_scale: float | None = None

    @property
    def active(self) -> bool:
        return self != FaultsConfig()


@dataclass
class EvalConfig:
    """`eval:`: what a record evaluates between the first and the last (the last scores the whole test split and
    every peer): a seeded subset of the test split, and the own models of a seeded sample of the peers."""

    samples: int | None = bound(">= 1", 2000)  # test samples scored; None: the whole test split every time
    peers: int | None = bound(">= 0", 16)  # peers whose own model is scored; None: every peer; 0: none


@dataclass
class LoggerConfig:
    """`logger=`: where the records go besides metrics.jsonl (dpsgd.loggers)."""

    sinks: list[str] = field(default_factory=list)  # tensorboard, mlflow
    mlflow_uri: str | None = None
    experiment: str = "dpsgd"


@dataclass
class RunConfig:
    """One experiment (see the module). Defaults are the default experiment's (conf/config.yaml's choices)."""

    peers: int = bound(">= 1", 4)
    seed: int = 0
    epochs: int = bound(">= 1", 30)
    batch_size: int = bound(">= 1", 32)  # samples per peer per step
    log_every: int = bound(">= 1", 11)  # steps between metric records
    eval_every: int | None = bound(">= 1", None)  # steps between evaluations (records of test figures); None: log_every
    precision: str = "fp32"  # fp32, bf16 or fp16
    clip_grad_norm: float | None = bound("> 0", None)
    buffers: str | None = None  # broadcast, average or local; None: the algorithm's default
    accumulate: int = bound(">= 1", 1)  # micro-batches per step
    on_divergence: str = "stop"  # stop or mark
    target_accuracy: float | None = None
    device: str = "cpu"  # cpu, cuda, auto or cuda:N
    device_share: bool = False
    # true: continue from the newest complete checkpoint (refused when there is none); auto: the same, or a new run
    # when the folder holds no complete checkpoint; false: a new run (dpsgd.checkpoint, experiments.train)
    resume: bool | str = bound(RESUME_VALUES, False)
    elastic: bool = False
    max_restarts: int = bound(">= 0", 3)
    algorithm: Choice = field(default_factory=lambda: Choice("dpsgd"))
    optimizer: Choice = field(default_factory=lambda: Choice("sgd", options={"lr": 0.1, "momentum": 0.9}))
    topology: Choice = field(default_factory=lambda: Choice("ring"))
    model: Choice = field(default_factory=lambda: Choice("mlp"))
    data: DataConfig = field(default_factory=DataConfig)
    backend: Choice = field(default_factory=lambda: Choice("mpi"))
    network: NetworkConfig = field(default_factory=NetworkConfig)
    compression: Choice = field(default_factory=lambda: Choice("none"))
    robust: Choice = field(default_factory=lambda: Choice("none"))
    schedule: Choice = field(default_factory=lambda: Choice("constant"))
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def as_dict(self) -> dict[str, Any]:
        """The run as its config.yaml writes it (choices flat, as their group's files are)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Choice):
                out[f.name] = value.as_dict()
            elif dataclasses.is_dataclass(value) and not isinstance(value, type):
                out[f.name] = dataclasses.asdict(value)
            else:
                out[f.name] = value
        return out

    def save(self, path) -> None:
        """The run as a YAML config file at `path` (what a resume and the spawned peers read), written whole or not
        at all (dpsgd.runfiles: a full disk leaves the old file or none; RunFileError says so in one line)."""
        from omegaconf import OmegaConf

        from dpsgd import runfiles

        runfiles.write_atomic(path, OmegaConf.to_yaml(OmegaConf.create(self.as_dict())).encode())

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with `changes` (top-level keys); sections are replaced whole."""
        return dataclasses.replace(self, **changes)


def _schema_of(cls: type, made: dict[type, type]) -> type:
    """The Hydra schema of a dataclass: the same fields, a choice an open dict (its keys are its builder's)."""
    if cls in made:
        return made[cls]
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        default: Any = f.default
        if len([a for a in typing.get_args(kind) if a is not type(None)]) > 1:  # bool | str: OmegaConf has no unions
            kind = Any
        if kind is Choice:  # empty: a group's option replaces it whole (a default's keys would leak into another)
            kind, default = dict[str, Any], field(default_factory=dict)
        elif dataclasses.is_dataclass(kind):
            kind = _schema_of(kind, made)  # type: ignore[arg-type]
            default = field(default_factory=kind)
        elif f.default is dataclasses.MISSING:
            default = field(default_factory=f.default_factory)
        fields.append((f.name, kind, default))
    made[cls] = dataclasses.make_dataclass(cls.__name__ + "Schema", fields)
    return made[cls]


SCHEMA: type = _schema_of(RunConfig, {})
_CHOICES = tuple(f.name for f in dataclasses.fields(RunConfig) if typing.get_type_hints(RunConfig)[f.name] is Choice)


def register() -> None:
    """The schema in Hydra's ConfigStore as `run_schema` (conf/config.yaml composes onto it)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=SCHEMA)


# --- parsing ------------------------------------------------------------------------------------------------------
_BOUNDS = {
    ">= 1": lambda v: v >= 1,
    ">= 0": lambda v: v >= 0,
    "> 0": lambda v: v > 0,
    "in (0, 1]": lambda v: 0 < v <= 1,
    RESUME_VALUES: lambda v: v is True or v is False or v == "auto",
}


def parse(source: Mapping[str, Any] | RunConfig) -> RunConfig:
    """The typed run of a config mapping (composed by Hydra, read from a run's config.yaml or written by hand;
    sections and keys left out take their defaults). ConfigError: one line naming the key (see the module)."""
    if isinstance(source, RunConfig):
        return source
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    given = {k: v for k, v in _plain(source).items() if k != "hydra"}
    try:
        merged = OmegaConf.merge(OmegaConf.structured(SCHEMA), given)
    except OmegaConfBaseException as exc:
        raise one_line(exc, given) from None
    plain = typing.cast(dict, OmegaConf.to_container(merged, resolve=True))
    for name in _CHOICES:  # a choice left out is the default run's, with its keys
        if not given.get(name):
            plain[name] = getattr(RunConfig(), name).as_dict()
    run = _build(RunConfig, plain)
    check_bounds(run, given=given)
    return run


def _plain(source: Mapping[str, Any]) -> dict[str, Any]:
    from omegaconf import DictConfig, OmegaConf

    if isinstance(source, DictConfig):
        return typing.cast(dict, OmegaConf.to_container(source, resolve=True))
    return {k: (_plain(v) if isinstance(v, Mapping) else v) for k, v in source.items()}


def _build(cls: type, values: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        value, kind = values[f.name], hints[f.name]
        if kind is Choice:
            value = Choice.of(value, getattr(RunConfig(), f.name).name)
        elif dataclasses.is_dataclass(kind):
            value = _build(kind, value)  # type: ignore[arg-type]
        kwargs[f.name] = value
    return cls(**kwargs)


def check_bounds(section: Any, prefix: str = "", given: Mapping[str, Any] | None = None) -> None:
    """Every bounded field of `section` (and its sections) within its bound, or ConfigError naming it (with the
    value as `given` wrote it, where it is given)."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, Choice):
            check_bounds(value, f"{prefix}{f.name}.", given)
        check = f.metadata.get(CHECK)
        if check is not None and value is not None and not _BOUNDS[check](value):
            raise ConfigError(must_be(prefix + f.name, hints[f.name], check, _given(given, prefix + f.name, value)))


def _given(given: Mapping[str, Any] | None, key: str, default: Any = "?") -> Any:
    """The value at dotted `key` of `given` as it was written, else `default`."""
    value: Any = given
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return default
        value = value[part]
    return value


def must_be(key: str, kind: Any, check: str | None, value: Any) -> str:
    """'peers must be an integer >= 1, got 0': the one line for a value of the wrong type or out of bounds."""
    base = _base_type(kind)
    words = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list"}.get(
        base, "a value"
    )
    if base is float and key.endswith("_s"):
        words = "a number of seconds"
    if check and (check.startswith("in ") or check == RESUME_VALUES):
        text = f"{key} must be {check}"
    else:
        text = f"{key} must be {words}{' ' + check if check else ''}"
    nullable = type(None) in typing.get_args(kind)
    return f"{text}{', or null' if nullable and check else ''}, got {value!r}"


def _base_type(kind: Any) -> Any:
    """int for `int`, `int | None`; list for `list[int]`, `list[int] | None`."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if type(None) in typing.get_args(kind) and len(args) == 1:
        kind = args[0]
    return typing.get_origin(kind) or kind


def one_line(exc: Exception, given: Mapping[str, Any] | None = None) -> ConfigError:
    """An OmegaConf (or Hydra) error about the config (`given`) as the one line a user reads."""
    from omegaconf.errors import ConfigKeyError, ValidationError

    key = str(getattr(exc, "full_key", "") or "")
    if isinstance(exc, ConfigKeyError) and key:
        return ConfigError(f"unknown key {key!r} (the config has no such key); {suggest(key)}")
    if isinstance(exc, ValidationError) and key:
        value = _given(given, key, _offending_value(str(exc)))
        kind, check = _field_of(key)
        if kind is not None:
            return ConfigError(must_be(key, kind, check, value))
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ConfigError(f"{key + ': ' if key else ''}{first}")


def _offending_value(message: str) -> Any:
    import re

    m = re.search(r"Value '(.*?)' of type '(\w+)'", message)
    if not m:
        return "?"
    text, kind = m.groups()
    converters: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "bool": lambda s: s == "True"}
    try:
        return converters.get(kind, str)(text)
    except ValueError:
        return text


def _field_of(key: str) -> tuple[Any, str | None]:
    """The type and bound of the dotted key `key` of RunConfig, or (None, None)."""
    cls: Any = RunConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(cls):
            return None, None
        found = {f.name: f for f in dataclasses.fields(cls)}.get(part)
        if found is None:
            return None, None
        kind = typing.get_type_hints(cls)[part]
        if i == len(parts) - 1:
            return kind, found.metadata.get(CHECK)
        cls = kind
    return None, None


def keys(cls: type = RunConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (a choice's own keys are its builder's, not listed here)."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        out.append(prefix + f.name)
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind) and kind is not Choice:
            out += keys(kind, f"{prefix}{f.name}.")  # type: ignore[arg-type]
    return out


def suggest(key: str, known: list[str] | None = None) -> str:
    """'did you mean epochs? the keys at the top level: ...': the closest valid keys to `key`, and its siblings."""
    known = keys() if known is None else known
    parent = key.rpartition(".")[0]
    siblings = sorted(k for k in known if k.rpartition(".")[0] == parent)
    close = difflib.get_close_matches(key, siblings, n=3, cutoff=0.6) or difflib.get_close_matches(
        key, sorted(known), n=3, cutoff=0.75
    )
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    where = f"under {parent}" if parent else "at the top level"
    shown = ", ".join(s.rpartition(".")[2] for s in siblings[:14]) + (", ..." if len(siblings) > 14 else "")
    return f"{hint}the keys {where}: {shown}"
