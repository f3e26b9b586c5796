"""MuLoCo's 2-bit quantizer of the outer delta against its authors' code (tests/fixtures/muloco_quantizer.npz, written
by tools/fidelity/muloco_quantizer.py from facebookresearch/MuLoCo; its meta names the commit): dpsgd's statistical
quantization (dpsgd.optim.chunked.quantize) equals both of MuLoCo's quantizers, per tensor and per row, and the
2-bit message muloco2025 sends (SparseLoCo's code keeping every entry) is the per-tensor one, where the paper's runs
quantize per row (a difference the algorithms guide's fidelity table lists)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_reference_code import fixture

from dpsgd.optim.chunked import ChunkedTopK, quantize


def decoded_per_tensor(x: torch.Tensor, bits: int = 2, sigmas: float = 6.0) -> np.ndarray:
    return quantize(x.reshape(-1), bits, sigmas)[2].reshape(x.shape).numpy()


def decoded_per_row(x: torch.Tensor, bits: int = 2, sigmas: float = 6.0) -> np.ndarray:
    return quantize(x, bits, sigmas)[2].numpy()


def test_quantize_equals_mulocos_statistical_quantizers():
    meta, ref = fixture("muloco_quantizer")
    assert (meta["bins"], meta["range_in_sigmas"]) == (4, 6)
    for suffix in ("", "_tails"):
        x = torch.from_numpy(ref["input" + suffix])
        np.testing.assert_allclose(decoded_per_tensor(x), ref["statistical" + suffix], rtol=0, atol=1e-7)
        np.testing.assert_allclose(decoded_per_row(x), ref["row_wise_statistical" + suffix], rtol=0, atol=1e-7)


def test_quantize_under_mulocos_error_feedback_equals_what_its_worker_sends():
    """QuantizedOuterSGD._save_grads: e <- decay e + lr d, q = Q(e), e <- e - q (lr inside the error feedback, where
    dpsgd's SparseLoCo adds d itself and steps the outer optimizer with lr: the guide's fidelity table)."""
    meta, ref = fixture("muloco_quantizer")
    e = torch.zeros(ref["input"].shape, dtype=torch.float32)
    for d, want in zip(ref["deltas"], ref["ef_sent"]):
        e = meta["error_decay"] * e + meta["outer_lr"] * torch.from_numpy(d)
        q = quantize(e, 2, 6.0)[2]
        np.testing.assert_allclose(q.numpy(), want, rtol=0, atol=1e-7)
        e = e - q


def test_muloco2025s_message_is_the_per_tensor_quantizer_not_the_papers_per_row_one():
    _, ref = fixture("muloco_quantizer")
    x = torch.from_numpy(ref["input"])
    code = ChunkedTopK([tuple(x.shape)], chunk=64, topk=4096, dct=False, bits=2, sigmas=6.0)  # muloco2025's TWO_BIT
    (sent,) = code.dense(code.encode([x]))
    np.testing.assert_allclose(sent.numpy(), ref["statistical"], rtol=0, atol=1e-7)
    assert np.abs(sent.numpy() - ref["row_wise_statistical"]).max() > 1e-3  # the outlier's row differs


@pytest.mark.parametrize("change", [{"bits": 4}, {"sigmas": 3.0}], ids=["8_levels", "3_sigmas"])
def test_the_check_fails_with_another_quantizer_setting(change):
    """Not vacuous: 4 bits or 3 sigmas in place of MuLoCo's 2 bits and 6 sigmas give other numbers."""
    _, ref = fixture("muloco_quantizer")
    x = torch.from_numpy(ref["input"])
    assert np.abs(decoded_per_tensor(x, **change) - ref["statistical"]).max() > 1e-5
    assert np.abs(decoded_per_row(x, **change) - ref["row_wise_statistical"]).max() > 1e-5
