"""optimizer=muon (dpsgd.optim.MuonAdamW): Muon against a numpy statement of torch's documented rule, AdamW on the
rest against torch.optim.AdamW, the split Muon's authors advise, and DiLoCo with it on the fleet as on real peers."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import runs
import torch
from test_fleet import local_parameters

from dpsgd import models
from dpsgd.config import parse
from dpsgd.optim import MuonAdamW, hidden_matrices
from dpsgd.sim import Fleet

torch.set_num_threads(1)


def bfloat16(x) -> np.ndarray:
    """x rounded to bfloat16 (to nearest, ties to even), as float64: torch runs Newton-Schulz in bfloat16."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def newton_schulz(g: np.ndarray, steps: int = 5, eps: float = 1e-7) -> np.ndarray:
    """torch.optim.Muon's documented NS_k^(a,b,c): G scaled to Frobenius norm 1, then k quintic steps
    X <- a X + (b A + c A^2) X with A = X X^T, on the wide orientation; each product rounded to bfloat16."""
    a, b, c = 3.4445, -4.775, 2.0315
    tall = g.shape[0] > g.shape[1]
    x = bfloat16(g.T if tall else g)
    x = bfloat16(x / bfloat16(max(np.linalg.norm(x), eps)))
    for _ in range(steps):
        gram = bfloat16(x @ x.T)
        x = bfloat16(a * x + bfloat16(b * gram + c * gram @ gram) @ x)
    return x.T if tall else x


def muon_steps(w: np.ndarray, grads: list[np.ndarray], lr: float, wd: float, mu: float) -> np.ndarray:
    """torch.optim.Muon's documented loop, Nesterov: B <- mu B + g, O = NS(g + mu B), w <- w (1 - lr wd) - lr' O
    with lr' = lr sqrt(max(1, rows / cols)). B is kept as torch keeps it, (1 - mu) times the documented one
    (B <- mu B + (1 - mu) g, then (1 - mu) g + mu B): the same direction, which NS normalizes, rounded alike."""
    buf = np.zeros_like(w)
    for g in grads:
        buf = mu * buf + (1 - mu) * g
        o = newton_schulz((1 - mu) * g + mu * buf)
        w = w * (1 - lr * wd) - lr * np.sqrt(max(1.0, w.shape[0] / w.shape[1])) * o
    return w


def tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 5), torch.nn.Linear(5, 3))


def test_the_split_muons_authors_advise():
    """Muon on hidden matrices; AdamW on biases, norms, embeddings, position tables, convolutions and the output."""
    mlp = tiny()
    assert hidden_matrices(mlp) == [True, False, True, False, False, False]  # 6x12, 12x5 hidden; 3x5 the output
    lm = models.TinyTransformer(vocab=11, seq_len=8, dim=16, layers=1, heads=2)
    chosen = {name for (name, _), h in zip(lm.named_parameters(), hidden_matrices(lm)) if h}
    assert chosen == {
        "encoder.layers.0.self_attn.in_proj_weight",
        "encoder.layers.0.self_attn.out_proj.weight",
        "encoder.layers.0.linear1.weight",
        "encoder.layers.0.linear2.weight",
    }
    gpt = models.CharGPT(vocab=11, block=8, dim=16, layers=1, heads=2)  # tied output layer: the last Linear is hidden
    chosen = {name for (name, _), h in zip(gpt.named_parameters(), hidden_matrices(gpt)) if h}
    assert chosen == {f"blocks.0.{m}.weight" for m in ("qkv", "attn_out", "up", "mlp_out")}
    cnn = models.build("cnn", (1, 8, 8), 10, seed=0)
    assert sum(hidden_matrices(cnn)) == 0  # its kernels are 4-D and its one Linear is the output


