"""A user's own config folders outside the repository join the app's through Hydra's search path
(`hydra.searchpath=[file://DIR]`, `--config-dir DIR`): their algorithm, topology, model and data options pass
the app's checks and run, a user's own algorithm class (`_target_` in a module of theirs) included."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.validate import ConfigError, check_group_overrides, search_path

EVERY_K = '''"""A user's algorithm, outside the repository: local steps, and an exact average every k-th step."""
import torch

from dpsgd.optim import DistributedOptimizer


class EveryK(DistributedOptimizer):
    def __init__(self, base, *, topology=None, comm, k: int = 3, **options):
        super().__init__(base, topology=topology, comm=comm, **options)
        self.k = k

    def update(self):
        self.base.step()
        self.step_count += 1
        if self.step_count % self.k == 0:
            for p, mean in zip(self.params(), self.comm.allreduce_mean(self.params())):
                p.copy_(mean)
'''


@pytest.fixture
def user(tmp_path) -> Path:
    """A user's folder: a module with their algorithm, an algorithm config naming it (in searched/), a topology
    config (in own/, for --config-dir) and a data config."""
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "usergossip.py").write_text(EVERY_K)
    for folder, group, name, text in (
        (
            "searched",
            "algorithm",
            "every_k",
            "name: every_k\n_target_: usergossip.EveryK\nk: 3\n",
        ),
        ("own", "topology", "wide_torus", "name: torus\nrows: 2\ncols: 2\n"),
        ("own", "data", "digits_skewed", "name: digits\ntest_fraction: 0.2\npartition: dirichlet\nalpha: 0.5\n"),
    ):
        (tmp_path / folder / group).mkdir(parents=True, exist_ok=True)
        (tmp_path / folder / group / f"{name}.yaml").write_text(text)
    return tmp_path


def test_search_path_reads_the_command_lines_folders(tmp_path):
    import experiments

    assert search_path([f"hydra.searchpath=[file://{tmp_path}/a,pkg://experiments]", "--config-dir", "b"]) == [
        tmp_path / "a",
        Path(experiments.__file__).parent,
        Path("b"),
    ]
    assert search_path(["-cd", "c", "--config-dir=d", "++hydra.searchpath=[file:///e]"]) == [
        Path("c"),
        Path("d"),
        Path("/e"),
    ]
    assert search_path(["--config-path", "/x", "algorithm=mine"]) is None  # the user's own primary config


def test_own_options_pass_the_check_and_unknown_ones_name_them(user):
    searched = f"hydra.searchpath=[file://{user / 'searched'}]"
    check_group_overrides([searched, "algorithm=every_k", "--config-dir", str(user / "own"), "topology=wide_torus"])
    with pytest.raises(ConfigError, match="unknown algorithm 'every_k'; valid algorithm options: .*allreduce"):
        check_group_overrides(["algorithm=every_k"])
    with pytest.raises(ConfigError, match="unknown algorithm 'every_kk'; valid algorithm options: .*every_k"):
        check_group_overrides([searched, "algorithm=every_kk"])


def test_a_users_algorithm_from_a_config_outside_the_repository_runs(app, user):
    """From the user's folder (not the repository), with their module importable: the algorithm config found
    through hydra.searchpath, the topology and data configs through --config-dir."""
    args = [
        "--config-dir",
        str(user / "own"),
        f"hydra.searchpath=[file://{user / 'searched'}]",
        "algorithm=every_k",
        "topology=wide_torus",
        "data=digits_skewed",
        "backend=local",
        "epochs=2",
        f"hydra.run.dir={user / 'run'}",
    ]
    env = {**app.env(), "PYTHONPATH": str(user / "code")}
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.train", *args],
        cwd=user,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((user / "run" / "summary.json").read_text())
    assert (summary["algorithm"], summary["topology"], summary["partition"]) == ("every_k", "torus", "dirichlet")
    assert summary["mb_sent_per_peer"] > 0 and summary["test_accuracy"] > 0.5
