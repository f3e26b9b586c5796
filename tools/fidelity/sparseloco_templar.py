"""templar's SparseLoCo outer step (tplr-ai/templar: src/tplr/neurons.py prepare_gradient_dict and outer_step,
src/tplr/compress.py ChunkingTransformer and TopKCompressor) on n peers in one process: anchors and error feedback.

Usage: python tools/fidelity/sparseloco_templar.py TEMPLAR_CHECKOUT tests/fixtures/sparseloco_templar.npz
(TEMPLAR_CHECKOUT: a clone of https://github.com/tplr-ai/templar; needs torch and einops.)

Stubbed, none of it the rule: the `tplr` package's __init__ (its submodules compress, neurons and distributed are
the checkout's own files, imported through a bare package object with a logger), wandb's Run type, and the
gather over R2 buckets (comms.gather: here every peer's compressed dict is appended to the aggregated lists in
rank order, as gather does for the peers it reaches). Each peer is a miner namespace with the attributes
prepare_gradient_dict reads, the outer optimizer is torch.optim.SGD(lr=outer_learning_rate) as
neurons/trainer.py builds it, and the pseudo-gradient is p.grad = anchor - p with p restored to the anchor, as
distributed.restore_offloaded_params does. templar's production hparams (hparams/hparams.json): topk 64,
target_chunk 64, momentum_decay 0.95, quantization_bins 4 (2 bits), quantization_range 6, use_dct false.

Inputs: float32 parameters W (32, 96) and b (200,), flat x0 = default_rng(0).normal(size=3272) (W, then b);
inner steps are plain SGD, lr 0.05, on the gradient x - c[t, i] at inner step t for peer i, c =
default_rng(1).normal(size=(9, n, 3272)) * (1 + i) cast to float32 (i the peer); 3 inner steps per outer step,
3 outer steps. Per case: peer 0's model after each outer step (the peers' agree to a few ulps: templar restores
the anchor as p + (anchor - p)) and each peer's error feedback after the last."""

from __future__ import annotations

import logging
import sys
import types

import common
import numpy as np

SHAPES, INNER, ROUNDS, INNER_LR = ((32, 96), (200,)), 3, 3, 0.05
NUMEL = sum(int(np.prod(s)) for s in SHAPES)
HPARAMS = {
    "topk_compression": 64,
    "target_chunk": 64,
    "momentum_decay": 0.95,
    "quantization_bins": 4,
    "quantization_range": 6,
    "use_dct": False,
}
CASES = {"n2": (2, 1.0), "n4": (4, 1.0), "n4_lr05": (4, 0.5)}  # name -> (peers, outer_learning_rate)


def inputs(n: int):
    x0 = np.random.default_rng(0).normal(size=NUMEL).astype(np.float32)
    c = np.random.default_rng(1).normal(size=(INNER * ROUNDS, n, NUMEL))
    return x0, (c * (1 + np.arange(n))[None, :, None]).astype(np.float32)


def load(checkout: str):
    tplr = types.ModuleType("tplr")
    tplr.__path__ = [f"{checkout}/src/tplr"]
    tplr.logger = logging.getLogger("tplr")
    sys.modules["tplr"] = tplr
    for name in ("wandb", "wandb.sdk", "wandb.sdk.wandb_run"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["wandb.sdk.wandb_run"].Run = object
    import tplr.compress
    import tplr.neurons

    return tplr


def run(tplr, n: int, outer_lr: float):
    import torch

    x0, c = inputs(n)
    hparams = types.SimpleNamespace(**HPARAMS, outer_learning_rate=outer_lr)
    models = []
    for _ in range(n):
        model = torch.nn.Module()
        at = 0
        for name, shape in zip(("w", "b"), SHAPES):
            size = int(np.prod(shape))
            model.register_parameter(
                name, torch.nn.Parameter(torch.from_numpy(x0[at : at + size].reshape(shape).copy()))
            )
            at += size
        models.append(model)
    miners = [
        types.SimpleNamespace(
            hparams=hparams,
            model=m,
            owned_params={name for name, _ in m.named_parameters()},
            error_feedback={name: None for name, _ in m.named_parameters()},
            error_feedback_cpu_buffers={},
            transformer=tplr.compress.ChunkingTransformer(m, target_chunk=hparams.target_chunk),
            compressor=tplr.compress.TopKCompressor(
                use_quantization=True,
                quantization_bins=hparams.quantization_bins,
                quantization_range=hparams.quantization_range,
            ),
        )
        for m in models
    ]
    outers = [torch.optim.SGD(m.parameters(), lr=outer_lr) for m in models]
    anchors_out, t = [], 0
    for window in range(ROUNDS):
        gathered, shapes = {}, None
        for i, (m, miner) in enumerate(zip(models, miners)):
            anchor = [p.detach().clone() for p in m.parameters()]
            inner = torch.optim.SGD(m.parameters(), lr=INNER_LR)
            for k in range(INNER):
                x = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
                g, at = x - torch.from_numpy(c[t + k, i]), 0
                for p in m.parameters():
                    p.grad = g[at : at + p.numel()].reshape(p.shape).clone()
                    at += p.numel()
                inner.step()
            with torch.no_grad():
                for p, a in zip(m.parameters(), anchor):  # restore_offloaded_params: grad = saved - p, p = saved
                    p.grad = a - p
                    p.add_(p.grad)
            gradient, xshapes, totalks = tplr.neurons.prepare_gradient_dict(miner, window)
            shapes = (xshapes, totalks)
            for key, value in gradient.items():
                if key != "metadata":
                    gathered.setdefault(key, []).append(value)
        t += INNER
        for m, miner, outer in zip(models, miners, outers):
            tplr.neurons.outer_step(
                m,
                outer,
                gather_result=types.SimpleNamespace(state_dict=types.SimpleNamespace(**gathered)),
                transformer=miner.transformer,
                compressor=miner.compressor,
                xshapes=shapes[0],
                totalks=shapes[1],
                device="cpu",
                is_master=True,
                world_size=1,
            )
        flats = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]).numpy().copy() for m in models]
        # one model after the outer step, up to a few ulps: restore_offloaded_params's p + (saved - p) is not
        # saved exactly in floating point, so the peers' anchors differ by rounding
        assert all(np.abs(f - flats[0]).max() < 1e-6 for f in flats)
        anchors_out.append(flats[0])
    errors = [torch.cat([miner.error_feedback[name].reshape(-1) for name in ("w", "b")]).numpy() for miner in miners]
    return np.array(anchors_out), np.array(errors)


if __name__ == "__main__":
    checkout, out = sys.argv[1], sys.argv[2]
    tplr = load(checkout)
    import torch

    torch.set_num_threads(1)
    arrays = {}
    for case, (n, lr) in CASES.items():
        arrays[f"{case}_anchors"], arrays[f"{case}_errors"] = run(tplr, n, lr)
    meta = {
        "repo": "https://github.com/tplr-ai/templar",
        "file": "src/tplr/neurons.py (prepare_gradient_dict, outer_step), src/tplr/compress.py",
        "commit": common.commit(checkout),
        "inputs": __doc__.split("Inputs: ")[1].strip(),
        "hparams": HPARAMS,
        "inner": {"optimizer": "torch.optim.SGD", "lr": INNER_LR, "steps": INNER, "rounds": ROUNDS},
        "cases": {case: {"peers": n, "outer_learning_rate": lr} for case, (n, lr) in CASES.items()},
        "stubbed": __doc__.split("Stubbed, ")[1].split("\n\nInputs")[0].strip(),
    }
    common.write(out, meta, arrays)
