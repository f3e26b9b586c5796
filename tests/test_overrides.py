"""Every bad command line gets one line (experiments.overrides, called by experiments.train before Hydra)."""

from __future__ import annotations

import os

import pytest

from experiments import overrides
from experiments.validate import ConfigError


@pytest.mark.parametrize(
    "argv, words",
    [
        (["epochz=3"], ["unknown key 'epochz'", "no such key", "did you mean epochs?"]),
        (["+epochz=3"], ["unknown key 'epochz'", "nothing reads it", "did you mean epochs?"]),
        (["optimizer.lrr=0.1"], ["unknown key 'optimizer.lrr'", "did you mean optimizer.lr"]),
        (
            ["algorithm.lr=0.1"],
            ["unknown key 'algorithm.lr'", "the keys under algorithm: _target_, name, order, overlap"],
        ),
        (["epochs=abc"], ["epochs must be an integer >= 1, got 'abc'"]),
        (["+data.rot=x"], ["unknown key 'data.rot'", "nothing reads it", "the keys under data"]),
        (["+epochs=3"], ["the config has epochs already", "epochs=..."]),
        (["algorithm=dpsgdd"], ["unknown algorithm 'dpsgdd'", "did you mean dpsgd"]),
        (["robust=clipped"], ["unknown robust 'clipped'", "did you mean clipped_gossip"]),
        (["data.root=a(b"], ["cannot read the override 'data.root=a(b'", "\"data.root='a(b'\""]),
        (
            ["-m", "algorithm=dpsgd,local_sgd", "algorithm.period=2"],
            ["algorithm.period exists with some of the swept choices but not with algorithm=dpsgd"],
        ),
    ],
)
def test_refused_in_one_line(argv, words):
    with pytest.raises(ConfigError) as caught:
        overrides.check(argv)
    line = str(caught.value)
    assert "\n" not in line
    for w in words:
        assert w in line, (w, line)


@pytest.mark.parametrize(
    "argv",
    [
        ["epochs=3", "algorithm=local_sgd", "algorithm.period=2"],
        ["algorithm=diloco", "~algorithm.outer", "+algorithm.outer={_target_: torch.optim.Adam, lr: 0.01}"],
        ["algorithm=local_sgd", "algorithm.outer={_target_: torch.optim.Adam, lr: 0.01}"],
        ["+algorithm.new_option=0.1"],  # a choice's keys are its constructor's to check (experiments.validate)
        ["+optimizer.dampening=0.1"],
        ["++epochs=3", "hydra.run.dir=x", "hydra/launcher=basic"],
        ["-m", "seed=range(3)", "algorithm=dpsgd,allreduce", "optimizer.lr=0.1,0.2"],
        ["--cfg", "job", "whatever=1"],  # Hydra's own flags: left to Hydra
        ["data=mnist", "data.root=/tmp/x"],
    ],
)
def test_accepted(argv):
    assert overrides.check(argv) == argv


def test_home_is_expanded():
    home = os.path.expanduser("~")
    assert overrides.check(["data=mnist", "data.root=~/data"]) == ["data=mnist", f"data.root={home}/data"]
    assert overrides.expand_home(["+x=~", "a=b~c"]) == [f"+x={home}", "a=b~c"]


