"""Every named preset in conf/experiment/ composes, validates, and sweeps what it says (its own sweep, or, for a
reproduction's preset, the sweeps experiments/reproductions/NAME.py runs on it)."""

from __future__ import annotations

import importlib
import itertools
from pathlib import Path

import pytest
import torch
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


def cifar10_files(root: Path) -> Path:
    """Random images in CIFAR-10's binary layout, 200 in each of its six files: what a CIFAR-10 preset reads."""
    import numpy as np

    (root / "cifar-10-batches-bin").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        rng.integers(0, 10, (200, 3073), dtype=np.uint8).tofile(root / "cifar-10-batches-bin" / f"{name}.bin")
    return root


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_composes_and_validates(preset, tmp_path):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"experiment={preset}"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    single = not params and preset in cfg.hydra.run.dir  # one run (a baseline, a check) in a folder of its name
    assert single or preset in cfg.hydra.sweep.dir
    # a GPU preset (device=cuda) is validated on the CPU here: everything but the device is checked
    cpu = ["device=cpu"] if cfg.device == "cuda" and not torch.cuda.is_available() else []
    if cfg.data.name == "cifar10" and not cfg.data.root:  # the user's files: here synthetic ones
        cpu.append(f"data.root={cifar10_files(tmp_path)}")
    if params:
        sweeps = [[f"experiment={preset}", *cpu] + [f"{k}={v}" for k, v in params.items()]]
    elif single:
        sweeps = [[f"experiment={preset}", *cpu]]
    else:
        sweeps = reproduction_sweeps(preset)
        assert sweeps, f"{preset} sweeps nothing, and no reproduction runs it"
    # every job of every sweep is a valid run: compose and validate each one
    for sweep in sweeps:
        for job_overrides in jobs(sweep):
            with initialize_config_dir(str(CONF), version_base="1.3"):
                job = compose("config", overrides=job_overrides)
            validate(OmegaConf.to_container(job, resolve=True))
