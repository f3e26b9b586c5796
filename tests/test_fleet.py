"""The fleet (dpsgd.sim.Fleet) against the real thing: for every algorithm, its peers' parameters after
20 steps equal those of n threads of the `local` backend running dpsgd.training's peers with the same
config and seed (n = 4 and 8); plus its batches, byte counts and refusals. (A user's own algorithm on
the fleet and every real backend: test_contract.py.)"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import runs
import torch

from dpsgd import data
from dpsgd.build import build_peer
from dpsgd.comm import run_local
from dpsgd.config import parse
from dpsgd.sim import Fleet
from dpsgd.sim.batches import FleetBatches

torch.set_num_threads(1)
STEPS = 20


def config(algorithm: str, topology: str = "ring", peers: int = 4, optimizer: dict | None = None, **algo) -> dict:
    """`algorithm` with its options `algo`, stepping the base optimizer its yaml picks (with `optimizer`'s keys,
    where `optimizer` names no other: {"name": "adam", "lr": 0.01})."""
    cfg = runs.experiment(runs.algorithm(algorithm, **algo), topology, peers, "fleet")
    if optimizer:
        base = runs.load("optimizer", optimizer["name"]) if "name" in optimizer else cfg["optimizer"]
        cfg["optimizer"] = {**base, **optimizer}
    return cfg


def local_parameters(cfg: dict, steps: int) -> list[torch.Tensor]:
    """(n, D) parameters of the real peers (local backend threads) after `steps` training steps."""

    def peer(comm):
        p = build_peer(comm, parse(cfg))
        for step in range(1, steps + 1):
            p.step(step)
        return torch.cat([t.detach().reshape(-1) for t in p.model.parameters()])

    return torch.stack(run_local(cfg["peers"], peer, timeout_s=60))


def assert_fleet_equals_local(cfg: dict, steps: int, peers_differ: bool = True) -> None:
    """The fleet's (n, D) parameters after `steps` equal the real peers' (local backend); with `peers_differ`, the
    peers really differ (equality is not the trivial one of identical peers)."""
    fleet = Fleet(parse(cfg))
    for step in range(1, steps + 1):
        fleet.step(step)
    got, expected = fleet.flat(), local_parameters(cfg, steps)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if peers_differ:
        assert (got - got.mean(0)).abs().max() > 1e-4


GOSSIP = ("dpsgd", "qgm", "sgp", "choco", "d2", "gradient_tracking")
CASES = {
    "allreduce": ("allreduce", "ring", {}),
    "dpsgd-cta": ("dpsgd", "ring", {}),
    "dpsgd-atc": ("dpsgd", "one_peer_exponential", {"order": "atc"}),
    "dpsgd-nesterov-wd": ("dpsgd", "exponential", {"optimizer": {"nesterov": True, "weight_decay": 1e-3}}),
    "qgm": ("qgm", "ring", {}),
    "local_sgd": ("local_sgd", "ring", {"warmup_steps": 3}),
    "local_sgd-state-avg-groups": (
        "local_sgd",
        "ring",
        {"inner_state": "average", "group_size": 2, "global_period": 8},
    ),
    "local_sgd-reset": ("local_sgd", "ring", {"inner_state": "reset", "optimizer": {"name": "adam", "lr": 0.01}}),
    "slowmo": ("slowmo", "ring", {}),
    "bmuf": ("bmuf", "ring", {}),
    "diloco": ("diloco", "ring", {}),
    "streaming_diloco": ("streaming_diloco", "ring", {"period": 4, "fragments": 2, "delay": 1}),
    "streaming_diloco-adam-outer": (
        "streaming_diloco",
        "ring",
        {"period": 4, "fragments": 2, "delay": 1, "outer": {"_target_": "torch.optim.Adam", "lr": 0.01}},
    ),
    "sgp": ("sgp", "directed_exponential", {}),
    "choco-top_k": ("choco", "ring", {}),
    "choco-random_k": ("choco", "exponential", {"compressor": "random_k", "ratio": 0.2}),
    "choco-qsgd": ("choco", "ring", {"compressor": "qsgd"}),
    "d2": ("d2", "ring", {}),
    "gradient_tracking": ("gradient_tracking", "one_peer_exponential", {}),
}


@pytest.mark.parametrize("peers", [4, 8])
@pytest.mark.parametrize("case", list(CASES))
def test_fleet_equals_local_backend(case, peers):
    algorithm, topology, options = CASES[case]
    assert_fleet_equals_local(config(algorithm, topology, peers, **options), STEPS, peers_differ=algorithm in GOSSIP)


def test_batches_match_each_peers_own():
    split = data.load("digits", 0.2, 1)
    shares = data.partition(split.y_train.numpy(), 5, 1, "dirichlet", alpha=1.0, min_size=8)
    fleet = FleetBatches(split.x_train, split.y_train, shares, 8, seed=1)
    own = [data.Batches(split.x_train[s], split.y_train[s], 8, seed=1 * 1000 + r + 1) for r, s in enumerate(shares)]
    for _ in range(40):  # several passes of the smallest share (unequal shares reshuffle at different steps)
        x, y = fleet.next()
        for r, b in enumerate(own):
            bx, by = b.next()
            assert torch.equal(x[r], bx) and torch.equal(y[r], by)


def test_bytes_are_counted_as_the_communicators_count_them():
    for algorithm, topology in (("dpsgd", "one_peer_exponential"), ("allreduce", "ring"), ("choco", "ring")):
        cfg = config(algorithm, topology, 8)
        fleet = Fleet(parse(copy.deepcopy(cfg)))
        for step in range(1, 3 + 1):
            fleet.step(step)

        def peer(comm, cfg=cfg):
            p = build_peer(comm, parse(cfg))
            for step in range(1, 3 + 1):
                p.step(step)
            return comm.stats.bytes_sent, comm.stats.bytes_received

        real = torch.tensor(run_local(8, peer, timeout_s=60), dtype=torch.float64)
        torch.testing.assert_close(fleet.comm.bytes_sent, real[:, 0].floor(), atol=1.0, rtol=0)
        torch.testing.assert_close(fleet.comm.bytes_received, real[:, 1].floor(), atol=1.0, rtol=0)


def test_invalid_options_fail_as_in_real_runs():
    with pytest.raises(ValueError, match="Choco keeps s_i"):
        Fleet(parse(config("choco", "one_peer_exponential")))


@pytest.mark.parametrize("algorithm", ["dpsgd", "adpsgd"])
def test_files_have_the_keys_of_a_real_run(algorithm, tmp_path):
    import json

    from dpsgd.sim import train_fleet
    from dpsgd.training import train

    cfg = config(algorithm, "ring", 4)
    cfg["epochs"], cfg["log_every"] = 2, 5
    (tmp_path / "local").mkdir()
    (tmp_path / "fleet").mkdir()
    local_cfg = copy.deepcopy(cfg)
    local_cfg["backend"] = {"name": "local"}
    run_local(4, train, parse(local_cfg), tmp_path / "local", timeout_s=60)
    train_fleet(parse(cfg), tmp_path / "fleet")
    records = {
        k: [json.loads(r) for r in (tmp_path / k / "metrics.jsonl").read_text().splitlines()]
        for k in ("local", "fleet")
    }
    summaries = {k: json.loads((tmp_path / k / "summary.json").read_text()) for k in ("local", "fleet")}
    assert {frozenset(r) for r in records["fleet"]} == {frozenset(r) for r in records["local"]}
    assert set(summaries["fleet"]) == set(summaries["local"])
    if algorithm == "adpsgd":
        assert set(summaries["fleet"]["adpsgd"]) == set(summaries["local"]["adpsgd"])
    assert summaries["fleet"]["backend"] == "fleet" and summaries["fleet"]["test_accuracy"] > 0.5
    if algorithm == "dpsgd":  # the same numbers: same steps, bytes, and (to float tolerance) accuracy
        for key in (
            "steps",
            "samples",
            "mb_sent_per_peer",
            "peak_mb_sent_per_step",
            "test_accuracy",
            "peer_test_accuracy_mean",
        ):
            assert summaries["fleet"][key] == pytest.approx(summaries["local"][key], rel=1e-4), key


def test_hydra_app_runs_backend_fleet(tmp_path):
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.train",
            "backend=fleet",
            "peers=32",
            "batch_size=8",
            "epochs=3",
            "topology=one_peer_exponential",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=Path(__file__).parent.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert (run_dir / "config.yaml").exists() and (run_dir / "metrics.jsonl").exists()
    assert "fleet" in (run_dir / "summary.json").read_text()
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.train",
            "backend=fleet",
            "checkpoint.every=5",
            f"hydra.run.dir={tmp_path / 'bad'}",
        ],
        cwd=Path(__file__).parent.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "backend=fleet keeps no checkpoints" in bad.stderr


def test_threads_are_every_core_unless_backend_threads_says():
    from dpsgd.backends.fleet import threads

    assert threads({"name": "fleet", "threads": None}) == (os.cpu_count() or 1)
    assert threads({"name": "fleet"}) == (os.cpu_count() or 1)
    assert threads({"name": "fleet", "threads": 3}) == 3
    for wrong in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="backend.threads must be a whole number >= 1"):
            threads({"name": "fleet", "threads": wrong})
