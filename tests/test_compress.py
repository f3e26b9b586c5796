"""Codecs of dpsgd.comm.codecs: what decode(encode(v)) gives, how many bytes go on the wire,
that receivers decode what senders meant, and that QSGD is unbiased."""

from __future__ import annotations

import math

import pytest
import torch

from dpsgd.comm import codecs
from dpsgd.comm.codecs import QSGD, RandomK, ScaledSign, TopK


def vector(n=1000, dtype=torch.float64, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 7, 300, 1000, 70_000])
def test_top_k_keeps_the_largest_entries_and_counts_values_plus_positions(n, dtype):
    v = vector(n, dtype)
    c = TopK(0.1)
    k = math.ceil(0.1 * n)
    buf = c.encode(v)
    assert buf.dtype == torch.uint8 and buf.numel() == c.nbytes(n, dtype)
    positions = min(k * (1 if n <= 256 else 2 if n <= 65536 else 4), math.ceil(n / 8))
    assert c.nbytes(n, dtype) == k * v.element_size() + positions
    got = c.decode(buf, n, dtype)
    want = torch.zeros_like(v)
    idx = v.abs().argsort(descending=True)[:k]
    want[idx] = v[idx]
    assert torch.equal(got, want)


def test_top_k_ratio_one_is_lossless_and_small_ratios_are_five_times_smaller():
    v = vector(4874, torch.float32)
    assert torch.equal(TopK(1.0).compress(v), v)
    dense = v.numel() * v.element_size()
    assert dense / TopK(0.1).nbytes(v.numel(), v.dtype) >= 5  # the bitmap beats 16-bit positions at 10%
    assert TopK(0.01).nbytes(4874, torch.float32) == 49 * 4 + 49 * 2  # positions as uint16 at 1%


def test_random_k_receivers_regenerate_the_positions_from_the_key():
    v = vector(500)
    c = RandomK(0.2, seed=5)
    assert c.nbytes(500, torch.float64) == 100 * 8  # values only
    buf = c.encode(v, key=(3, 17))
    got = RandomK(0.2, seed=5).decode(buf.clone(), 500, torch.float64, key=(3, 17))  # another peer's copy
    kept = got != 0
    assert int(kept.sum()) == 100 and torch.equal(got[kept], v[kept])
    other = c.compress(v, key=(3, 18))
    assert not torch.equal(other != 0, kept)  # a new step draws new positions
    assert torch.equal(c.compress(v, key=(3, 17)), got)  # deterministic in (seed, rank, step)


def test_scaled_sign_is_l1_scale_times_sign_in_one_bit_per_entry():
    v = vector(1001)
    c = ScaledSign()
    assert c.nbytes(1001, torch.float64) == 8 + 126
    got = c.compress(v)
    scale = v.abs().sum() / v.numel()
    torch.testing.assert_close(got, scale * torch.sign(v), rtol=0, atol=1e-15)


@pytest.mark.parametrize("levels", [1, 4, 16, 127])
def test_qsgd_round_trip_levels_and_bytes(levels):
    v = vector(999)
    c = QSGD(levels, seed=1)
    width = math.ceil(math.log2(2 * levels + 1))
    assert c.nbytes(999, torch.float64) == 8 + math.ceil(999 * width / 8)
    got = c.compress(v, key=(0, 3))
    scaled = got / v.norm() * levels
    assert torch.allclose(scaled, scaled.round(), atol=1e-9)  # integer levels
    assert (scaled.abs() <= levels + 1e-9).all() and (torch.sign(got) * torch.sign(v) >= 0).all()
    low = (v.abs() / v.norm() * levels).floor()
    assert ((scaled.abs().round() - low).abs() <= 1).all()  # rounded to a neighbouring level
    assert torch.equal(c.compress(v, key=(0, 3)), got)


def test_qsgd_is_unbiased_and_rescaled_qsgd_divides_by_tau():
    v = vector(50)
    c = QSGD(2, seed=0)
    mean = torch.stack([c.compress(v, key=(1, t)) for t in range(3000)]).mean(0)
    assert (mean - v).norm() / v.norm() < 0.05
    r = QSGD(2, seed=0, rescale=True)
    tau = 1 + min(50 / 4, math.sqrt(50) / 2)
    torch.testing.assert_close(r.compress(v, key=(1, 0)), c.compress(v, key=(1, 0)) / tau)


def test_zero_vector_and_bad_buffers():
    z = torch.zeros(40, dtype=torch.float64)
    for c in (TopK(0.25), RandomK(0.25), ScaledSign(), QSGD(4)):
        assert torch.equal(c.compress(z), z)
        with pytest.raises(ValueError, match="bytes"):
            c.decode(torch.zeros(3, dtype=torch.uint8), 40, torch.float64)


def test_make_and_bad_options_are_refused():
    assert isinstance(codecs.make("top_k", ratio=0.5), TopK)
    assert isinstance(codecs.make("qsgd", levels=8, rescale=True), QSGD)
    for bad in (0, -0.1, 1.01, None):
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            codecs.make("random_k", ratio=bad)
    with pytest.raises(ValueError, match="levels"):
        QSGD(0)
    assert codecs.make("fp16").dtype == torch.float16 and codecs.make("bf16").dtype == torch.bfloat16
    assert isinstance(codecs.make("int8"), codecs.Int8)
    with pytest.raises(ValueError, match="valid: top_k"):
        codecs.make("int4")


def test_pack_bits_round_trip():
    codes = torch.randint(0, 33, (101,), generator=torch.Generator().manual_seed(0))
    packed = codecs.pack_bits(codes, 6)
    assert packed.numel() == math.ceil(101 * 6 / 8)
    assert torch.equal(codecs.unpack_bits(packed, 101, 6), codes)


def test_fp16_and_bf16_keep_what_their_formats_keep():
    """fp16: 10 fraction bits, largest finite 65504; bf16: 7 fraction bits, float32's range."""
    v = torch.tensor([1 + 2**-10, 1 + 2**-7, 1e5], dtype=torch.float64)
    fp16, bf16 = codecs.make("fp16").compress(v), codecs.make("bf16").compress(v)
    assert fp16[0] == 1 + 2**-10 and fp16[1] == 1 + 2**-7 and fp16[2] == float("inf")
    assert bf16[0] == 1 and bf16[1] == 1 + 2**-7 and bf16[2] == 99840  # 1e5 to 8 significant bits
