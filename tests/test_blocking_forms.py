"""The blocking average and mix read one contiguous tensor in place (the caller lends it for the call; the started
forms send a copy, dpsgd.comm.base._start_neighbor_average): their results against numpy's W @ X, the lent tensor
left as it was, the result its own memory. Local peers, so no process starts."""

from __future__ import annotations

import numpy as np
import torch

import topologies
from dpsgd.comm import run_local
from dpsgd.comm.codecs import Cast, Compressed

N = 3


def values(rank: int) -> torch.Tensor:
    return torch.arange(5, dtype=torch.float64) * (rank + 1) + 10 * rank


def reference() -> np.ndarray:
    w = topologies.make("ring", N).mixing_matrix()
    return w @ np.stack([values(r).numpy() for r in range(N)])


def blocking(comm, wrap=None):
    comm = wrap(comm) if wrap else comm
    ring = topologies.make("ring", N)
    x = values(comm.rank)
    kept = x.clone()
    average = comm.neighbor_average([x], ring.neighbors(comm.rank))[0]
    mixed = comm.mix([x], ring, 0)[0]
    assert torch.equal(x, kept)  # lent: read, never written
    assert average.data_ptr() != x.data_ptr() and mixed.data_ptr() != x.data_ptr()
    average.add_(1.0)  # the result is the caller's own: writing it leaves the lent tensor alone
    assert torch.equal(x, kept)
    started = comm.start_neighbor_average([x], ring.neighbors(comm.rank)).wait()[0]
    return average.sub_(1.0).numpy(), mixed.numpy(), started.numpy()


def test_the_blocking_average_and_mix_read_a_lent_tensor_in_place_and_leave_it_unchanged():
    want = reference()
    for rank, (average, mixed, started) in enumerate(run_local(N, blocking, timeout_s=30)):
        np.testing.assert_allclose(average, want[rank], rtol=0, atol=1e-12)
        np.testing.assert_allclose(mixed, want[rank], rtol=0, atol=1e-12)
        assert np.array_equal(average, started)  # the same sum, bit for bit, as the form that sends a copy


def test_a_wrapper_takes_the_lent_tensor_as_it_takes_any():
    want = reference()
    got = run_local(N, blocking, lambda comm: Compressed(comm, Cast(torch.bfloat16)), timeout_s=30)
    for rank, (average, mixed, _) in enumerate(got):  # bf16 on the wire: 8 bits of mantissa
        np.testing.assert_allclose(average, want[rank], rtol=1e-2)
        np.testing.assert_allclose(mixed, want[rank], rtol=1e-2)
