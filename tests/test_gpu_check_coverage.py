"""`make gpu-check` covers every feature (issue 40, item 4): each algorithm of conf/algorithm/, base optimizer of
conf/optimizer/ and robust rule of conf/robust/, fp16 and bf16 with clipping and accumulation in the step, every
sparse topology of conf/topology/ at 8,192 peers on the fleet, the fleet's two wide layouts, diloco's delayed and
eager outer steps, and each trainer of dpsgd/integrations/, each by a check the gpu-check runs (its dry run too).
The checks' configs are composed as the app composes them; nothing is run here (the dry run itself:
tests/test_placement.py, slow). Removing a check, or changing it so that it no longer sets its feature, fails here."""

from __future__ import annotations

import pytest

from experiments.bench import gpu_check, gpu_features, harness

CONF = harness.ROOT / "conf"


def conf_names(group: str) -> set[str]:
    return {path.stem for path in (CONF / group).glob("*.yaml")}


@pytest.fixture(scope="module")
def configs() -> dict:
    """Each fleet check's run config, as the gpu-check composes it."""
    checks = gpu_features.CHECKS.items()
    return {name: harness.run_config(*c.overrides, "device=cpu") for name, c in checks if c.trainer is None}


def test_every_feature_check_is_a_part_of_the_gpu_check():
    assert set(gpu_features.CHECKS) <= set(gpu_check.PARTS)
    assert all(gpu_check.PART_TIMEOUT_S[name] > 0 for name in gpu_features.CHECKS)


def test_every_algorithm_runs(configs):
    assert conf_names("algorithm") - {c.algorithm.name for c in configs.values()} == set()


def test_every_base_optimizer_runs():
    """By its option's file name (plain_sgd and sign_sgd both compose to torch's SGD)."""
    chosen = {
        o.partition("=")[2] for c in gpu_features.CHECKS.values() for o in c.overrides if o.startswith("optimizer=")
    }
    assert conf_names("optimizer") - chosen == set()


def test_diloco_runs_with_a_delayed_outer_step_without_and_with_eager(configs):
    delayed = [c for c in configs.values() if c.algorithm.name == "diloco" and c.algorithm.options["outer_delay"] == 1]
    assert {c.algorithm.options["eager"] for c in delayed} == {False, True}


def test_every_robust_rule_runs_against_a_corrupt_peer(configs):
    guarded = {c.robust.name for c in configs.values() if c.faults.corrupt_peer is not None}
    assert conf_names("robust") - {"none"} - guarded == set()


def test_fp16_and_bf16_run_with_clipping_and_accumulation(configs):
    stepped = {c.precision for c in configs.values() if c.clip_grad_norm and c.accumulate > 1}
    assert {"fp16", "bf16"} <= stepped


def test_every_sparse_topology_runs_at_8192_peers_on_the_fleet(configs):
    """All but complete (dense) and base_k (built dense at 8,192 peers: 14 GB), which runs on fewer peers."""
    large = {c.topology.name for c in configs.values() if c.peers >= 8192 and c.backend.name == "fleet"}
    assert conf_names("topology") - {"complete", "base_k"} - large == set()
    assert "base_k" in {c.topology.name for c in configs.values()}


def test_both_wide_layouts_of_the_fleet_run(configs):
    """dpsgd.sim.wide: the channel layout (the CNN) and the peer-major one (the MLP), each in a check of the fleet's
    steps, which fails where the fleet falls back to vmap."""
    stepped = {configs[name].model.name for name, c in gpu_features.CHECKS.items() if c.trainer is None and not c.loop}
    assert {"cnn", "mlp"} <= stepped


def test_every_trainer_integration_runs():
    modules = {p.stem for p in (harness.ROOT / "dpsgd" / "integrations").glob("*.py")} - {"__init__", "wrap"}
    trainers = {c.trainer for c in gpu_features.CHECKS.values() if c.trainer is not None}
    assert modules - trainers == set()
