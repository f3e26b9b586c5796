"""Each algorithm with public reference code against that code's own numbers: the fixtures in tests/fixtures/
were written by running the authors' code (or the library that ships the algorithm) outside this project on
small fixed inputs, with the harnesses in tools/fidelity/ (each fixture's `meta` names the repository, file,
commit, inputs and command). dpsgd runs the same inputs here, on the local backend and on the fleet. Each check
is shown not to be vacuous: with one of dpsgd's defaults changed (the one the reference pins down), it fails.
The algorithms guide's fidelity table lists every known difference from a reference."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dpsgd.comm import run_local
from dpsgd.sim.fleet import FleetCommunicator

FIXTURES = Path(__file__).parent / "fixtures"
torch.set_num_threads(1)


def fixture(name: str) -> tuple[dict, dict]:
    """(meta, arrays) of tests/fixtures/NAME.npz."""
    with np.load(FIXTURES / f"{name}.npz") as f:
        return json.loads(str(f["meta"])), {k: f[k] for k in f.files if k != "meta"}


def split(x: np.ndarray, shapes) -> list[torch.Tensor]:
    """The tensors of `shapes` from the flat last axis of x (leading axes kept: a fleet's peer axis)."""
    out, at = [], 0
    for shape in shapes:
        size = int(np.prod(shape))
        out.append(torch.from_numpy(np.ascontiguousarray(x[..., at : at + size])).reshape(*x.shape[:-1], *shape))
        at += size
    return out


def as_params(x0: np.ndarray, shapes, lead: tuple[int, ...] = ()) -> list[torch.nn.Parameter]:
    """Parameters holding the flat x0 (each peer the same, `lead` peer axes in front)."""
    return [torch.nn.Parameter(t.expand(*lead, *t.shape).clone()) for t in split(x0, shapes)]


def set_grads(params, g: np.ndarray, shapes) -> None:
    for p, t in zip(params, split(g, shapes)):
        p.grad = t.clone()


def flat(tensors, lead: int = 0) -> np.ndarray:
    return torch.cat([t.detach().reshape(*t.shape[:lead], -1) for t in tensors], -1).numpy().copy()


# --- DeMo: bloc97/DeMo demo.py ---------------------------------------------------------------------------------
DEMO_SHAPES, DEMO_STEPS = ((96, 80), (96,)), 5
DEMO_NAMES = {"compression_decay": "decay", "compression_topk": "topk", "compression_chunk": "chunk"}
DEMO_BASE = ("weight_decay",)  # the reference's keywords that are the base optimizer's in dpsgd


def demo_inputs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The harness's inputs (meta["inputs"]): x0 and the per-step, per-peer targets c (gradient x - c)."""
    numel = sum(int(np.prod(s)) for s in DEMO_SHAPES)
    x0 = np.random.default_rng(0).normal(size=numel).astype(np.float32)
    return x0, np.random.default_rng(1).normal(size=(DEMO_STEPS, n, numel)).astype(np.float32)


def demo_options(case: dict) -> dict:
    return {DEMO_NAMES.get(k, k): v for k, v in case["options"].items() if k not in DEMO_BASE}


def demo_base(params, case: dict, change: dict) -> torch.optim.SGD:
    """Plain SGD at the case's lr, with the reference's weight decay (DeMo applies it decoupled)."""
    decay = change.pop("weight_decay", case["options"].get("weight_decay", 0.0))
    return torch.optim.SGD(params, lr=case["lr"], weight_decay=decay)


def demo_peer(comm, case: dict, **change) -> tuple[np.ndarray, np.ndarray]:
    """This peer's sign step at each step and its parameters after the last, under dpsgd's DeMo."""
    from dpsgd.optim import DeMo

    x0, c = demo_inputs(comm.size)
    params = as_params(x0, DEMO_SHAPES)
    change = dict(change)
    opt = DeMo(demo_base(params, case, change), comm=comm, **{**demo_options(case), **change})
    signs = []
    for k in range(DEMO_STEPS):
        set_grads(params, flat(params) - c[k, comm.rank], DEMO_SHAPES)
        opt.step()
        signs.append(flat([p.grad for p in params]).astype(np.int8))
    return np.array(signs), flat(params)


def demo_fleet(case: dict, **change) -> tuple[np.ndarray, np.ndarray]:
    from dpsgd.optim import DeMo

    n = case["peers"]
    x0, c = demo_inputs(n)
    params = as_params(x0, DEMO_SHAPES, (n,))
    change = dict(change)
    opt = DeMo(demo_base(params, case, change), comm=FleetCommunicator(n), **{**demo_options(case), **change})
    signs = []
    for k in range(DEMO_STEPS):
        set_grads(params, flat(params, 1) - c[k], DEMO_SHAPES)
        opt.step()
        signs.append(flat([p.grad for p in params], 1).astype(np.int8))
    x = flat(params, 1)
    assert all(np.array_equal(s[0], s[j]) for s in signs for j in range(n))  # one sign for every peer
    return np.array(signs)[:, 0], x[0]


def demo_local(case: dict, **change) -> tuple[np.ndarray, np.ndarray]:
    per_rank = run_local(case["peers"], demo_peer, case, timeout_s=120, **change)
    for signs, x in per_rank[1:]:  # every peer takes the same sign step
        assert np.array_equal(signs, per_rank[0][0]) and np.array_equal(x, per_rank[0][1])
    return per_rank[0]


@pytest.mark.parametrize("name", ["n2", "n4", "n4_wd"])
def test_demo_sign_steps_equal_bloc97_demo_bit_for_bit(name):
    """2 and 4 peers, 5 steps, the reference's defaults (decay 0.999, topk 32, chunk 64: 48 x 40 tiles, chunks of
    48) and, n4_wd, decoupled weight decay 0.1 with small blocks: every sign step and the final parameters are the
    reference's exactly, on the local backend and on the fleet."""
    meta, ref = fixture("demo_bloc97")
    case = meta["cases"][name]
    for signs, x in (demo_local(case), demo_fleet(case)):
        assert np.array_equal(signs, ref[f"{name}_signs"])
        assert np.array_equal(x, ref[f"{name}_x"])


@pytest.mark.parametrize(
    "name, change",
    [
        ("n2", {"aggregate": "mean"}),
        ("n4", {"aggregate": "mean"}),
        ("n4", {"decay": 0.99}),
        ("n4_wd", {"weight_decay": 0.0}),
    ],
)
def test_demo_check_fails_with_a_default_changed(name, change):
    """Not vacuous: the all-peer mean (dpsgd's rule before issue 36), another decay, no weight decay."""
    meta, ref = fixture("demo_bloc97")
    signs, x = demo_fleet(meta["cases"][name], **change)
    differ = (signs != ref[f"{name}_signs"]).mean()
    assert differ > 0 or not np.array_equal(x, ref[f"{name}_x"]), change


# --- SparseLoCo: tplr-ai/templar's outer step and codec --------------------------------------------------------
TEMPLAR_SHAPES, TEMPLAR_INNER, TEMPLAR_ROUNDS, TEMPLAR_INNER_LR = ((32, 96), (200,)), 3, 3, 0.05


def templar_inputs(n: int) -> tuple[np.ndarray, np.ndarray]:
    numel = sum(int(np.prod(s)) for s in TEMPLAR_SHAPES)
    x0 = np.random.default_rng(0).normal(size=numel).astype(np.float32)
    c = np.random.default_rng(1).normal(size=(TEMPLAR_INNER * TEMPLAR_ROUNDS, n, numel))
    return x0, (c * (1 + np.arange(n))[None, :, None]).astype(np.float32)


def sparseloco_run(comm, meta: dict, name: str, **change) -> tuple[np.ndarray, np.ndarray]:
    """The model after each outer step and the error feedback after the last (rows: the peers here, one on a
    real peer, all on the fleet) under dpsgd's SparseLoCo with templar's production settings (meta["hparams"])
    and `aggregate: templar`; its outer lr is templar's squared (templar counts it twice, see SparseLoCo)."""
    from dpsgd.optim import SparseLoCo

    h, case = meta["hparams"], meta["cases"][name]
    n, lr = case["peers"], case["outer_learning_rate"]
    x0, c = templar_inputs(n)
    lead = comm.peer_shape
    params = as_params(x0, TEMPLAR_SHAPES, lead)
    options = {
        "period": TEMPLAR_INNER,
        "decay": h["momentum_decay"],
        "topk": h["topk_compression"],
        "chunk": h["target_chunk"],
        "bits": int(np.log2(h["quantization_bins"])),
        "sigmas": float(h["quantization_range"]),
        "aggregate": "templar",
        "outer": lambda ps: torch.optim.SGD(ps, lr=lr * lr),
    }
    opt = SparseLoCo(torch.optim.SGD(params, lr=TEMPLAR_INNER_LR), comm=comm, **{**options, **change})
    anchors = []
    for t in range(TEMPLAR_INNER * TEMPLAR_ROUNDS):
        g = flat(params, len(lead)) - (c[t] if lead else c[t, comm.rank])
        set_grads(params, g, TEMPLAR_SHAPES)
        opt.step()
        if (t + 1) % TEMPLAR_INNER == 0:
            anchors.append(flat(params, len(lead)).reshape(-1, g.shape[-1]))
    return np.array(anchors), flat(opt.errors, len(lead)).reshape(-1, g.shape[-1]) * lr  # templar's holds lr Delta


def sparseloco_fleet(meta: dict, name: str, **change) -> tuple[np.ndarray, np.ndarray]:
    anchors, errors = sparseloco_run(FleetCommunicator(meta["cases"][name]["peers"]), meta, name, **change)
    assert (anchors == anchors[:, :1]).all()  # one model after each outer step
    return anchors[:, 0], errors


def sparseloco_local(meta: dict, name: str) -> tuple[np.ndarray, np.ndarray]:
    per_rank = run_local(meta["cases"][name]["peers"], sparseloco_run, meta, name, timeout_s=120)
    anchors = np.concatenate([a for a, _ in per_rank], axis=1)
    assert (anchors == anchors[:, :1]).all()
    return anchors[:, 0], np.concatenate([e for _, e in per_rank])


@pytest.mark.parametrize("name", ["n2", "n4", "n4_lr05"])
def test_sparseloco_templar_equals_templars_outer_step(name):
    """2 and 4 peers, 3 outer steps of 3 inner steps, templar's production hparams (topk 64 of 32 x 48 tiles,
    2-bit values, error-feedback decay 0.95): the model after every outer step and each peer's error feedback
    equal templar's to float32 rounding (templar's peers themselves differ by a few ulps, see the fixture's
    meta), on the fleet and on the local backend (real packed messages); n4_lr05: templar at outer lr 0.5 is
    dpsgd at 0.25."""
    meta, ref = fixture("sparseloco_templar")
    for anchors, errors in (sparseloco_fleet(meta, name), sparseloco_local(meta, name)):
        np.testing.assert_allclose(anchors, ref[f"{name}_anchors"], rtol=0, atol=2e-6)
        np.testing.assert_allclose(errors, ref[f"{name}_errors"], rtol=0, atol=2e-6)


@pytest.mark.parametrize(
    "name, change",
    [
        ("n2", {"aggregate": "mean"}),
        ("n4", {"aggregate": "mean"}),
        ("n4", {"decay": 0.9}),
        ("n4_lr05", {"outer": lambda ps: torch.optim.SGD(ps, lr=0.5)}),
    ],
    ids=["n2-mean", "n4-mean", "n4-decay", "n4_lr05-lr-once"],
)
def test_sparseloco_templar_check_fails_with_a_default_changed(name, change):
    """Not vacuous: dpsgd's default aggregation (the paper's mean), another error-feedback decay, and templar's
    outer lr taken once (the lr check above is the squared lr's)."""
    meta, ref = fixture("sparseloco_templar")
    anchors, _ = sparseloco_fleet(meta, name, **change)
    assert np.abs(anchors - ref[f"{name}_anchors"]).max() > 1e-4, change


# --- NoLoCo: gensyn-ai/noloco SparseOptimizerC -----------------------------------------------------------------
NOLOCO_SHAPES, NOLOCO_STEPS = ((8, 12), (12,)), 12


def scaled_inputs(shapes, steps: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """x0 = default_rng(0).normal, c = default_rng(1).normal(size=(steps, n, numel)) * (1 + i), float32 (the
    harnesses' inputs where peer i's targets are scaled by 1 + i)."""
    numel = sum(int(np.prod(s)) for s in shapes)
    x0 = np.random.default_rng(0).normal(size=numel).astype(np.float32)
    c = np.random.default_rng(1).normal(size=(steps, n, numel))
    return x0, (c * (1 + np.arange(n))[None, :, None]).astype(np.float32)


def noloco_fleet(meta: dict, name: str, **change) -> np.ndarray:
    """(steps, n, numel) under dpsgd's NoLoCo with the reference's options: inner Adam, period 3, pairs, outer
    SGD lr 0.7 momentum 0.5."""
    from dpsgd.optim import NoLoCo

    o, n = meta["options"], meta["cases"][name]["peers"]
    x0, c = scaled_inputs(NOLOCO_SHAPES, NOLOCO_STEPS, n)
    params = as_params(x0, NOLOCO_SHAPES, (n,))
    options = {
        "period": o["number_of_local_steps"],
        "group_size": o["local_group_size"],
        "outer": lambda ps: torch.optim.SGD(ps, lr=o["outer_lr"], momentum=o["outer_momentum"]),
    }
    opt = NoLoCo(torch.optim.Adam(params, lr=o["lr"]), comm=FleetCommunicator(n), **{**options, **change})
    out = []
    for t in range(NOLOCO_STEPS):
        set_grads(params, flat(params, 1) - c[t], NOLOCO_SHAPES)
        opt.step()
        out.append(flat(params, 1))
    return np.array(out)


@pytest.mark.parametrize("name", ["n2", "n4"])
def test_noloco_equals_gensyn_noloco(name):
    """2 and 4 peers, pairs drawn by the reference's step-seeded permutation, 4 outer steps of 3 inner Adam
    steps: every peer's parameters after every step are the reference's to float32 rounding."""
    meta, ref = fixture("noloco_gensyn")
    got = noloco_fleet(meta, name)
    np.testing.assert_allclose(got, ref[f"{name}_x"], rtol=0, atol=2e-6)
    before = ref[f"{name}_x"][-2]  # after step 11: two inner steps since the last outer step
    assert np.abs(before - before.mean(0)).max() > 1e-3  # the peers' gradients differ (Adam moves lr a step)


@pytest.mark.parametrize(
    "change",
    [{"gamma": 0.0}, {"outer": lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9)}],
    ids=["no-pull", "momentum-0.9"],
)
def test_noloco_check_fails_with_a_default_changed(change):
    """Not vacuous: gamma 0 (no pull toward the partner's anchor, where the reference pulls with alpha), and
    DiLoCo's outer momentum 0.9 for NoLoCo's 0.5."""
    meta, ref = fixture("noloco_gensyn")
    assert np.abs(noloco_fleet(meta, "n4", **change) - ref["n4_x"]).max() > 1e-3


# --- LocalSGD: torch's post-local SGD averagers ------------------------------------------------------------------
LOCAL_SHAPES, LOCAL_STEPS = ((8, 12), (12,)), 12
# torch's warm-up W all-reduces the gradients for W steps; its averager then averages right after the first local
# step, which with plain SGD is an all-reduce step (the mean of x - lr g_i is x - lr mean g_i): dpsgd's W + 1
TORCH_TO_DPSGD = {
    "periodic": {"period": 3, "warmup_steps": 3},
    "hierarchical": {"period": 2, "group_size": 2, "global_period": 4, "warmup_steps": 5},
    "hierarchical_w2": {"period": 2, "group_size": 2, "global_period": 4, "warmup_steps": 3},
}


def local_sgd_fleet(meta: dict, name: str, **change) -> np.ndarray:
    from dpsgd.optim import LocalSGD

    n = meta["cases"][name]["peers"]
    x0, c = scaled_inputs(LOCAL_SHAPES, LOCAL_STEPS, n)
    params = as_params(x0, LOCAL_SHAPES, (n,))
    opt = LocalSGD(
        torch.optim.SGD(params, lr=meta["lr"]), comm=FleetCommunicator(n), **{**TORCH_TO_DPSGD[name], **change}
    )
    out = []
    for t in range(LOCAL_STEPS):
        set_grads(params, flat(params, 1) - c[t], LOCAL_SHAPES)
        opt.step()
        out.append(flat(params, 1))
    return np.array(out)


def averaged(x: np.ndarray) -> list[str]:
    """Per step (1-based), what the peers' parameters show: "all" equal, "pairs" (0 = 1, 2 = 3) equal, or "-"."""
    out = []
    for step in x:
        if all(np.array_equal(step[0], s) for s in step):
            out.append("all")
        elif np.array_equal(step[0], step[1]) and np.array_equal(step[2], step[3]):
            out.append("pairs")
        else:
            out.append("-")
    return out


@pytest.mark.parametrize("name", ["periodic", "hierarchical"])
def test_local_sgd_equals_torchs_post_local_sgd(name):
    """4 peers, plain SGD, torch's DDP post_localSGD_hook with PeriodicModelAverager (period 3, warm-up 2) or
    HierarchicalModelAverager (pairs every 2 steps, all every 4, warm-up 4): every peer's parameters after every
    step are torch's to float32 rounding, with dpsgd's warm-up one step longer (see TORCH_TO_DPSGD)."""
    meta, ref = fixture("local_sgd_torch")
    np.testing.assert_allclose(local_sgd_fleet(meta, name), ref[f"{name}_x"], rtol=0, atol=1e-6)


def test_torchs_hierarchical_averager_counts_the_absolute_step():
    """The documented difference: torch's HierarchicalModelAverager averages at 0-based step u >= warm-up when u
    % period == 0 (the absolute step), dpsgd when (t - warm-up) % period == 0. At a warm-up that is a multiple of
    the global period the two agree (above); at warm-up 2 torch averages pairs right after it, where dpsgd can
    only all-reduce, and from then on the two alternate out of phase."""
    meta, ref = fixture("local_sgd_torch")
    torch_steps = averaged(ref["hierarchical_w2_x"])
    assert torch_steps == ["all", "all", "pairs", "-", "all", "-", "pairs", "-", "all", "-", "pairs", "-"]
    dpsgd_steps = averaged(local_sgd_fleet(meta, "hierarchical_w2"))
    assert dpsgd_steps == ["all", "all", "all", "-", "pairs", "-", "all", "-", "pairs", "-", "all", "-"]
    assert averaged(ref["hierarchical_x"]) == averaged(local_sgd_fleet(meta, "hierarchical"))


@pytest.mark.parametrize("change", [{"warmup_steps": 2}, {"period": 4}], ids=["torch-warmup", "period-4"])
def test_local_sgd_check_fails_with_a_default_changed(change):
    """Not vacuous: torch's warm-up count taken as dpsgd's, and another period."""
    meta, ref = fixture("local_sgd_torch")
    assert np.abs(local_sgd_fleet(meta, "periodic", **change) - ref["periodic_x"]).max() > 1e-3


# --- SlowMo: fairscale's SlowMoDistributedDataParallel ------------------------------------------------------------
def slowmo_fleet(meta: dict, **change) -> np.ndarray:
    """dpsgd's SlowMo with fairscale's two frequencies: a plain average of all peers every localsgd_frequency steps
    (group_size n, period), the slow momentum step every slowmo_frequency steps (global_period)."""
    from dpsgd.optim import SlowMo

    o, n = meta["options"], meta["cases"]["init_first"]["peers"]
    x0, c = scaled_inputs(LOCAL_SHAPES, LOCAL_STEPS, n)
    params = as_params(x0, LOCAL_SHAPES, (n,))
    options = {
        "period": o["localsgd_frequency"],
        "group_size": n,
        "global_period": o["slowmo_frequency"],
        "outer": lambda ps: torch.optim.SGD(ps, lr=o["slowmo_lr"], momentum=o["slowmo_momentum"]),
    }
    opt = SlowMo(torch.optim.SGD(params, lr=meta["lr"]), comm=FleetCommunicator(n), **{**options, **change})
    out = []
    for t in range(LOCAL_STEPS):
        set_grads(params, flat(params, 1) - c[t], LOCAL_SHAPES)
        opt.step()
        out.append(flat(params, 1))
    return np.array(out)


def test_slowmo_equals_fairscales_slowmo():
    """4 peers, plain SGD, local averaging every 3 steps and the slow momentum step (beta 0.5, alpha 1) every 6,
    fairscale's anchor taken at the start: every peer's parameters after every step are fairscale's to float32
    rounding.

    The documented difference: used as its docstring shows (perform_slowmo after each step, nothing before),
    fairscale takes its first anchor after the first local step, each of its n slices of the flattened
    parameters from the peer that keeps that slice's slow state (peer r's model for slice r). The first slow
    step does not see the anchor (with a zero momentum it lands on the average), so the two agree through step
    11 and part from the second slow step, at 12."""
    meta, ref = fixture("slowmo_fairscale")
    got = slowmo_fleet(meta)
    np.testing.assert_allclose(got, ref["init_first_x"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(got[:11], ref["as_documented_x"][:11], rtol=0, atol=1e-6)
    assert np.abs(got[11] - ref["as_documented_x"][11]).max() > 1e-2


@pytest.mark.parametrize(
    "change",
    [{"outer": lambda ps: torch.optim.SGD(ps, lr=1.0, momentum=0.9)}, {"group_size": None, "global_period": None}],
    ids=["momentum-0.9", "one-frequency"],
)
def test_slowmo_check_fails_with_a_default_changed(change):
    """Not vacuous: another slow momentum, and the slow step at every averaging (one frequency, dpsgd's default)."""
    meta, ref = fixture("slowmo_fairscale")
    assert np.abs(slowmo_fleet(meta, **change) - ref["init_first_x"]).max() > 1e-3


# --- SGP: facebookresearch/stochastic_gradient_push ---------------------------------------------------------------
def sgp_fleet(meta: dict, topology="one_peer_directed_exponential") -> np.ndarray:
    """(steps, n, numel): dpsgd's SGP, plain SGD, on the reference's default graph (each peer pushes half its mass
    to i + 2^(k mod log2 n), the other half it keeps: topologies' one_peer_directed_exponential), or on a given
    Topology."""
    import topologies
    from dpsgd.optim import SGP

    n = meta["peers"]
    x0, c = scaled_inputs(LOCAL_SHAPES, LOCAL_STEPS, n)
    params = as_params(x0, LOCAL_SHAPES, (n,))
    graph = topologies.make(topology, n) if isinstance(topology, str) else topology
    opt = SGP(torch.optim.SGD(params, lr=meta["lr"]), topology=graph, comm=FleetCommunicator(n))
    out = []
    for t in range(LOCAL_STEPS):
        set_grads(params, flat(params, 1) - c[t], LOCAL_SHAPES)
        opt.step()
        out.append(flat(params, 1))
    return np.array(out)


def test_sgp_equals_facebooks_stochastic_gradient_push():
    """4 peers, plain SGD, GossipDataParallel's defaults (NPeerDynamicDirectedExponentialGraph, one peer per
    iteration, UniformMixing, push-sum with lazy mixing on its regular graph): every peer's de-biased model after
    every step is the reference's to float32 rounding."""
    meta, ref = fixture("sgp_facebook")
    np.testing.assert_allclose(sgp_fleet(meta), ref["x"], rtol=0, atol=1e-6)
    assert np.abs(ref["x"][-1] - ref["x"][-1].mean(0)).max() > 1e-2  # the peers disagree: gossip, not an average


def nonregular(meta: dict, phases=(0, 1)):
    """The fixture's non-regular graph as dpsgd's column stochastic schedule: at phase k, sender j keeps half its
    mass and pushes half to its k-th out-peer (UniformMixing with one peer per iteration)."""
    import topologies

    graph, n = {int(r): peers for r, peers in meta["nonregular_graph"].items()}, meta["peers"]
    matrices = []
    for k in phases:
        w = np.eye(n) * 0.5
        for j in range(n):
            w[graph[j][k], j] += 0.5
        matrices.append(w)
    return topologies.from_matrix(matrices, directed=True, name="nonregular")


def test_sgp_push_sum_equals_the_reference_on_a_nonregular_graph():
    """On the default graph every peer receives as many messages as it sends, so the push-sum weights stay 1 and
    x / w never divides by anything but 1. On the fixture's graph of unequal in-degrees (handed to the reference
    as `graph=`, which then mixes on transfer, not lazily) the weights move: every peer's de-biased model after
    every step is the reference's to float32 rounding."""
    meta, ref = fixture("sgp_facebook")
    np.testing.assert_allclose(sgp_fleet(meta, nonregular(meta)), ref["nonregular_x"], rtol=0, atol=1e-6)
    assert np.abs(ref["nonregular_x"] - ref["x"]).max() > 1e-2  # the graph matters


def test_sgp_check_fails_with_another_graph():
    """Not vacuous: the static directed exponential graph (every peer to i + 1 and i + 2 at once) in place of the
    reference's one peer per step."""
    meta, ref = fixture("sgp_facebook")
    assert np.abs(sgp_fleet(meta, "directed_exponential") - ref["x"]).max() > 1e-3
    assert np.abs(sgp_fleet(meta, nonregular(meta, (1, 0))) - ref["nonregular_x"]).max() > 1e-3  # phases swapped


# --- Choco-SGD: epfml/ChocoSGD convex_code ------------------------------------------------------------------------
CHOCO_CODECS = {  # the code's quantization -> dpsgd's compressor options
    "top": lambda o: {"compressor": "top_k", "ratio": o["coordinates_to_keep"] / 30},
    "random-biased": lambda o: {"compressor": "random_k", "ratio": o["coordinates_to_keep"] / 30},
    "qsgd-biased": lambda o: {"compressor": "qsgd", "levels": o["num_levels"], "rescale": True},
    "qsgd-unbiased": lambda o: {"compressor": "qsgd", "levels": o["num_levels"], "rescale": False},
}


def choco_run(meta: dict, ref: dict, name: str, monkeypatch, **change) -> np.ndarray:
    """(steps, machines, features): dpsgd's Choco on the code's logistic regression, ring and inputs, each
    machine's gradient at its sampled row (ref[name_sample]) and the compressor's draws the code made (patched into
    dpsgd's codecs, keyed by (sender, step)), ordered and started as the code does."""
    import topologies
    from dpsgd.comm import codecs
    from dpsgd.optim import Choco

    case, n, d = meta["cases"][name], 4, 30
    A = np.random.default_rng(0).normal(size=(40, d))
    y = np.sign(np.random.default_rng(1).normal(size=40))
    x0 = np.random.default_rng(2).normal(size=d) * 0.1
    if f"{name}_positions" in ref:
        positions = ref[f"{name}_positions"]
        monkeypatch.setattr(
            codecs.RandomK, "indices", lambda self, numel, key, device: torch.from_numpy(positions[key[1], key[0]])
        )
    if f"{name}_uniforms" in ref:
        uniforms = ref[f"{name}_uniforms"]
        monkeypatch.setattr(
            codecs.QSGD, "uniforms", lambda self, numel, key, dtype, device: torch.from_numpy(uniforms[key[1], key[0]])
        )
    x = torch.nn.Parameter(torch.from_numpy(np.tile(x0, (n, 1))))
    options = {**CHOCO_CODECS[case["quantization"]](case), "gamma": meta["consensus_lr"]}
    options.update(order="gossip_first", copies_start="model")
    opt = Choco(
        torch.optim.SGD([x], lr=meta["lr"]), topology=topologies.make("ring", n), comm=FleetCommunicator(n),
        **{**options, **change},
    )  # fmt: skip
    out = []
    for rows in ref[f"{name}_sample"]:
        a, label = A[rows], y[rows]  # (machines, features), (machines,)
        margin = (a * x.detach().numpy()).sum(1)
        minus_grad = label[:, None] * a * (1 / (1 + np.exp(label * margin)))[:, None]
        x.grad = torch.from_numpy(-minus_grad)
        opt.step()
        out.append(x.detach().numpy().copy())
    return np.array(out)


@pytest.mark.parametrize("name", ["top", "random_biased", "qsgd_biased", "qsgd_unbiased"])
def test_choco_equals_epfml_chocosgd(name, monkeypatch):
    """4 machines on a ring, logistic regression, 10 steps, each of the code's compressors (top-k, random-k,
    QSGD rescaled and not) with its own random draws: every machine's model after every step equals the code's to
    float64 rounding, with Choco's `order: gossip_first` and `copies_start: model` (the code's form)."""
    meta, ref = fixture("choco_epfml")
    np.testing.assert_allclose(choco_run(meta, ref, name, monkeypatch), ref[f"{name}_x"], rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "name, change",
    [("top", {"order": "compress_first"}), ("top", {"copies_start": "zero"}), ("qsgd_biased", {"rescale": False})],
    ids=["paper-order", "zero-copies", "qsgd-unscaled"],
)
def test_choco_check_fails_with_a_default_changed(name, change, monkeypatch):
    """Not vacuous: dpsgd's default order (the ICML 2019 paper's) and start of the copies, each differs from the
    code's; and QSGD without its rescaling."""
    meta, ref = fixture("choco_epfml")
    assert np.abs(choco_run(meta, ref, name, monkeypatch, **change) - ref[f"{name}_x"]).max() > 1e-4


def choco_sign_fleet(meta: dict, name: str, **change) -> np.ndarray:
    """(steps, n, numel): dpsgd's Choco with the scaled sign compressor on the code's ring (1/3 each), plain SGD,
    in the form of epfml/ChocoSGD's ParallelCHOCO (consensus step first, copies from zero)."""
    import topologies
    from dpsgd.optim import Choco

    n, shapes = meta["peers"], [tuple(s) for s in meta["shapes"][name]]
    x0, c = scaled_inputs(shapes, LOCAL_STEPS, n)
    params = as_params(x0, shapes, (n,))
    options = {"compressor": "sign", "gamma": meta["consensus_stepsize"], "order": "gossip_first"}
    options["copies_start"] = "zero"
    opt = Choco(
        torch.optim.SGD(params, lr=meta["lr"]), topology=topologies.make("ring", n), comm=FleetCommunicator(n),
        **{**options, **change},
    )  # fmt: skip
    out = []
    for t in range(LOCAL_STEPS):
        set_grads(params, flat(params, 1) - c[t], shapes)
        opt.step()
        out.append(flat(params, 1))
    return np.array(out)


def test_choco_sign_equals_epfml_chocosgd_dl_code():
    """4 peers on the code's ring, plain SGD, 12 steps, the sign compressor of epfml/ChocoSGD's deep-learning code
    (each tensor's signs scaled by its L1 norm over its size, packed by the bit2byte extension): with one parameter
    tensor, every peer's parameters after every step are the code's to float32 rounding.

    The documented difference: dpsgd compresses the model as one flat vector, one scale for all of it, the code
    one scale per tensor; with two tensors (W and b) they part at the second step."""
    meta, ref = fixture("choco_sign_epfml")
    np.testing.assert_allclose(choco_sign_fleet(meta, "one_tensor"), ref["one_tensor_x"], rtol=0, atol=5e-6)
    two = choco_sign_fleet(meta, "two_tensors")
    np.testing.assert_array_equal(two[0], ref["two_tensors_x"][0])  # the copies start at 0: the first step agrees
    assert np.abs(two[1] - ref["two_tensors_x"][1]).max() > 1e-3


@pytest.mark.parametrize(
    "change", [{"order": "compress_first"}, {"copies_start": "model"}], ids=["paper-order", "model-copies"]
)
def test_choco_sign_check_fails_with_a_default_changed(change):
    """Not vacuous: the paper's order (compress, then the consensus step), and copies that start at the model (the
    convex code's start, not this code's)."""
    meta, ref = fixture("choco_sign_epfml")
    assert np.abs(choco_sign_fleet(meta, "one_tensor", **change) - ref["one_tensor_x"]).max() > 1e-3


# --- QGM: epfml/quasi-global-momentum ------------------------------------------------------------------------------
def qgm_fleet(meta: dict, **change) -> np.ndarray:
    """(steps, n, numel): dpsgd's QGM (order atc, beta 0.9, mu = beta) on the code's ring (1/3 each), plain SGD."""
    import topologies
    from dpsgd.optim import QGM

    n = meta["peers"]
    x0, c = scaled_inputs(LOCAL_SHAPES, LOCAL_STEPS, n)
    params = as_params(x0, LOCAL_SHAPES, (n,))
    options = {"beta": meta["momentum"], **change}
    opt = QGM(
        torch.optim.SGD(params, lr=meta["lr"]),
        topology=topologies.make("ring", n),
        comm=FleetCommunicator(n),
        **options,
    )
    out = []
    for t in range(LOCAL_STEPS):
        set_grads(params, flat(params, 1) - c[t], LOCAL_SHAPES)
        opt.step()
        out.append(flat(params, 1))
    return np.array(out)


def test_qgm_equals_epfml_quasi_global_momentum():
    """4 peers on a ring, beta 0.9 and the code's buffer factor 0.1 (mu = 0.9): every peer's parameters after every
    step equal the code's to float32 rounding."""
    meta, ref = fixture("qgm_epfml")
    np.testing.assert_allclose(qgm_fleet(meta), ref["x"], rtol=0, atol=2e-6)


@pytest.mark.parametrize("change", [{"mu": 0.5}, {"order": "cta"}], ids=["mu-0.5", "cta"])
def test_qgm_check_fails_with_a_default_changed(change):
    """Not vacuous: another buffer factor, and the other order."""
    meta, ref = fixture("qgm_epfml")
    assert np.abs(qgm_fleet(meta, **change) - ref["x"]).max() > 1e-3


# --- ClippedGossip: epfml/byzantine-robust-decentralized-optimizer -------------------------------------------------
def clipped_gossip_fleet(meta: dict, name: str, **rule) -> np.ndarray:
    """(steps, n, numel): dpsgd's D-PSGD (order atc: the local step, then the mix, as the reference's trainer) on a
    ring of 5 (1/3 each, the reference's Metropolis weights) with robust=clipped_gossip, plain SGD."""
    import topologies
    from dpsgd.comm import robust
    from dpsgd.optim import DPSGD

    n = meta["peers"]
    x0, c = scaled_inputs(((108,),), 12, n)
    (x,) = as_params(x0, ((108,),), (n,))
    comm = robust.wrap(
        FleetCommunicator(n), {"name": "clipped_gossip", "byzantine": 1, "tau": meta["cases"][name], **rule}
    )
    opt = DPSGD(torch.optim.SGD([x], lr=meta["lr"]), topology=topologies.make("ring", n), comm=comm, order="atc")
    out = []
    for t in range(12):
        x.grad = (x.detach() - torch.from_numpy(c[t])).clone()
        opt.step()
        out.append(x.detach().numpy().copy())
    return np.array(out)


@pytest.mark.parametrize("name", ["adaptive", "tau05"])
def test_clipped_gossip_equals_epfmls_self_centered_clipping(name):
    """5 workers on a ring, the adaptive radius (the second largest distance to a neighbour: byzantine 1) and a fixed
    tau 0.5: every worker's model after every step equals the reference's to float32 rounding."""
    meta, ref = fixture("clipped_gossip_epfml")
    np.testing.assert_allclose(clipped_gossip_fleet(meta, name), ref[f"{name}_x"], rtol=0, atol=2e-6)


@pytest.mark.parametrize("name, rule", [("adaptive", {"byzantine": 0}), ("tau05", {"tau": 1.0})], ids=["b0", "tau1"])
def test_clipped_gossip_check_fails_with_a_default_changed(name, rule):
    """Not vacuous: the adaptive radius at the farthest distance (byzantine 0: nothing clipped), another tau."""
    meta, ref = fixture("clipped_gossip_epfml")
    assert np.abs(clipped_gossip_fleet(meta, name, **rule) - ref[f"{name}_x"]).max() > 1e-3


# --- D2 and gradient tracking: epfml/quasi-global-momentum ----------------------------------------------------------
def d2_gt_fleet(meta: dict, name: str, **change) -> np.ndarray:
    """(steps, n, numel): dpsgd's D2 or GradientTracking on the code's ring of 5 (1/3 each), plain SGD."""
    import topologies
    from dpsgd.optim import D2, GradientTracking

    n = meta["peers"]
    x0, c = scaled_inputs(LOCAL_SHAPES, LOCAL_STEPS, n)
    params = as_params(x0, LOCAL_SHAPES, (n,))
    make = {"d2": D2, "gradient_tracking": GradientTracking}[name]
    opt = make(
        torch.optim.SGD(params, lr=meta["lr"]), topology=topologies.make("ring", n), comm=FleetCommunicator(n), **change
    )
    out = []
    for t in range(LOCAL_STEPS):
        set_grads(params, flat(params, 1) - c[t], LOCAL_SHAPES)
        opt.step()
        out.append(flat(params, 1))
    return np.array(out)


def test_d2_equals_epfmls_decentralized_d2():
    """5 peers on a ring, plain SGD: every peer's parameters after every step equal the code's to float32
    rounding, which 2 x - x_prev lets grow to a few units in the sixth digit by step 12 (its first step plain, then
    x <- W (2 x - x_prev - lr (g - g_prev)))."""
    meta, ref = fixture("d2_gt_epfml")
    np.testing.assert_allclose(d2_gt_fleet(meta, "d2"), ref["d2_x"], rtol=0, atol=1e-5)


def test_d2_check_fails_with_lazy_mixing():
    """Not vacuous: D2 with (I + W) / 2 (lazy_mixing, its option for rings of even size) is another trajectory."""
    meta, ref = fixture("d2_gt_epfml")
    assert np.abs(d2_gt_fleet(meta, "d2", lazy_mixing=True) - ref["d2_x"]).max() > 1e-3


def test_gradient_tracking_differs_from_epfmls_code_in_where_it_mixes_the_tracker():
    """The documented difference: epfml's code steps x <- W x - lr y with its own tracker y (then mixes y), dpsgd the
    paper's (Pu & Nedic 2021) x <- W (x - lr y), which mixes the step too; they part at the first step already,
    by lr (y_i - sum_j W[i,j] y_j), and the reference's own numbers follow its form (checked here in numpy)."""
    meta, ref = fixture("d2_gt_epfml")
    n, lr = meta["peers"], meta["lr"]
    x0, c = scaled_inputs(LOCAL_SHAPES, LOCAL_STEPS, n)
    import topologies

    W = topologies.make("ring", n).mixing_matrix(0).astype(np.float32)
    x, y, g_prev, want = np.tile(x0, (n, 1)), None, None, []
    for t in range(LOCAL_STEPS):  # the code's form, restated: y_t = W y_{t-1} + g_t - g_{t-1}; x <- W x - lr y_t
        g = x - c[t]
        y = g.copy() if y is None else W @ y + g - g_prev
        x, g_prev = W @ x - lr * y, g
        want.append(x)
    np.testing.assert_allclose(np.array(want), ref["gradient_tracking_x"], rtol=0, atol=2e-5)
    assert np.abs(d2_gt_fleet(meta, "gradient_tracking") - ref["gradient_tracking_x"])[0].max() > 1e-3
