"""The blocking average and mix read one contiguous tensor in place (the caller lends it for the call; the started
forms send a copy: dpsgd.comm.base._start_neighbor_average): their results, and the all-reduce mean's, against
numpy's W @ X and mean, the lent tensor left as it was, each result its own memory; on local peers, through a
wrapper, and on mpi, whose sends read the lent tensor's memory directly; and the buffers of the started forms
(`flatten`: new contiguous memory, also on its one-tensor path; `unflatten`: views of it)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from peers import blocking_forms_peer as peer

import topologies
from dpsgd.backends import spawn
from dpsgd.comm import LocalCommunicator, run_local
from dpsgd.comm.base import flatten, unflatten
from dpsgd.comm.codecs import Cast, Compressed

N = peer.N
SCRIPT = peer.__file__


def check(per_rank: list[dict], tol: float = 1e-12) -> None:
    x = np.stack([peer.values(r).numpy() for r in range(N)])
    mixed, mean = topologies.make("ring", N).mixing_matrix() @ x, x.mean(axis=0)
    for rank, got in enumerate(per_rank):
        for name in ("average", "mix", "started"):
            np.testing.assert_allclose(got[name], mixed[rank], rtol=tol, atol=tol, err_msg=name)
        np.testing.assert_allclose(got["mean"], mean, rtol=tol, atol=tol, err_msg="mean")
        if "conjugate_real" in got:  # not through a wrapper
            conjugate = np.asarray(got["conjugate_real"]) + 1j * np.asarray(got["conjugate_imag"])
            np.testing.assert_allclose(conjugate, np.conj(mixed[rank] * (1 + 1j)), rtol=tol, atol=tol)
        if tol == 1e-12:
            assert got["average"] == got["started"]  # the same sum, bit for bit, as the form that sends a copy


def test_the_blocking_forms_read_a_lent_tensor_in_place_and_leave_it_unchanged():
    check(run_local(N, peer.results, timeout_s=30))


def test_a_wrapper_takes_the_lent_tensor_as_it_takes_any():
    wrapped = run_local(N, lambda comm: peer.results(Compressed(comm, Cast(torch.bfloat16))), timeout_s=30)
    check(wrapped, tol=1e-2)  # bf16 on the wire: 8 bits of mantissa


def test_on_mpi_the_sends_read_the_lent_tensor_and_leave_it_unchanged(tmp_path):
    assert spawn("mpi", N, [SCRIPT, "mpi", str(tmp_path)], timeout_s=120) == 0
    check([json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(N)])


def test_an_integer_tensor_is_refused_by_both_forms_alike():
    def peer(comm):
        ring, x = topologies.make("ring", N), torch.arange(4) + comm.rank
        refused = []
        for average in (
            lambda: comm.neighbor_average([x], ring.neighbors(comm.rank)),
            lambda: comm.start_neighbor_average([x], ring.neighbors(comm.rank)).wait(),
        ):
            with pytest.raises(RuntimeError, match="can't be cast"):
                average()
            refused.append(True)
        return refused

    assert run_local(N, peer, timeout_s=30) == [[True, True]] * N


def test_a_subclass_overriding_a_started_form_alone_is_refused_in_one_line():
    with pytest.raises(
        TypeError, match="overrides start_mix, which neighbor_average and mix do not call; override _start_mix"
    ):

        class Mine(LocalCommunicator):
            def start_mix(self, tensors, topology, step, lazy=False):
                return super().start_mix(tensors, topology, step, lazy)


def test_flatten_gives_new_contiguous_memory_and_unflatten_its_views_for_one_tensor_or_many():
    one = [
        torch.randn(3, 4),
        torch.randn(3, 4).t(),  # not contiguous: the general path
        torch.randn(8)[::2],
        torch.tensor(2.0),
        torch.randn(2, 3, requires_grad=True),
        torch.randn(4).to(torch.bfloat16),
        torch.randn(3, dtype=torch.complex64).conj(),  # a lazy conjugate: resolved in the copy
    ]
    for t in one:
        flat = flatten([t])
        assert flat.dim() == 1 and flat.is_contiguous() and not flat.requires_grad and not flat.is_conj()
        assert flat.data_ptr() != t.data_ptr() and torch.equal(flat, t.detach().reshape(-1))
        (back,) = unflatten(flat, [t])
        assert back.shape == t.shape and back.data_ptr() == flat.data_ptr() and torch.equal(back, t.detach())
    many = [torch.randn(2, 2), torch.randn(3)]
    flat = flatten(many)
    assert torch.equal(flat, torch.cat([many[0].reshape(-1), many[1]]))
    assert all(torch.equal(a, b) for a, b in zip(unflatten(flat, many), many))
