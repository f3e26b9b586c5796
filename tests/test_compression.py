"""Compressed communicators with error feedback (dpsgd.comm.codecs): the quantizers against numpy (values
and dtypes), the error memories holding exactly what was not sent, the bytes counted against the
payload, the optimizers on a compressed communicator, and PowerSGD against torch's own DDP hook."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import topologies
from dpsgd.backends import spawn
from dpsgd.comm import codecs, run_local
from dpsgd.comm.codecs import Int8, wrap
from dpsgd.optim import DPSGD, AllReduce, DiLoCo, StreamingDiLoCo

PEER_SCRIPT = str(Path(__file__).parent / "peers" / "powersgd_peer.py")


def vector(n, seed=0, dtype=torch.float32):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=dtype) * 3


# --- the quantizers against numpy -------------------------------------------------------------------
def bf16_reference(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 -> float32, round to nearest even, on the bit pattern."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


def wire_codes(name: str, x: np.ndarray) -> np.ndarray:
    """What numpy says the bytes on the wire hold: float16 bits, bfloat16 bits, int8 codes."""
    if name == "fp16":
        return x.astype(np.float16).view(np.uint16)
    if name == "bf16":
        return (bf16_reference(x).view(np.uint32) >> 16).astype(np.uint16)
    return np.clip(np.round(x / (np.abs(x).max() / 127)), -127, 127).astype(np.int8)


def int8_reference(x: np.ndarray) -> np.ndarray:
    scale = np.abs(x).max() / 127
    return np.clip(np.round(x / scale), -127, 127) * scale if scale > 0 else np.zeros_like(x)


@pytest.mark.parametrize("n", [1, 5, 1000])
def test_quantizers_match_numpy_and_send_their_nbytes(n):
    v = vector(n)
    x = v.numpy()
    wire_type = {"fp16": np.uint16, "bf16": np.uint16, "int8": np.int8}
    for name, want, per_entry, fixed in (
        ("fp16", x.astype(np.float16).astype(np.float32), 2, 0),
        ("bf16", bf16_reference(x), 2, 0),
        ("int8", int8_reference(x), 1, 4),
    ):
        codec = codecs.make(name)
        buf = codec.encode(v)
        assert buf.dtype == torch.uint8 and buf.numel() == codec.nbytes(n, v.dtype) == n * per_entry + fixed
        # the wire holds codes of the named type (fp16 and bf16 have the same size, not the same bits)
        np.testing.assert_array_equal(buf.numpy()[fixed:].view(wire_type[name]), wire_codes(name, x), name)
        np.testing.assert_array_equal(codec.decode(buf, n, v.dtype).numpy(), want.astype(np.float32), name)


def test_int8_sends_a_zero_vector_as_zeros():
    z = torch.zeros(7)
    assert torch.equal(Int8().compress(z), z)


# --- the compressed all-reduce ---------------------------------------------------------------------
N, D, STEPS = 3, 10, 6  # 10 entries over 3 peers: chunks of 4, the last one padded


def allreduce_run(name, error_feedback=True):
    def peer(comm):
        msgs = wrap(comm, {"name": name, "error_feedback": error_feedback})
        inputs, results = [], []
        for t in range(STEPS):
            g = vector(D, seed=100 * t + comm.rank, dtype=torch.float64)
            inputs.append(g.numpy().copy())
            (out,) = msgs.allreduce_mean([g.view(2, 5)], stream="gradients")
            results.append(out.reshape(-1).numpy().copy())
        memory = msgs.streams["gradients"]
        kept = [memory.get(k, torch.zeros(1)).numpy().reshape(-1) for k in ("sent", "owned")]
        return inputs, results, *kept, comm.stats.bytes_sent

    return run_local(N, peer)


@pytest.mark.parametrize("name", ["int8", "fp16", "bf16"])
def test_the_error_memories_hold_exactly_what_was_not_sent(name):
    """sum_t result_t + mean_i e_i + f = sum_t mean_i g_i, f the owners' memories of their chunks."""
    per_peer = allreduce_run(name)
    inputs = np.array([p[0] for p in per_peer])  # (n, steps, d)
    results = [np.array(p[1]) for p in per_peer]
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])  # every peer the same mean
    owned = np.concatenate([p[3] for p in per_peer])[:D]  # peer k's memory is chunk k's
    sent_errors = np.mean([p[2] for p in per_peer], axis=0)
    accumulated = results[0].sum(0) + sent_errors + owned
    np.testing.assert_allclose(accumulated, inputs.mean(0).sum(0), rtol=0, atol=1e-12)
    assert np.abs(sent_errors).max() > 0  # something was dropped, and kept
    step_error = np.abs(results[0][-1] - inputs[:, -1].mean(0)).max()
    # measured 0.024, 0.0013, 0.0073: bf16 (8 significant bits) cannot pass as fp16 (11)
    assert step_error < {"int8": 0.05, "fp16": 0.004, "bf16": 0.02}[name]