@pytest.mark.processes
@pytest.mark.parametrize("arg", ["epochz=3", pytest.param("+epochz=3", marks=pytest.mark.slow)])
def test_app_unknown_key_one_line_exit_2_no_folder(app, tmp_path, arg):
    run_dir = tmp_path / "run"
    proc = app(["backend=local", arg], run_dir, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: unknown key 'epochz'"), proc.stderr
    assert "did you mean epochs?" in lines[0]
    assert not run_dir.exists() and not (tmp_path / "outputs").exists()


def test_a_users_config_folder_joins(tmp_path):
    (tmp_path / "algorithm").mkdir()
    (tmp_path / "algorithm" / "mine.yaml").write_text("defaults:\n  - dpsgd\n  - _self_\norder: atc\nextra_knob: 3\n")
    where = f"hydra.searchpath=[file://{tmp_path}]"
    argv = [where, "algorithm=mine", "algorithm.extra_knob=4"]
    assert overrides.check(argv) == argv
    with pytest.raises(ConfigError, match="did you mean algorithm.extra_knob"):
        overrides.check([where, "algorithm=mine", "algorithm.extra_knb=4"])
    with pytest.raises(ConfigError, match="unknown algorithm 'mien'.*did you mean mine"):
        overrides.check([where, "algorithm=mien"])


def test_config_dir_gets_the_same_one_line_checks(tmp_path):
    """`--config-dir DIR` (the documented other way to add a folder) is checked as `hydra.searchpath` is, alone and
    with it: before, any mistake on such a command line fell through to Hydra's several-line message, exit 1."""
    own, searched = tmp_path / "own", tmp_path / "searched"
    (own / "algorithm").mkdir(parents=True)
    (own / "algorithm" / "mine.yaml").write_text("defaults:\n  - dpsgd\n  - _self_\nextra_knob: 3\n")
    (searched / "topology").mkdir(parents=True)
    (searched / "topology" / "square.yaml").write_text("name: torus\nrows: 2\ncols: 2\n")
    for flag in (["--config-dir", str(own)], ["-cd", str(own)], [f"--config-dir={own}"]):
        argv = [*flag, "algorithm=mine", "algorithm.extra_knob=4"]
        assert overrides.check(argv) == argv
        with pytest.raises(ConfigError, match="unknown key 'epochz'.*did you mean epochs"):
            overrides.check([*flag, "epochz=3"])
        with pytest.raises(ConfigError, match="did you mean algorithm.extra_knob"):
            overrides.check([*flag, "algorithm=mine", "algorithm.extra_knb=4"])
        with pytest.raises(ConfigError, match="cannot read the override 'data.root=a\\(b'"):
            overrides.check([*flag, "data.root=a(b"])
    with pytest.raises(ConfigError, match="--config-dir '.*absent' is not a folder; give the folder that holds"):
        overrides.check(["--config-dir", str(tmp_path / "absent"), "epochs=2"])  # Hydra's message was two lines
    both = ["--config-dir", str(own), f"hydra.searchpath=[file://{searched}]", "algorithm=mine", "topology=square"]
    assert overrides.check([*both, "topology.rows=1", "topology.cols=4"]) == [
        *both,
        "topology.rows=1",
        "topology.cols=4",
    ]
    with pytest.raises(ConfigError, match="did you mean topology.rows"):
        overrides.check([*both, "topology.rowz=1"])


@pytest.mark.parametrize(
    "argv, words",
    [
        (["-m", "topology=ring,hypercube", "peers=6"], ["sweep job 1 of 2", "topology=hypercube", "power of 2"]),
        (["-m", "optimizer.lr=0.1,-1", "seed=0,1"], ["sweep job 2 of 4", "optimizer.lr=-1 seed=0", "> 0"]),
    ],
)
def test_every_job_of_a_sweep_is_checked_before_the_first_runs(argv, words, capsys):
    """The basic sweeper's jobs, listed and validated as each run would be: the bad one is named, nothing runs."""
    from experiments import train

    with pytest.raises(SystemExit) as exit_:
        train.check_sweep(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "nothing was run" in err and all(w in err for w in words), err


def test_a_preset_sweep_is_listed_as_hydra_runs_it():
    """hydra.sweeper.params of an experiment preset come first and the command line's overrides join them."""
    jobs = overrides.sweep_jobs(["-m", "experiment=dpsgd_vs_allreduce", "seed=0,1", "epochs=1"])
    assert jobs is not None and len({tuple(j) for j, _ in jobs}) == len(jobs) > 2
    assert {c["seed"] for _, c in jobs} == {0, 1} and all(c["epochs"] == 1 for _, c in jobs)
    assert overrides.sweep_jobs(["-m", "hydra/sweeper=optuna", "algorithm.lr=interval(0.01,1)"]) is None
