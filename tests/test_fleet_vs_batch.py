"""experiments.bench.fleet_vs_batch at a tiny size: its rows, the reference's arithmetic (one model at batch
n*b equals the fleet's peers' mean gradient when every peer holds the same weights), its floor's parts."""

from __future__ import annotations

import json

import torch

from dpsgd.config import parse
from dpsgd.sim import Fleet
from experiments.bench import fleet_vs_batch as bench


def test_rows_and_targets(tmp_path):
    fast = ["--steps", "1", "--repeats", "1", "--bandwidth-mib", "8"]
    rows = []
    for models, peers in ((["mlp"], ["4", "64"]), (["cnn"], ["4"])):  # a target from 64 peers; the CNN small
        out = tmp_path / f"{models[0]}.json"
        assert bench.main(["--models", *models, "--peers", *peers, *fast, "--out", str(out)]) == 0
        rows += json.loads(out.read_text())["rows"]
    assert [(r["model"], r["peers"]) for r in rows] == [("mlp", 4), ("mlp", 64), ("cnn", 4)]
    for r in rows:
        assert {"model", "peers", "device", "ratio", "floor_ratio"} <= set(r)
        assert r["device"] == "cpu" and r["ratio"] > 0 and 0 < r["floor_ratio"]
        assert r["layout"] == "wide" and r["vmap_ratio"] > 0  # both models take the wide layout
        assert all(v > 0 for v in r["floor_bytes"].values()), r["floor_bytes"]
        assert (r["target"] is None) == (r["peers"] < bench.TARGET_FROM)
        if r["target"] is not None and not r["target"]["holds"]:
            assert "ms" in r["target"]["cause"]  # a measured cause


def test_the_reference_does_the_fleets_arithmetic():
    """Peers with equal weights (the fleet's start): the one model's gradient at batch n*b is the mean of theirs."""
    torch.manual_seed(0)
    fleet = Fleet(parse(bench.config("cnn", 4, 8, "cpu")))
    x, y = fleet.batches.next()
    fleet.gradients(x, y)
    ref = bench.Reference(fleet, lr=0.1, momentum=0.9)
    ref.gradients(x.reshape(-1, *x.shape[2:]), y.reshape(-1, *y.shape[2:]))
    for p, q in zip(fleet.params, ref.model.parameters()):
        torch.testing.assert_close(p.grad.mean(0), q.grad, rtol=1e-4, atol=1e-6)
