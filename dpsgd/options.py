"""A config choice's own keys (dpsgd.config.Choice) checked against what builds the part: the class or function a
`_target_` names is imported here, and a key its signature does not take, or a value of the wrong type for its
annotation, is refused in one line naming the key and the options it does take."""

from __future__ import annotations

import functools
import inspect
import pkgutil
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def import_target(target: str, what: str):
    """The class a `_target_` names ('package.module.Class'), or a one-line error."""
    try:
        if "." not in str(target):
            raise ValueError("no module named")
        return pkgutil.resolve_name(str(target))
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(
            f"{what}._target_={target!r} cannot be imported ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0]}); give 'package.module.Class' importable here"
        ) from None


def accepted(fn: Callable) -> dict[str, inspect.Parameter]:
    """The keyword parameters `fn` takes: where a class's constructor hands `**options` on to its parent's (every
    optimizer's `**common`, QGM's to DPSGD's), the parents' too, listed first (the common ones, then its own)."""
    parameters = dict(inspect.signature(fn).parameters)
    for parent in inspect.getmro(fn)[1:] if inspect.isclass(fn) else ():
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            break
        own = {k: p for k, p in parameters.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
        parameters = {**inspect.signature(parent).parameters, **own}
    return {k: p for k, p in parameters.items() if p.kind is not inspect.Parameter.POSITIONAL_ONLY}


def check_options(what: str, fn: Callable, options: Mapping, *, set_here: Sequence[str] = (), key: str = "") -> None:
    """The keys of `options` that `fn` does not take, refused by name with the ones it does (where a TypeError said
    only "__init__() got an unexpected keyword argument"), and a value whose type its annotation rules out.
    `set_here`: arguments the app passes itself, not listed; `key`: the config section, for the message."""
    parameters = accepted(fn)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return  # it hands unnamed keywords on: it refuses them itself
    refuse_unknown(what, options, list(parameters), listed=[k for k in parameters if k not in set_here])
    hints = _hints(fn)
    for name, value in options.items():
        expected = hints.get(name)
        if expected is not None and not _fits(value, expected):
            raise ValueError(f"{key + '.' if key else ''}{name} must be {_words(expected)}, got {value!r}")


def refuse_unknown(what: str, options: Mapping, accepted: Sequence[str], listed: Sequence[str] | None = None) -> None:
    """Refuse by name the keys of `options` not among `accepted`, saying the options (`listed`, or `accepted`)."""
    unknown = [k for k in options if k not in accepted]
    if unknown:
        takes = ", ".join(accepted if listed is None else listed) or "none"
        raise ValueError(f"{what} takes no option {', '.join(map(repr, unknown))}; its options: {takes}")


def factories(options: Mapping, what: str = "algorithm") -> dict:
    """The options with each `_target_` dict (e.g. `outer: {_target_: torch.optim.SGD, lr: 0.7}`) made the factory
    it names: the class with the dict's other keys bound (functools.partial)."""
    made = {}
    for key, value in options.items():
        if isinstance(value, Mapping) and "_target_" in value:
            rest = {k: v for k, v in value.items() if k != "_target_"}
            value = functools.partial(import_target(value["_target_"], f"{what}.{key}"), **rest)
        made[key] = value
    return made


_SIMPLE = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _hints(fn: Callable) -> dict[str, Any]:
    """`fn`'s annotations that are simple types (int, float, bool, str, optionally None); the others are the
    constructor's to check."""
    target = fn.__init__ if inspect.isclass(fn) else fn
    try:
        hints = typing.get_type_hints(target)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve here: nothing to check by type
        return {}
    out = {}
    for name, kind in hints.items():
        args = set(typing.get_args(kind)) - {type(None)}
        base = next(iter(args)) if len(args) == 1 else kind
        if base in _SIMPLE:
            out[name] = kind
    return out


def _fits(value: Any, kind: Any) -> bool:
    args = set(typing.get_args(kind))
    if value is None:
        return type(None) in args
    base = next(iter(args - {type(None)})) if args else kind
    if base is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, base)


def _words(kind: Any) -> str:
    args = set(typing.get_args(kind))
    base = next(iter(args - {type(None)})) if args else kind
    return _SIMPLE[base] + (", or null" if type(None) in args else "")