def test_without_error_feedback_the_dropped_part_is_lost():
    per_peer = allreduce_run("int8", error_feedback=False)
    inputs = np.array([p[0] for p in per_peer])
    results = np.array(per_peer[0][1])
    assert np.abs(per_peer[0][2]).max() == 0
    assert np.abs(results.sum(0) - inputs.mean(0).sum(0)).max() > 1e-3


def test_bytes_counted_are_the_encoded_chunks():
    chunk = math.ceil(D / N)
    per_step = {
        "int8": 2 * (N - 1) * Int8().nbytes(chunk, torch.float64),
        "fp16": 2 * (N - 1) * 2 * chunk,
    }
    for name, want in per_step.items():
        for peer in allreduce_run(name):
            assert peer[4] == STEPS * want, name


# --- the optimizers ---------------------------------------------------------------------------------
def quadratic_peer(make_optimizer, steps=12):
    def peer(comm):
        x0 = torch.randn(4, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        w = torch.nn.Parameter(x0 + comm.rank)
        opt = make_optimizer([w], comm)
        target = torch.arange(12, dtype=torch.float64).view(4, 3) * (comm.rank + 1)
        for _ in range(steps):
            opt.zero_grad()
            ((w - target) ** 2).sum().backward()
            opt.step()
        return w.detach().clone(), comm.stats.bytes_sent

    return peer


def test_dpsgd_with_int8_keeps_the_average_model_and_sends_a_quarter():
    topo = topologies.make("ring", 4)
    runs = {}
    for name in ("none", "int8"):

        def make(params, comm, name=name):
            return DPSGD(torch.optim.SGD(params, lr=0.0), topology=topo, comm=wrap(comm, name), broadcast_initial=False)

        runs[name] = run_local(4, quadratic_peer(make))
    means = {k: torch.stack([w for w, _ in v]).mean(0) for k, v in runs.items()}
    x0 = torch.randn(4, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    initial_mean = x0 + 1.5  # peers start at x0 + rank
    torch.testing.assert_close(means["int8"], initial_mean, rtol=0, atol=1e-12)  # lr 0: gossip alone
    spread = torch.stack([w for w, _ in runs["int8"]]).std(0).max()
    assert spread < 0.05  # and it reaches consensus
    exact_bytes, int8_bytes = runs["none"][0][1], runs["int8"][0][1]
    assert int8_bytes == 12 * 2 * Int8().nbytes(12, torch.float64)  # two neighbours, 12 steps
    assert exact_bytes == 12 * 2 * 12 * 8


def test_allreduce_with_fp16_stays_identical_and_near_exact():
    def make(name):
        return lambda params, comm: AllReduce(torch.optim.SGD(params, lr=0.05), comm=wrap(comm, name))

    exact = run_local(4, quadratic_peer(make("none")))
    fp16 = run_local(4, quadratic_peer(make("fp16")))
    for w, _ in fp16[1:]:
        assert torch.equal(w, fp16[0][0])
    torch.testing.assert_close(fp16[0][0], exact[0][0], rtol=0, atol=1e-3)  # measured 2.2e-4
    assert 4 * fp16[0][1] == exact[0][1]  # float64 values as 2 bytes each, in chunks of 12 / 4


def test_diloco_with_int8_deltas_sends_less_and_moves_like_exact():
    def make(name):
        return lambda params, comm: DiLoCo(torch.optim.SGD(params, lr=0.05), comm=wrap(comm, name), period=3)

    exact = run_local(4, quadratic_peer(make("none")))
    int8 = run_local(4, quadratic_peer(make("int8")))
    for w, _ in int8[1:]:
        assert torch.equal(w, int8[0][0])
    scale = exact[0][0].abs().max()
    torch.testing.assert_close(int8[0][0], exact[0][0], rtol=0, atol=0.002 * scale)
    assert exact[0][1] == 4 * 2 * 3 / 4 * 12 * 8  # 4 outer steps (12 steps, period 3)
    assert int8[0][1] == 4 * 2 * 3 * Int8().nbytes(3, torch.float64)  # in chunks of 3 deltas


def test_compression_errors_name_the_choices():
    def peer(comm):
        w = torch.nn.Parameter(torch.zeros(2))
        with pytest.raises(ValueError, match="compression=powersgd compresses all-reduce means"):
            DPSGD(torch.optim.SGD([w], lr=0.1), topology=topologies.make("ring", 2), comm=wrap(comm, "powersgd"))
        with pytest.raises(ValueError, match="unknown codec 'int4'; valid: top_k, random_k, sign, qsgd, fp16"):
            wrap(comm, "int4")
        with pytest.raises(ValueError, match="codec int8 takes no options; got ratio"):
            wrap(comm, {"name": "int8", "ratio": 0.1})

    run_local(2, peer)


# --- PowerSGD against torch's DDP hook -------------------------------------------------------------
def test_powersgd_parameters_equal_torchs_ddp_hook(tmp_path):
    """2 gloo processes, the same MLP and data: DDP with powerSGD_hook against AllReduce on a PowerSGD communicator,
    rank 1 (Gram-Schmidt) and rank 4 (QR, one matrix left exact), start_iter 2 and 3, 8 SGD steps."""
    code = spawn("torch", 2, [PEER_SCRIPT, "torch", str(tmp_path)], timeout_s=120)
    assert code == 0, f"torch peers exited with {code}"
    for r in range(2):
        cases = json.loads((tmp_path / f"rank{r}.json").read_text())
        for case in cases:
            assert case["bucket_order"] == [3, 2, 1, 0]  # DDP's bucket: last parameter first, as AllReduce sends
            for theirs, ours in zip(case["torch"], case["ours"]):
                np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6)
            moved = max(np.abs(np.array(o) - np.array(e)).max() for o, e in zip(case["ours"], case["exact"]))
            assert moved > 1e-3  # PowerSGD's result differs from the exact all-reduce's
        # rank 4 from step 3 of 8: W1 (32x32) as P and Q (32x4 each); W2 (10x32) and the biases exact
        exact_step = (32 * 32 + 32 + 10 * 32 + 10) * 4
        compressed_step = (32 * 4 + 32 * 4 + 10 * 32 + 32 + 10) * 4
        assert cases[1]["bytes"] == 3 * exact_step + 5 * compressed_step  # 2 peers: the ring sends each byte once


# --- resume ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        lambda params, comm: AllReduce(
            torch.optim.SGD(params, lr=0.05), comm=wrap(comm, {"name": "powersgd", "rank": 1, "start_iter": 2})
        ),
        lambda params, comm: AllReduce(torch.optim.SGD(params, lr=0.05), comm=wrap(comm, "int8")),
        lambda params, comm: StreamingDiLoCo(
            torch.optim.SGD(params, lr=0.05), comm=wrap(comm, "int8"), period=4, fragments=2, delay=1
        ),
    ],
    ids=["powersgd", "int8", "streaming_diloco"],
)
def test_a_resumed_run_continues_bit_for_bit(make):
    """7 steps, a weights-only checkpoint (a fragment's sync in flight for Streaming DiLoCo), 5 more: the
    same parameters as 12 steps straight."""

    def peer(comm):
        target = torch.arange(12, dtype=torch.float64).view(2, 2, 3) * (comm.rank + 1)

        def run(steps, ws, opt, start=0):
            for t in range(start, start + steps):
                opt.zero_grad()
                sum(((w - y) ** 2 * (1 + t % 3)).sum() for w, y in zip(ws, target)).backward()
                opt.step()

        def fresh():
            ws = [torch.nn.Parameter(torch.ones(2, 3, dtype=torch.float64) * comm.rank) for _ in range(2)]
            return ws, make(ws, comm)

        straight, opt = fresh()
        run(12, straight, opt)
        first, opt = fresh()
        run(7, first, opt)
        buf = io.BytesIO()
        torch.save({"ws": [w.detach().clone() for w in first], "opt": opt.state_dict()}, buf)
        buf.seek(0)
        saved = torch.load(buf, weights_only=True)
        resumed, opt = fresh()
        with torch.no_grad():
            for w, value in zip(resumed, saved["ws"]):
                w.copy_(value)
        opt.load_state_dict(saved["opt"])
        run(5, resumed, opt, start=7)
        same = all(torch.equal(a, b) for a, b in zip(resumed, straight))
        return same, all(torch.equal(a, b) for a, b in zip(resumed, first))

    for same, unchanged in run_local(2, peer):
        assert same and not unchanged