def test_muon_and_adamw_against_their_references():
    """Three steps of MuonAdamW on a tiny MLP: the hidden matrices against numpy's Muon (Newton-Schulz in bfloat16
    as torch computes it: to 1e-5 of the step, where float64 products would miss by 2-4%), the rest bit for bit
    torch.optim.AdamW's."""
    model, twin = tiny(), tiny()
    opt = MuonAdamW(model.parameters(), lr=0.1, weight_decay=0.1, adamw_lr=0.01, hidden=hidden_matrices(model))
    rest = [p for p, h in zip(twin.parameters(), hidden_matrices(twin)) if not h]
    adamw = torch.optim.AdamW(rest, lr=0.01, weight_decay=0.1)
    start = [p.detach().double().numpy().copy() for p in model.parameters()]
    gen = torch.Generator().manual_seed(1)
    grads = [[torch.randn(p.shape, generator=gen) for p in model.parameters()] for _ in range(3)]
    for step in grads:
        for p, q, g in zip(model.parameters(), twin.parameters(), step):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        adamw.step()
    for i, (p, q, h) in enumerate(zip(model.parameters(), twin.parameters(), hidden_matrices(model))):
        got = p.detach().double().numpy()
        if h:
            want = muon_steps(start[i], [s[i].double().numpy() for s in grads], lr=0.1, wd=0.1, mu=0.95)
            moved = np.abs(want - start[i]).max()
            assert moved > 0.1  # the step is not lost in the tolerance
            np.testing.assert_allclose(got - start[i], want - start[i], rtol=0, atol=1e-5 * moved)
        else:
            torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_state_dict_resumes_bit_for_bit():
    model = tiny()
    opt = MuonAdamW(model.parameters(), hidden=hidden_matrices(model))
    gen = torch.Generator().manual_seed(2)

    def step(m, o):
        for p in m.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        o.step()

    step(model, opt)
    clone = copy.deepcopy(model)
    resumed = MuonAdamW(clone.parameters(), hidden=hidden_matrices(clone))
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch loads same-device tensors without a copy
    seed = gen.get_state()
    step(model, opt)
    gen.set_state(seed)
    step(clone, resumed)
    for p, q in zip(model.parameters(), clone.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert {g["lr"] for g in resumed.param_groups} == {0.02, 0.003}  # each group keeps its own lr


def test_bad_split_is_refused_in_one_line():
    model = tiny()
    with pytest.raises(ValueError, match="Muon takes 2-D matrices"):
        MuonAdamW(model.parameters(), hidden=[True] * 6)
    with pytest.raises(ValueError, match="marks 2 parameters but 6"):
        MuonAdamW(model.parameters(), hidden=[True, False])


def diloco_muon(peers: int = 4) -> dict:
    cfg = runs.experiment(runs.algorithm("diloco", period=5), "ring", peers, "fleet", runs.load("optimizer", "muon"))
    cfg["model"] = {"name": "mlp", "hidden": [16, 16]}
    return cfg


def test_diloco_with_muon_on_the_fleet_equals_real_peers():
    """DiLoCo stepping Muon: the fleet (Muon once per peer slice) gives the real peers' (local backend) numbers,
    peers apart between outer steps, so the equality is not that of identical peers."""
    cfg = diloco_muon()
    fleet = Fleet(parse(cfg))
    for step in range(1, 13):
        fleet.step(step)
    got, want = fleet.flat(), local_parameters(cfg, 12)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - got.mean(0)).abs().max() > 1e-4


@pytest.mark.slow  # the training takes 0.3 s, but 4 MPI processes starting torch took 80 s at load 7 on 2 cores
@pytest.mark.processes
def test_diloco_with_muon_on_mpi_equals_the_fleet(app, tmp_path):
    """`algorithm=diloco optimizer=muon` through the app: 4 MPI processes and the fleet give the same summary."""
    args = ["algorithm=diloco", "optimizer=muon", "model.hidden=[16,16]", "epochs=1", "log_every=10"]
    summaries = {}
    for backend in ("mpi", "fleet"):
        proc = app([*args, f"backend={backend}"], tmp_path / backend)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        summaries[backend] = runs.summary(tmp_path / backend)
    mpi, fleet = summaries["mpi"], summaries["fleet"]
    assert mpi["steps"] == fleet["steps"] > 8  # outer steps were taken
    for key in ("train_loss", "test_loss", "test_accuracy", "peer_test_accuracy_mean", "mb_sent_per_peer"):
        assert fleet[key] == pytest.approx(mpi[key], rel=1e-4, abs=1e-6), key
