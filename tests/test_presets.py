"""Every named preset in conf/experiment/ composes, validates, and sweeps what it says (its own sweep, or, for a
reproduction's preset, the sweeps experiments/reproductions/NAME.py runs on it)."""

from __future__ import annotations

import importlib
import itertools
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from experiments import reproduce
from experiments.validate import validate

# validate() of an MPI preset probes mpi4py in a child process (experiments.validate.mpi_import_error)
pytestmark = pytest.mark.processes

CONF = Path(__file__).resolve().parent.parent / "conf"
PRESETS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def reproduction_sweeps(preset: str) -> list[list[str]]:
    """The sweeps (override lists) that reproductions run on `preset`."""
    modules = [importlib.import_module(f"experiments.reproductions.{name}") for name in reproduce.available()]
    return [sweep for m in modules for sweep in m.SWEEPS.values() if f"experiment={preset}" in sweep]


def jobs(overrides: list[str]) -> list[list[str]]:
    """Every job of a sweep given as overrides with comma-separated choices."""
    choices = [[f"{o.split('=', 1)[0]}={v}" for v in o.split("=", 1)[1].split(",")] for o in overrides]
    return [list(job) for job in itertools.product(*choices)]


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_composes_and_validates(preset):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"experiment={preset}"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    assert preset in cfg.hydra.sweep.dir
    if params:
        sweeps = [[f"experiment={preset}"] + [f"{k}={v}" for k, v in params.items()]]
    else:
        sweeps = reproduction_sweeps(preset)
        assert sweeps, f"{preset} sweeps nothing, and no reproduction runs it"
    # every job of every sweep is a valid run: compose and validate each one
    for sweep in sweeps:
        for job_overrides in jobs(sweep):
            with initialize_config_dir(str(CONF), version_base="1.3"):
                job = compose("config", overrides=job_overrides)
            validate(OmegaConf.to_container(job, resolve=True))
