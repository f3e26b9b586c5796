"""The shipped configs state the library's defaults: every key of conf/algorithm/NAME.yaml that the constructor of
ALGORITHMS[NAME] takes has the constructor's default (inspect.signature, following **options to the parent class),
an `outer: {_target_: ...}` builds the same outer optimizer as the constructor's default factory and names only
that optimizer's own keywords, and conf/schedule/*.yaml has dpsgd.schedule's defaults (and torch's MultiStepLR and
CosineAnnealingLR defaults where they mean the same). An algorithm's yaml holds no base-optimizer key (those are the
optimizer= group's, conf/optimizer/), and each optimizer yaml's keys are its torch class's keywords."""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import pytest
import torch
import yaml

from dpsgd.comm import codecs, run_local
from dpsgd.optim import ALGORITHMS, BASE_OPTIMIZERS
from dpsgd.options import factories, import_target
from dpsgd.schedule import Schedule

CONF = Path(__file__).resolve().parent.parent / "conf"


def conf(group: str, name: str) -> dict:
    return yaml.safe_load((CONF / group / f"{name}.yaml").read_text())


def constructor_defaults(cls) -> dict:
    """Keyword -> default of `cls`'s constructor, and of its parents' where it hands **options on to them."""
    out: dict = {}
    for klass in cls.__mro__:
        if "__init__" not in klass.__dict__:
            continue
        parameters = inspect.signature(klass).parameters.values()  # a partialmethod's bound defaults included
        for p in parameters:
            if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD:
                out.setdefault(p.name, p.default)
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    return out


# keys whose constructor default is None because the option is required there (the constructor refuses a
# missing one, saying what to give), or is the default of the codec the option is handed to
REQUIRED = {("choco", "compressor"), ("choco", "ratio")}  # "Choco needs a compressor"; top_k: "ratio ... got None"
HANDED_ON = {("choco", "levels"): (codecs.QSGD, "levels")}
NOT_OPTIONS = ("name", "_target_", "defaults")  # its label, its class, the defaults list that picks its base
# where the app chooses otherwise than a library user's loop, on purpose (the test asserts the difference stands)
APP_CHOICES = {
    ("adpsgd", "budget"): (
        "samples",
        "steps",
        "the app budgets AD-PSGD by samples (all peers' together, the synchronous run's), so that a slow peer "
        "takes fewer steps; a library user's own loop counts its steps",
    ),
}
PAIRS = [pytest.param(name, key) for name in ALGORITHMS for key in conf("algorithm", name) if key not in NOT_OPTIONS]


@pytest.mark.parametrize("name, key", PAIRS, ids=[f"{p.values[0]}.{p.values[1]}" for p in PAIRS])
def test_every_algorithm_key_of_the_yaml_is_the_constructors_default(name, key):
    value, defaults = conf("algorithm", name)[key], constructor_defaults(ALGORITHMS[name])
    assert key in defaults, f"conf/algorithm/{name}.yaml: {key} is not an option of {ALGORITHMS[name].__name__}"
    default = defaults[key]
    if (name, key) in APP_CHOICES:
        app, library, why = APP_CHOICES[name, key]
        assert (value, default) == (app, library), why
    elif (name, key) in REQUIRED:
        assert default is None and value is not None, f"{name}.{key}: required, so the yaml must name one"
    elif (name, key) in HANDED_ON:
        cls, option = HANDED_ON[name, key]
        assert default is None, f"{name}.{key}: default {default!r}, expected None (the codec's own)"
        assert value == inspect.signature(cls).parameters[option].default, f"{name}.{key}: {value!r}"
    elif isinstance(value, dict) and "_target_" in value:
        target = import_target(value["_target_"], key)
        takes = inspect.signature(target).parameters
        assert set(value) - {"_target_"} <= set(takes), f"{name}.{key}: keys {target.__name__} does not take"
        built, configured = run_local(2, _outer_optimizers, name, key, value)[0]
        assert type(built) is type(configured) is target, f"{name}.{key}: {type(built)} vs {type(configured)}"
        assert built.defaults == configured.defaults, (
            f"{name}.{key}: default {built.defaults}, yaml {configured.defaults}"
        )
    else:
        assert (
            value == default
            and type(value) is type(default)
            or (isinstance(value, int | float) and not isinstance(value, bool) and value == default)
        ), f"conf/algorithm/{name}.yaml: {key}: {value!r}, the constructor's default: {default!r}"


