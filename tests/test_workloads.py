"""Workloads where the algorithms differ. `heterogeneous_regression` (peers whose own least-squares problems
have different minimizers, the global one known): its optima are those it claims; the fleet and real peers
(local backend threads, and 4 mpi processes) follow an independent numpy reference of D-PSGD and gradient
tracking on it, and report its distances to the optimum; the reference's limits show the theory (D-PSGD
biased by the heterogeneity, gradient tracking exact). Language workloads report perplexity."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import runs
import torch

import topologies
from dpsgd import data, metrics, models
from dpsgd.build import build_peer
from dpsgd.comm import run_local
from dpsgd.config import parse
from dpsgd.sim import Fleet, train_fleet

torch.set_num_threads(1)
FEATURES, SAMPLES, LR = 8, 40, 0.02


def problem(peers: int, h: float, seed: int = 0):
    """The dataset's training blocks as numpy: designs Z (peers, m, features + 1; the last column the bias's 1),
    targets y (peers, m), and the optimum it claims."""
    split = data.load(
        "heterogeneous_regression",
        seed=seed,
        peers=peers,
        samples_per_peer=SAMPLES,
        num_features=FEATURES,
        heterogeneity=h,
    )
    x = split.x_train.double().numpy().reshape(peers, -1, FEATURES)
    z = np.concatenate([x, np.ones((*x.shape[:2], 1))], axis=2)
    return z, split.y_train.double().numpy().reshape(peers, -1), split.optimum.double().numpy()


def lstsq(z: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.linalg.lstsq(z, y, rcond=None)[0]


def test_peers_optima_lie_h_apart_around_the_known_global_optimum():
    for h in (0.0, 0.5, 3.0):
        z, y, optimum = problem(8, h)
        own = np.stack([lstsq(z[i], y[i]) for i in range(8)])
        global_optimum = lstsq(z.reshape(-1, z.shape[-1]), y.reshape(-1))  # of the mean of the peers' losses
        np.testing.assert_allclose(global_optimum, optimum, atol=1e-5)
        spread = math.sqrt(((own - optimum) ** 2).sum(1).mean())
        assert spread == pytest.approx(h, abs=1e-5)
    _, _, other = problem(8, 3.0, seed=1)
    assert not np.allclose(other, optimum)  # the seed draws the problem
    with pytest.raises(ValueError, match="samples_per_peer >= 11"):
        data.load("heterogeneous_regression", peers=2, samples_per_peer=10, num_features=FEATURES)


def test_the_validator_keeps_the_peers_problems_apart(hydra_config):
    from experiments.validate import ConfigError, validate

    args = ("backend=fleet", "model=linear", "data=heterogeneous_regression")
    validate(hydra_config(*args))
    with pytest.raises(ConfigError, match="needs data.partition=blocks, got 'iid'"):
        validate(hydra_config(*args, "data.partition=iid"))
    with pytest.raises(ConfigError, match="set data.validation_fraction=0"):
        validate(hydra_config(*args, "data.validation_fraction=0.2"))


# --- the numpy reference: full-batch D-PSGD (cta) and gradient tracking with SGD, from the equations --------
def gradients(x: np.ndarray, z: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Each peer's gradient of its mean squared error (1/m) |z_i x_i - y_i|^2 at x_i."""
    return 2 * np.einsum("nmd,nm->nd", z, np.einsum("nmd,nd->nm", z, x) - y) / z.shape[1]


def reference(algorithm: str, z, y, w: np.ndarray, x0: np.ndarray, steps: int) -> np.ndarray:
    """Peers' parameters after `steps` steps, from x_i^0 = x0."""
    x = np.tile(x0, (len(z), 1))
    tracker = previous = gradients(x, z, y)
    for _ in range(steps):
        if algorithm == "dpsgd":  # x^{k+1} = W x^k - lr g(x^k)
            x = w @ x - LR * gradients(x, z, y)
        else:  # x^{k+1} = W (x^k - lr y^k); y^{k+1} = W y^k + g^{k+1} - g^k
            x = w @ (x - LR * tracker)
            g = gradients(x, z, y)
            tracker, previous = w @ tracker + g - previous, g
    return x


def distances(x: np.ndarray, optimum: np.ndarray) -> tuple[float, float]:
    """(|mean of x_i - x*|, sqrt(mean_i |x_i - x*|^2)): what the runs report as optimum_distance and
    peer_optimum_distance."""
    return float(np.linalg.norm(x.mean(0) - optimum)), math.sqrt(((x - optimum) ** 2).sum(1).mean())


