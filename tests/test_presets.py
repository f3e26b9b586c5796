"""Every named preset in conf/experiment/ composes, validates, and sweeps what it says."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from experiments.validate import validate

# validate() of an MPI preset probes mpi4py in a child process (experiments.validate.mpi_import_error)
pytestmark = pytest.mark.processes

CONF = Path(__file__).resolve().parent.parent / "conf"
PRESETS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_composes_and_validates(preset):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"experiment={preset}"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    assert params, f"{preset} sweeps nothing"
    assert preset in cfg.hydra.sweep.dir
    # every job of the sweep is a valid run: compose and validate each one
    keys = list(params)
    for values in itertools.product(*(str(params[k]).split(",") for k in keys)):
        overrides = [f"experiment={preset}"] + [f"{k}={v}" for k, v in zip(keys, values)]
        with initialize_config_dir(str(CONF), version_base="1.3"):
            job = compose("config", overrides=overrides)
        validate(OmegaConf.to_container(job, resolve=True))