def _outer_optimizers(comm, name: str, key: str, value: dict):
    """The outer optimizer `name` builds with its default `key` and with the yaml's (2 peers: BMUF's block momentum
    of null is 1 - 1/n), over one small parameter."""
    out = []
    for options in ({}, factories({key: value})):
        param = torch.nn.Parameter(torch.zeros(4))
        opt = ALGORITHMS[name](torch.optim.SGD([param], lr=0.1), comm=comm, **options)
        out.append(opt.outer_optimizer)
    return out


def test_every_yaml_key_is_checked_above_or_a_base_key():
    """Not vacuous: every algorithm with options of its own is checked, and no yaml holds a base-optimizer key."""
    names = {p.values[0] for p in PAIRS}
    assert names == set(ALGORITHMS) - {"sgp", "gradient_tracking"}  # these two take no option of their own
    for name in ("sgp", "gradient_tracking"):
        assert set(conf("algorithm", name)) == {"name", "_target_"}
    for name in ALGORITHMS:
        assert not {"optimizer", "lr", "momentum", "weight_decay", "nesterov"} & set(conf("algorithm", name)), name


@pytest.mark.parametrize("choice", sorted(p.stem for p in (CONF / "optimizer").glob("*.yaml")))
def test_every_optimizer_yaml_is_its_torch_classs_keywords(choice):
    """conf/optimizer/*.yaml: a base optimizer of BASE_OPTIMIZERS with keywords its torch class takes, each a valid
    value (the class builds with them)."""
    section = conf("optimizer", choice)
    cls = BASE_OPTIMIZERS[section.pop("name")]
    assert set(section) <= set(inspect.signature(cls).parameters), (choice, set(section))
    cls([torch.nn.Parameter(torch.zeros(2))], **section)


# --- schedules ---------------------------------------------------------------------------------------------------
ATTRIBUTE = {"warmup_steps": "warmup", "milestones": "milestones", "gamma": "gamma", "final": "final"}
SCHEDULE_PAIRS = [
    pytest.param(kind, key)
    for kind in ("constant", "step", "cosine")
    for key in conf("schedule", kind)
    if key != "name"
]


@pytest.mark.parametrize("kind, key", SCHEDULE_PAIRS, ids=[f"{p.values[0]}.{p.values[1]}" for p in SCHEDULE_PAIRS])
def test_every_schedule_key_of_the_yaml_is_the_schedules_default(kind, key):
    value = conf("schedule", kind)[key]
    default = getattr(Schedule(kind, 100), ATTRIBUTE[key])
    configured = getattr(
        Schedule.of(kind, {k: v for k, v in conf("schedule", kind).items() if k != "name"}, 100), ATTRIBUTE[key]
    )
    assert configured == (sorted(value) if key == "milestones" else value)  # the yaml as the schedule reads it
    assert default == configured, f"conf/schedule/{kind}.yaml: {key}: {value!r}, the schedule's default: {default!r}"


def test_the_schedules_defaults_are_torchs_where_they_mean_the_same():
    """gamma: MultiStepLR's (and StepLR's) 0.1; final: CosineAnnealingLR's eta_min 0 (a fraction of the rate)."""
    multistep = inspect.signature(torch.optim.lr_scheduler.MultiStepLR).parameters
    cosine = inspect.signature(torch.optim.lr_scheduler.CosineAnnealingLR).parameters
    assert conf("schedule", "step")["gamma"] == Schedule("step", 100).gamma == multistep["gamma"].default
    assert conf("schedule", "cosine")["final"] == Schedule("cosine", 100).final == cosine["eta_min"].default
    assert math.isclose(torch.optim.lr_scheduler.StepLR.__init__.__defaults__[0], 0.1)  # StepLR(gamma=0.1)