def test_reference_dpsgd_stops_short_by_the_heterogeneity_and_tracking_does_not():
    w = topologies.make("ring", 8).mixing_matrix(0)
    bias = {}
    for h in (0.0, 1.0, 2.0):
        z, y, optimum = problem(8, h)
        x0 = np.zeros(z.shape[-1])
        dpsgd, tracking = (reference(a, z, y, w, x0, 1500) for a in ("dpsgd", "gradient_tracking"))
        further = reference("dpsgd", z, y, w, x0, 3000)
        np.testing.assert_allclose(further, dpsgd, atol=1e-9)  # converged: this is D-PSGD's limit
        bias[h] = distances(dpsgd, optimum)
        assert max(distances(tracking, optimum)) < 1e-4  # float32 data: x* to about 1e-7 relative
    assert bias[0.0][0] < 1e-6 and bias[0.0][1] < 1e-6  # one problem for all: no bias
    for h in (1.0, 2.0):
        assert bias[h][0] > 0.01 * h and bias[h][1] > 0.02 * h  # the averaged model is biased too (the H_i differ)
        assert bias[h][1] == pytest.approx(h * bias[1.0][1], rel=1e-3)  # and the bias grows as h


# --- the optimizers on the fleet and on real peers, against the reference -------------------------------------
def config(algorithm: str, peers: int, h: float, steps: int, backend: str = "fleet") -> dict:
    cfg = runs.experiment(runs.algorithm(algorithm), "ring", peers, backend)
    cfg["optimizer"] = {"name": "sgd", "lr": LR, "momentum": 0.0}
    cfg["model"] = runs.load("model", "linear")
    cfg["data"] = {**runs.load("data", "heterogeneous_regression"), "heterogeneity": h}
    cfg.update(batch_size=int(SAMPLES * 0.8), epochs=steps, log_every=steps // 4, seed=0)
    return cfg


def initial(cfg: dict) -> np.ndarray:
    return Fleet(parse(copy.deepcopy(cfg))).flat()[0].double().numpy()


@pytest.mark.parametrize("algorithm", ["dpsgd", "gradient_tracking"])
def test_fleet_and_local_peers_follow_the_reference(algorithm):
    steps, peers = 15, 4
    cfg = config(algorithm, peers, 2.0, steps)
    z, y, _ = problem(peers, 2.0)
    w, x0 = topologies.make("ring", peers).mixing_matrix(0), initial(cfg)
    fleet = Fleet(parse(copy.deepcopy(cfg)))
    for step in range(1, steps + 1):
        fleet.step(step)
        expected = reference(algorithm, z, y, w, x0, step)
        np.testing.assert_allclose(fleet.flat().double().numpy(), expected, rtol=1e-4, atol=1e-5, err_msg=str(step))
    assert np.abs(expected - expected.mean(0)).max() > 1e-3  # the peers differ: not a trivial agreement

    def peer(comm):
        p = build_peer(comm, parse(cfg))
        for step in range(1, steps + 1):
            p.step(step)
        return torch.cat([t.detach().reshape(-1) for t in p.model.parameters()])

    local = torch.stack(run_local(peers, peer, timeout_s=60)).double().numpy()
    np.testing.assert_allclose(local, expected, rtol=1e-4, atol=1e-5)


def test_runs_report_the_distances_of_the_reference(tmp_path):
    """A fleet run's records and summary carry the reference's distances to x*; on the local backend, the same."""
    steps, peers = 400, 4
    cfg = config("dpsgd", peers, 1.0, steps)
    z, y, optimum = problem(peers, 1.0)
    w = topologies.make("ring", peers).mixing_matrix(0)
    x0 = initial(cfg)
    summary = train_fleet(parse(cfg), tmp_path)
    records = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [100, 200, 300, 400]
    for r in records:
        average, peer = distances(reference("dpsgd", z, y, w, x0, r["step"]), optimum)
        assert r["optimum_distance"] == pytest.approx(average, rel=1e-3)
        assert r["peer_optimum_distance"] == pytest.approx(peer, rel=1e-3)
    assert summary["optimum_distance"] == records[-1]["optimum_distance"] > 0.01  # biased, as the reference
    local_cfg = {**copy.deepcopy(cfg), "backend": {"name": "local"}}
    local = run_local(peers, lambda comm: _train_local(comm, local_cfg), timeout_s=60)[0]
    for key in ("optimum_distance", "peer_optimum_distance", "consensus_distance", "test_loss"):
        assert local[key] == pytest.approx(summary[key], rel=1e-3), key
    digits = train_fleet(
        parse({**copy.deepcopy(cfg), "data": runs.load("data", "digits"), "epochs": 1, "batch_size": 16})
    )
    assert "optimum_distance" not in digits  # no known optimum: no such key


def test_report_shows_the_distances(tmp_path, capsys):
    from omegaconf import OmegaConf

    from experiments import report

    for algorithm in ("dpsgd", "gradient_tracking"):
        run_dir = tmp_path / algorithm
        run_dir.mkdir()
        cfg = config(algorithm, 4, 1.0, 12)
        OmegaConf.save(OmegaConf.create(cfg), run_dir / "config.yaml")
        train_fleet(parse(cfg), run_dir)
    capsys.readouterr()  # the runs' progress lines
    assert report.main([str(tmp_path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert "dist to x* (avg model)" in table[0] and "dist to x* (peers, rms)" in table[0]
    assert (tmp_path / "optimum_vs_steps.png").read_bytes()[:4] == b"\x89PNG"


def _train_local(comm, cfg):
    from dpsgd.training import train

    return train(comm, parse(cfg))


@pytest.mark.slow  # soak: make test keeps the local peers against the fleet
def test_mpi_peers_give_the_fleets_numbers(app, hydra_config, tmp_path):
    """4 real peers under mpiexec (the app's own launch) record the same trajectory as the fleet: D-PSGD, whose
    peers stay apart on this problem, so that every record's consensus and distances are far from trivial."""
    args = [
        "algorithm=dpsgd",
        "model=linear",
        "data=heterogeneous_regression",
        "data.heterogeneity=2",
        "topology=ring",
        "peers=4",
        "batch_size=32",
        "epochs=60",
        "log_every=10",
        "optimizer=plain_sgd",
        "optimizer.lr=0.02",
    ]
    proc = app(["backend=mpi", *args], tmp_path / "mpi", timeout=120)
    assert proc.returncode == 0, proc.stderr
    (tmp_path / "fleet").mkdir()
    train_fleet(parse(hydra_config(*args, "backend=fleet")), tmp_path / "fleet")
    mpi, fleet = (
        [json.loads(r) for r in (tmp_path / kind / "metrics.jsonl").read_text().splitlines()]
        for kind in ("mpi", "fleet")
    )
    assert json.loads((tmp_path / "mpi" / "summary.json").read_text())["backend"] == "mpi"
    assert [r["step"] for r in mpi] == [r["step"] for r in fleet] == list(range(10, 61, 10))
    for a, b in zip(mpi, fleet):
        for key in ("optimum_distance", "peer_optimum_distance", "consensus_distance", "test_loss", "train_loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-4), (a["step"], key)
    assert min(r["consensus_distance"] for r in mpi) > 5e-4  # the peers differ (heterogeneity)


# --- language models: perplexity ----------------------------------------------------------------------------
def test_perplexity_is_exp_of_the_per_token_cross_entropy():
    text = data.load("tiny_text", num_samples=60, seq_len=12)
    model = models.build("transformer", (12,), text.num_classes, seed=0, dim=16, layers=1, heads=2)
    loss, _, count = metrics.evaluate(model, dict(model.named_parameters()), text.x_test, text.y_test)
    got = metrics.language_metrics(loss / count, text.y_test)["test_perplexity"]
    with torch.no_grad():
        logits = model(text.x_test).double().numpy()
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    targets = text.y_test.numpy()
    nll = -np.take_along_axis(log_p, targets[..., None], -1).mean()
    assert got == pytest.approx(math.exp(nll), rel=1e-4)
    assert 1 < got < 3 * text.num_classes  # an untrained model is near uniform guessing
    assert metrics.language_metrics(0.5, torch.tensor([1, 2])) == {}  # class labels: no perplexity
    assert metrics.language_metrics(0.5, torch.zeros(3, 2)) == {}  # real targets: none


def test_language_runs_report_perplexity(tmp_path):
    cfg = {
        **runs.experiment(runs.load("algorithm", "dpsgd"), "ring", 4, "fleet"),
        "model": {"name": "transformer", "dim": 16, "layers": 1, "heads": 2},
        "data": {"name": "tiny_text", "num_samples": 200, "seq_len": 16},
    }
    cfg["optimizer"] = runs.load("optimizer", "adam")
    summary = train_fleet(parse(cfg), tmp_path)
    records = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["test_perplexity"] == pytest.approx(math.exp(r["test_loss"])) for r in records)
    assert summary["test_perplexity"] == pytest.approx(math.exp(summary["test_loss"]))
    local = run_local(4, lambda comm: _train_local(comm, {**copy.deepcopy(cfg), "backend": {"name": "local"}}))[0]
    assert local["test_perplexity"] == pytest.approx(summary["test_perplexity"], rel=1e-4)
