"""The command line's overrides, checked before Hydra reads them, so that every mistake Hydra itself would report
in several lines (or not at all) ends in the app's one line (experiments.train: exit 2, no output folder):
- an override Hydra's grammar cannot read names the argument and the quoting that works;
- a value that starts with `~` (a home folder: `data.root=~/data`, which the shell leaves alone after a dotted
  key) is expanded here, as the shell would have;
- a group option that does not exist (`algorithm=dpsgdd`) gets the closest valid ones;
- then the config is composed as Hydra will compose it (each combination of a sweep's group choices, up to a few,
  each swept key at its first value; with the user's own config folders, `hydra.searchpath` and `--config-dir`)
  onto the typed schema (dpsgd.config), and parsed: a key the config does not have (`epochz=3`), a key added with
  `+` that nothing reads (`+epochz=3`; a choice such as `algorithm` takes new keys, which its builder checks), a
  value of the wrong type or out of bounds are refused by name with the closest valid keys ("did you mean"); `+`
  on a key that exists says to drop it.
Command lines with Hydra's other flags (--cfg, --config-name, ...) are left to Hydra.
"""

from __future__ import annotations

import difflib
import itertools
import os
import re

from dpsgd.config import keys as schema_keys
from dpsgd.config import one_line, parse, suggest
from experiments.validate import GROUPS, ConfigError, compose, group_options, search_path

MAX_COMPOSED = 8  # combinations of swept group choices composed to learn the keys
HYDRA_FLAGS = ("-m", "--multirun")
CONFIG_DIR_FLAGS = ("--config-dir", "-cd")  # Hydra's flag adding a folder to the search path (checked here too)


def expand_home(argv: list[str]) -> list[str]:
    """`key=~/x` (and `+key=~`, `key=~user/x`) with the home folder expanded, as a shell does for `VAR=~/x`."""
    out = []
    for arg in argv:
        m = re.fullmatch(r"(\+{0,2}[\w.\-/@]+=)(~[\w.\-]*(?:/.*)?)", arg)
        out.append(m.group(1) + os.path.expanduser(m.group(2)) if m else arg)
    return out


