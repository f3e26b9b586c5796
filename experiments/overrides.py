"""The command line's overrides, checked before Hydra reads them, so that every mistake Hydra itself would report
in several lines (or not at all) ends in the app's one line (experiments.train: exit 2, no output folder):
- an override Hydra's grammar cannot read names the argument and the quoting that works;
- a value that starts with `~` (a home folder: `data.root=~/data`, which the shell leaves alone after a dotted
  key) is expanded here, as the shell would have;
- a key the config does not have (`epochz=3`), and a key added with `+` that nothing reads (`+epochz=3`: only the
  sections whose keys become a constructor's options, OPEN below, take new keys), are refused by name with the
  closest valid keys ("did you mean"); `+` on a key that exists says to drop it;
- a group option that does not exist (`algorithm=dpsgdd`) gets the closest valid ones.
The config is composed for the group choices on the command line (each combination of a sweep's, up to a few)
to know its keys, with the user's own config folders (`hydra.searchpath`, `--config-dir`). Command lines with
Hydra's other flags (--cfg, --config-name, ...) are left to Hydra.
"""

from __future__ import annotations

import difflib
import itertools
import os
import re

from experiments.validate import CONF_DIR, GROUPS, ConfigError, group_options, search_path

# sections whose keys are a constructor's keyword options (which refuses unknown ones itself): `+` may add keys there
OPEN = ("algorithm", "model", "topology", "compression", "robust", "logger", "hydra")
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


def _composed_keys(groups: dict[str, list[str]], hydra: list[str]) -> list[tuple[str, set[str]]]:
    """(the choices, every dotted key of the config) for each combination of the groups' choices (the first
    MAX_COMPOSED), composed with the command line's `hydra` overrides of the search path."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    names, out = list(groups), []
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        for combo in itertools.islice(itertools.product(*(groups[n] for n in names)), MAX_COMPOSED):
            chosen = [f"{n}={c}" for n, c in zip(names, combo)]
            cfg = compose("config", overrides=[*hydra, *chosen])
            out.append((" ".join(chosen), _keys(OmegaConf.to_container(cfg, resolve=False))))
    return out


def _suggest(key: str, keys: set[str]) -> str:
    parent = key.rpartition(".")[0]
    siblings = sorted(k for k in keys if k.rpartition(".")[0] == parent)
    close = difflib.get_close_matches(key, siblings, n=3, cutoff=0.6) or difflib.get_close_matches(
        key, sorted(keys), n=3, cutoff=0.75
    )
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    where = f"under {parent}" if parent else "at the top level"
    shown = ", ".join(s.rpartition(".")[2] for s in siblings[:14]) + (", ..." if len(siblings) > 14 else "")
    return f"{hint}the keys {where}: {shown}"


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
    overrides = _parse([a for a in args if a not in HYDRA_FLAGS])
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
    keyed = [o for o in overrides if o.key_or_group not in known and "/" not in o.key_or_group]
    keyed = [o for o in keyed if not o.key_or_group.startswith("hydra.") and o.package is None]
    if not keyed:
        return argv
    composed = _composed_keys({k: v for k, v in groups.items() if v}, _search_path_override(args, dirs))
    keys = set().union(*(k for _, k in composed))
    removed: set[str] = set()  # keys deleted by an earlier `~key` (which a later `+key=` may add anew)
    for o in keyed:
        key = o.key_or_group
        if o.is_add() and key in removed:
            continue
        if o.is_add() and key in keys:
            raise ConfigError(f"+{key}: the config has {key} already; override it without the +: {key}=...")
        missing = [chosen for chosen, have in composed if key not in have]
        if not missing:
            if o.is_delete():
                removed.add(key)
            continue
        if (o.is_add() or o.is_force_add()) and key.split(".")[0] in OPEN and key.rpartition(".")[0] in keys:
            continue  # a new option of a constructor, which refuses it if it does not take it
        if len(missing) < len(composed):
            raise ConfigError(
                f"{key} exists with some of the swept choices but not with {missing[0]}; sweep those separately"
            )
        what = "nothing reads it" if o.is_add() or o.is_force_add() else "the config has no such key"
        raise ConfigError(f"unknown key {key!r} ({what}); {_suggest(key, keys)}")
    return argv


def sweep_jobs(argv: list[str]) -> list[tuple[list[str], dict]] | None:
    """Each job of a `-m` sweep as Hydra's basic sweeper will run it: (its overrides, its resolved config); None
    where the sweep is not the basic sweeper's to list (another sweeper, an interval, Hydra's own flags)."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    args, dirs = _without_config_dirs([a for a in expand_home(argv) if a not in HYDRA_FLAGS])
    if search_path(argv) is None or any(a.startswith("-") or a.lstrip("+").startswith("hydra/") for a in args):
        return None
    searched = _search_path_override(args, dirs)
    given = [a for a in args if not a.lstrip("+~").startswith("hydra.")]
    parser = OverridesParser.create()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        fixed = [a for a, o in zip(given, parser.parse_overrides(given)) if not o.is_sweep_override()]
        base = compose("config", overrides=[*searched, *fixed], return_hydra_config=True)
        # the sweep a preset defines (hydra.sweeper.params) comes first; the command line's overrides win
        params = base.hydra.sweeper.get("params")
        preset = OmegaConf.to_container(params, resolve=False) if params else {}
        swept = [f"{k}={v}" for k, v in preset.items()] + given
        try:
            batches = BasicSweeper.split_arguments(parser.parse_overrides(swept), None)
        except Exception:  # noqa: BLE001 - an interval or a sampler's distribution: not a list of jobs
            return None
        return [
            (job, OmegaConf.to_container(compose("config", overrides=[*searched, *job]), resolve=True))
            for batch in batches
            for job in batch
        ]
