"""Configs name their own classes with `_target_`; bad targets fail in one line before any peer starts."""

from __future__ import annotations

import pytest
import torch

from dpsgd.build import build_model, load_data
from dpsgd.comm import run_local
from dpsgd.config import parse
from dpsgd.optim import DPSGD
from dpsgd.options import import_target
from dpsgd.training import train
from experiments.validate import ConfigError, validate

CFG = {
    "seed": 0,
    "peers": 2,
    "epochs": 2,
    "batch_size": 16,
    "log_every": 10,
    "comm": {"timeout_s": 30},
    "backend": {"name": "local"},
    "topology": {"name": "ring"},
    "data": {"name": "digits"},
    "algorithm": {"name": "custom", "_target_": "dpsgd.optim.DPSGD", "order": "atc"},
    "optimizer": {"name": "sgd", "lr": 0.1},
    "model": {"name": "tiny", "_target_": "plugins.TinyNet", "width": 8},
}


def built_model(cfg: dict):
    run = parse(cfg)
    return build_model(run.model, load_data(run.data, run.seed, run.peers), run.seed, run.data.name)


def test_user_classes_train_through_target():
    validate(CFG)
    model = built_model(CFG)
    assert type(model).__name__ == "TinyNet" and model.net[1].out_features == 8
    assert import_target("dpsgd.optim.DPSGD", "algorithm") is DPSGD
    summaries = run_local(2, train, parse(CFG))
    assert summaries[0]["test_accuracy"] > 0.5 and summaries[0]["peers"] == 2
    again = built_model(CFG)  # one seed, one initial model
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


@pytest.mark.parametrize(
    "section, target, words",
    [
        ("algorithm", "nope.Foo", "algorithm._target_='nope.Foo' cannot be imported"),
        ("model", "plugins.Missing", "model._target_='plugins.Missing' cannot be imported"),
        ("model", "torch.nn.Sequential", "has no parameters"),
    ],
)
def test_bad_targets_are_one_line_errors(section, target, words):
    cfg = {**CFG, section: {**CFG[section], "_target_": target}}
    if section == "model":
        cfg["model"] = {"name": "x", "_target_": target}
    with pytest.raises(ConfigError, match=words) as info:
        validate(cfg)
    assert "\n" not in str(info.value)


def test_batch_larger_than_a_share_becomes_the_share():
    """256 peers on digits' 1437 training samples: each peer's batch is its whole share of 5, said once."""
    from dpsgd.build import fitted_batch_size

    cfg = {"peers": 256, "batch_size": 32, "seed": 0, "data": {"name": "digits", "partition": "iid"}}
    size, note = fitted_batch_size(parse(cfg))
    assert size == 5 and "1437 training samples / 256 peers = 5" in note
    cfg = {"peers": 4, "batch_size": 32, "seed": 0, "data": {"name": "digits", "partition": "iid"}}
    assert fitted_batch_size(parse(cfg)) == (32, None)
    cfg = {"peers": 256, "batch_size": 32, "seed": 0, "data": {"name": "digits", "partition": "dirichlet"}}
    assert fitted_batch_size(parse(cfg)) == (32, None)  # non-iid shares differ: the partition's own check speaks


def test_an_unknown_option_of_an_algorithm_that_hands_options_on_is_named():
    """QGM and BMUF pass **options to their parents' constructors: the parents' keywords are the valid ones."""
    from dpsgd.optim import BMUF, QGM
    from dpsgd.options import check_options

    for cls, valid in ((QGM, "beta"), (BMUF, "period")):
        with pytest.raises(ValueError, match=f"takes no option 'foo'; its options: .*{valid}"):
            check_options(cls.__name__, cls, {"foo": 1})
        check_options(cls.__name__, cls, {valid: 1, "broadcast_initial": True})