def _parse(args: list[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    parsed = []
    for arg in args:
        try:
            parsed.append(parser.parse_override(arg))
        except HydraException as exc:  # the grammar's OverrideParseException, or a token it cannot read
            key, equals, value = arg.partition("=")
            why = " ".join(str(exc).split("\n")[0].split())
            quoted = f"{key}='{value}'" if "'" not in value else f'{key}="{value}"'
            fix = (
                f'quote a value with special characters for Hydra, and the whole override for the shell: "{quoted}"'
                if equals
                else "write key=value"
            )
            raise ConfigError(f"cannot read the override {arg!r} ({why}); {fix}") from None
    return parsed


def _choices(override) -> list[str]:
    if override.is_sweep_override():
        try:
            return [str(v) for v in override.sweep_string_iterator()]
        except Exception:  # noqa: BLE001 - an interval, or a sweep of no listable values: the sampler's
            return []
    value = override.value()
    return [] if value is None else [str(value)]


def _keys(tree, prefix: str = "") -> set[str]:
    out = set()
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.add(prefix + str(k))
            out |= _keys(v, f"{prefix}{k}.")
    return out


def _compose(overrides: list[str]) -> dict:
    """The config composed from conf/ (and the search path the overrides add) as a plain dict, unresolved."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(compose(overrides), resolve=False)  # type: ignore[return-value]


def _missing_key(exc: Exception) -> str | None:
    """The key of a Hydra composition error that names one the config does not have (an override without `+`)."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, ConfigAttributeError | ConfigKeyError):
        return str(getattr(cause, "full_key", "") or "") or None
    return None


def _without_config_dirs(argv: list[str]) -> tuple[list[str], list[str]]:
    """The command line without `--config-dir DIR` (`-cd DIR`, `--config-dir=DIR`), and those folders."""
    rest: list[str] = []
    dirs: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg in CONFIG_DIR_FLAGS:
            dirs.append(next(args, ""))
        elif arg.startswith("--config-dir="):
            dirs.append(arg.partition("=")[2])
        else:
            rest.append(arg)
    return rest, dirs


def _search_path_override(args: list[str], dirs: list[str]) -> list[str]:
    """The one `hydra.searchpath=[...]` override that composes with the command line's own search path: its
    `hydra.searchpath` entries and its `--config-dir` folders."""
    searched = [a for a in args if a.lstrip("+").startswith("hydra.searchpath=")]
    if not dirs:
        return searched
    entries = [e.strip() for a in searched for e in a.partition("=")[2].strip("[]").split(",") if e.strip()]
    entries += [f"'file://{os.path.abspath(os.path.expanduser(d))}'" for d in dirs]
    return [f"hydra.searchpath=[{','.join(entries)}]"]


def check(argv: list[str]) -> list[str]:
    """The command line with `~` expanded; ConfigError (one line) for an override that cannot run (see the module)."""
    from hydra.errors import HydraException

    argv = expand_home(argv)
    extra = search_path(argv)  # the user's own config folders (hydra.searchpath, --config-dir)
    args, dirs = _without_config_dirs(argv)
    for folder in dirs:
        if not os.path.isdir(os.path.expanduser(folder)):
            raise ConfigError(
                f"--config-dir {folder!r} is not a folder; give the folder that holds your own config groups "
                f"(algorithm/, topology/, model/, data/, ...)"
            )
    if extra is None or any(a.startswith("-") and a not in HYDRA_FLAGS for a in args):
        return argv  # Hydra's own flags (--cfg, --config-name, ...): its own business
    given = [a for a in args if a not in HYDRA_FLAGS]
    overrides = _parse(given)
    known = set(GROUPS) | {p.name for d in extra if d.is_dir() for p in d.iterdir() if p.is_dir()}
    groups: dict[str, list[str]] = {}
    for o in overrides:
        name = o.key_or_group
        if name in known and not o.is_delete():
            valid = group_options(name, extra)
            for choice in _choices(o):
                if choice not in valid and choice != "null":
                    close = difflib.get_close_matches(choice, valid, n=2, cutoff=0.6)
                    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
                    raise ConfigError(f"unknown {name} {choice!r}; valid {name} options: {', '.join(valid)}{hint}")
            groups[name] = [c for c in _choices(o) if c != "null"] or groups.get(name, [])
    keyed = [
        (arg, o)
        for arg, o in zip(given, overrides)
        if o.key_or_group not in known and "/" not in o.key_or_group and not o.key_or_group.startswith("hydra.")
    ]
    if not keyed:
        return argv
    searched = _search_path_override(args, dirs)
    fixed = [_first_value(arg, o) for arg, o in keyed]  # every job's own values: experiments.train.check_sweep
    names = list(groups)
    combos = list(itertools.islice(itertools.product(*(groups[n] for n in names)), MAX_COMPOSED)) or [()]
    failed: list[tuple[str, str]] = []  # (the choices, the key a composition lacked)
    for combo in combos:
        chosen = [f"{n}={c}" for n, c in zip(names, combo)]
        try:
            composed = _compose([*searched, *chosen, *fixed])
        except HydraException as exc:
            key = _missing_key(exc)
            if key is None:
                raise ConfigError(_hydra_line(exc, keyed)) from None
            failed.append((" ".join(chosen), key))
            continue
        try:
            parse({k: v for k, v in composed.items() if k != "hydra"})
        except ConfigError as exc:
            raise ConfigError(_nothing_reads(str(exc), keyed)) from None
    if failed:
        chosen, key = failed[0]
        if len(failed) < len(combos):
            raise ConfigError(
                f"{key} exists with some of the swept choices but not with {chosen}; sweep those separately"
            )
        keys = _keys(_compose([*searched, *(f"{n}={groups[n][0]}" for n in names)])) | set(schema_keys())
        raise ConfigError(f"unknown key {key!r} (the config has no such key); {suggest(key, sorted(keys))}")
    return argv


def _first_value(arg: str, override) -> str:
    """A swept override (`key=a,b`) at its first value; any other as it is."""
    if not override.is_sweep_override():
        return arg
    values = _choices(override)
    return f"{arg.partition('=')[0]}={values[0]}" if values else arg.partition("=")[0].lstrip("+~") + "=null"


def _hydra_line(exc: Exception, keyed: list) -> str:
    """A Hydra composition error as one line: `+key` on a key the config has, or Hydra's own first line."""
    text = str(exc)
    m = re.search(r"An item is already at '([^']+)'", text)
    if m:
        return f"+{m.group(1)}: the config has {m.group(1)} already; override it without the +: {m.group(1)}=..."
    cause = exc.__cause__
    if cause is not None and getattr(cause, "full_key", None):
        return str(one_line(cause, _given(keyed)))
    return " ".join(text.split("\n")[0].split())


def _given(keyed: list) -> dict:
    """The command line's keyed overrides as a nested mapping (the values as the user typed them)."""
    out: dict = {}
    for _, o in keyed:
        node = out
        *parents, last = o.key_or_group.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = o.value() if not o.is_sweep_override() else None
    return out


def _nothing_reads(line: str, keyed: list) -> str:
    """A key added with `+` that the schema has no place for: nothing reads it (rather than 'no such key')."""
    added = {o.key_or_group for _, o in keyed if o.is_add() or o.is_force_add()}
    m = re.match(r"unknown key '([^']+)' \(the config has no such key\)", line)
    if m and m.group(1) in added:
        return line.replace("(the config has no such key)", "(nothing reads it)", 1)
    return line


def sweep_jobs(argv: list[str]) -> list[tuple[list[str], dict]] | None:
    """Each job of a `-m` sweep as Hydra's basic sweeper will run it: (its overrides, its resolved config); None
    where the sweep is not the basic sweeper's to list (another sweeper, an interval, Hydra's own flags)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    args, dirs = _without_config_dirs([a for a in expand_home(argv) if a not in HYDRA_FLAGS])
    if search_path(argv) is None or any(a.startswith("-") or a.lstrip("+").startswith("hydra/") for a in args):
        return None
    searched = _search_path_override(args, dirs)
    given = [a for a in args if not a.lstrip("+~").startswith("hydra.")]
    parser = OverridesParser.create()
    fixed = [a for a, o in zip(given, parser.parse_overrides(given)) if not o.is_sweep_override()]
    base = compose([*searched, *fixed], hydra_config=True)
    # the sweep a preset defines (hydra.sweeper.params) comes first; the command line's overrides win
    params = base.hydra.sweeper.get("params")
    preset = OmegaConf.to_container(params, resolve=False) if params else {}
    swept = [f"{k}={v}" for k, v in preset.items()] + given
    try:
        batches = BasicSweeper.split_arguments(parser.parse_overrides(swept), None)
    except Exception:  # noqa: BLE001 - an interval or a sampler's distribution: not a list of jobs
        return None
    return [
        (job, OmegaConf.to_container(compose([*searched, *job]), resolve=True)) for batch in batches for job in batch
    ]
