"""MuLoCo's 2-bit quantizers of the outer delta (facebookresearch/MuLoCo: torchtitan/torchtitan/components/
quantized_outer_sgd.py, QuantizationCompressor, BatchedRowiseQuantizationCompressor and QuantizedOuterSGD._save_grads'
error feedback) on small fixed inputs.

Usage: python tools/fidelity/muloco_quantizer.py MULOCO_CHECKOUT tests/fixtures/muloco_quantizer.npz
(MULOCO_CHECKOUT: a clone of https://github.com/facebookresearch/MuLoCo; needs torch and einops.)

The module is loaded from the checkout by its path (its package's __init__ pulls in all of torchtitan); nothing is
stubbed. Quantizers as the paper's runs configure them (torchtitan/jobs/muloco_paper/*.py: quantization_bins 4 (2
bits), quantization_range 6, compressor_type row_wise_statistical; the class's default compressor is the per-tensor
`statistical` one). Inputs: x = float32(default torch generator seeded 0, randn(6, 10) in float64 x 0.01) with
x[2, 3] = 0.2 (an outlier beyond 6 sigmas); three deltas d_t drawn after it the same way; then input_tails =
float32(randn(6, 10) in float64, cubed, x 0.01) (heavy tails: every code in use). Outputs: each quantizer's decoded
x and input_tails, and the row-wise quantizer under _save_grads' error feedback with error_decay 0.9 and lr 0.7:
e <- 0.9 e + 0.7 d_t, q_t = Q(e), e <- e - q_t (error_feedback_alpha 1), the q_t a worker sends."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import common
import numpy as np

FILE = "torchtitan/torchtitan/components/quantized_outer_sgd.py"
BINS, SIGMAS, DECAY, LR = 4, 6, 0.9, 0.7


def main(checkout: str, out: str) -> None:
    import torch

    spec = importlib.util.spec_from_file_location("quantized_outer_sgd", Path(checkout) / FILE)
    assert spec is not None and spec.loader is not None
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 10, generator=g, dtype=torch.float64) * 0.01).float()
    x[2, 3] = 0.2
    deltas = [(torch.randn(6, 10, generator=g, dtype=torch.float64) * 0.01).float() for _ in range(3)]
    tails = (torch.randn(6, 10, generator=g, dtype=torch.float64) ** 3 * 0.01).float()  # every code in use
    arrays = {"input": x.numpy(), "deltas": torch.stack(deltas).numpy(), "input_tails": tails.numpy()}
    for name, comp in (
        ("statistical", ref.QuantizationCompressor(BINS, SIGMAS)),
        ("row_wise_statistical", ref.BatchedRowiseQuantizationCompressor(BINS, SIGMAS)),
    ):
        for suffix, values in (("", x), ("_tails", tails)):
            packed, meta = comp._quantize(values.clone())
            arrays[name + suffix] = comp._dequantize(packed, meta).numpy()
    comp = ref.BatchedRowiseQuantizationCompressor(BINS, SIGMAS)
    e, sent = torch.zeros_like(x), []
    for d in deltas:  # _save_grads with use_ef: the same three lines on one parameter
        e.mul_(DECAY).add_(d, alpha=LR)
        packed, meta = comp._quantize(e)
        q = comp._dequantize(packed, meta)
        e.sub_(q, alpha=1.0)
        sent.append(q)
    arrays["ef_sent"] = torch.stack(sent).numpy()
    meta = {
        "repository": "facebookresearch/MuLoCo",
        "file": FILE,
        "commit": common.commit(checkout),
        "bins": BINS,
        "range_in_sigmas": SIGMAS,
        "error_decay": DECAY,
        "outer_lr": LR,
        "inputs": "see this harness's docstring (tools/fidelity/muloco_quantizer.py)",
    }
    common.write(out, meta, {k: np.asarray(v) for k, v in arrays.items()})


if __name__ == "__main__":
    main(*sys.argv[1:3])
