"""Every named preset in conf/experiment/ composes, validates, and sweeps what it says."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from experiments.validate import validate

CONF = Path(__file__).resolve().parent.parent / "conf"
PRESETS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_composes_and_validates(preset):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"experiment={preset}"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    assert params, f"{preset} sweeps nothing"
    assert preset in cfg.hydra.sweep.dir
    # every swept value is a valid choice: compose and validate each one
    for key, values in params.items():
        for value in str(values).split(","):
            with initialize_config_dir(str(CONF), version_base="1.3"):
                job = compose("config", overrides=[f"experiment={preset}", f"{key}={value}"])
            resolved = OmegaConf.to_container(job, resolve=True)
            validate(resolved)
