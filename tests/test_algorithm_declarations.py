"""What the experiments read of an algorithm is its class's own declaration (DistributedOptimizer's `label`,
`knobs` and `cost_form`): every registered algorithm declares all three, and a class registered here shows up in
the report's captions, the tuner's search and the map by itself; a class that declares nothing reads as its name,
its learning rate alone, off the map."""

from __future__ import annotations

import pytest
import torch

from dpsgd.optim import ALGORITHMS, DistributedOptimizer
from experiments import captions, tune
from experiments import map as gossip_map
from experiments.cost_model import KINDS, Algorithm


class Tidal(DistributedOptimizer):
    """A test's own algorithm: local steps and an exact average every `period`-th step."""

    label = "tidal averaging"
    knobs = {"period": (3, 6)}
    cost_form = "periodic"

    def __init__(self, base, *, period: int = 6, **common):
        super().__init__(base, **common)
        self.period = period

    def update(self) -> None:
        self.base.step()
        self.step_count += 1
        if self.step_count % self.period == 0:
            for p, mean in zip(self.params(), self.comm.allreduce_mean(self.params())):
                p.copy_(mean)


class Bare(DistributedOptimizer):
    """A user's algorithm that declares nothing the experiments read."""

    def update(self) -> None:
        self.base.step()
        self.step_count += 1


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_algorithm_declares_its_label_knobs_and_cost_form_in_its_own_class(name):
    """In its own class body: a subclass (QGM of DPSGD, DiLoCo of LocalSGD) must not pass for its parent."""
    cls = ALGORITHMS[name]
    missing = {"label", "knobs", "cost_form"} - set(vars(cls))
    assert not missing, f"{cls.__name__} does not declare {sorted(missing)} (see DistributedOptimizer)"
    assert isinstance(cls.label, str) and cls.label.strip(), f"{cls.__name__}.label"
    assert captions.algorithm_words(name) == cls.label and captions.words("algorithm", name) == cls.label
    assert all(isinstance(k, str) and len(grid) > 1 for k, grid in cls.knobs.items()), f"{cls.__name__}.knobs"
    assert cls.cost_form is None or cls.cost_form in KINDS, f"{cls.__name__}.cost_form {cls.cost_form!r}"
    knobs = {f"algorithm.{k}": list(grid) for k, grid in cls.knobs.items()}
    assert tune.search_space(name, [0.1], None) == {"optimizer.lr": [0.1], **knobs}


def test_labels_tell_the_algorithms_apart():
    """A report groups runs by their words: two algorithms with one label would read as one."""
    labels = [cls.label for cls in ALGORITHMS.values()]
    assert len(set(labels)) == len(labels), labels


def test_a_declared_algorithm_shows_up_in_captions_tune_and_map_by_itself(monkeypatch):
    monkeypatch.setitem(ALGORITHMS, "tidal", Tidal)
    assert captions.words("algorithm.name", "tidal") == "tidal averaging"
    assert captions.legend({"config": {}, "summary": {"algorithm": "tidal"}}, {"algorithm": "tidal"}) == (
        "tidal averaging"
    )
    assert tune.search_space("tidal", [0.1], None) == {"optimizer.lr": [0.1], "algorithm.period": [3, 6]}
    assert tune.search_space("tidal", [0.1], [2, 4]) == {"optimizer.lr": [0.1], "algorithm.period": [2, 4]}
    assert "tidal" in gossip_map.eligible()
    assert gossip_map.chosen("allreduce,tidal") == (
        Algorithm("allreduce", ("algorithm=allreduce",), "allreduce"),
        Algorithm("tidal H=6", ("algorithm=tidal", "algorithm.period=6"), "periodic", period=6),
    )


def test_a_class_that_declares_nothing_reads_as_its_name_the_lr_alone_off_the_map(monkeypatch):
    monkeypatch.setitem(ALGORITHMS, "bare", Bare)
    assert captions.algorithm_words("bare") == "bare" and captions.algorithm_words("not_registered") == "not_registered"
    assert tune.search_space("bare", [0.1, 1.0], [2, 4]) == {"optimizer.lr": [0.1, 1.0]}
    assert "bare" not in gossip_map.eligible()
    with pytest.raises(SystemExit, match=r"^error: --algorithms bare: .*; eligible: allreduce, dpsgd, "):
        gossip_map.chosen("dpsgd,bare")
    assert tune.knobs("not_registered") == {}


def test_the_tests_own_algorithm_steps():
    """The test's own class is a working optimizer (its declarations describe something real)."""
    from dpsgd.comm import run_local

    def peer(comm):
        w = torch.nn.Parameter(torch.full((2,), float(comm.rank)))
        opt = Tidal(torch.optim.SGD([w], lr=0.1), comm=comm, period=2, broadcast_initial=False)
        for _ in range(2):
            w.grad = torch.ones(2)
            opt.step()
        return w.detach().clone()

    got = run_local(2, peer, timeout_s=60)
    assert torch.allclose(got[0], got[1]) and torch.allclose(got[0], torch.full((2,), 0.5 - 0.2))
