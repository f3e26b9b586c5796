"""`neighbor_exchange(..., out=)`: the received buffers written to the caller's tensors and returned (on mpi received
into them directly; on the local backend, whose peers hand each other tensors, copied to), the same values as the
default form, a second call overwriting them; a lazy conjugate sent as its values; every wrong `out=` refused in one
line before anything is sent (dpsgd.comm.base._receive_into)."""

from __future__ import annotations

import json
import time

import pytest
import torch
from peers import exchange_out_peer as peer

from dpsgd.backends import spawn
from dpsgd.comm import LocalCommunicator, PeerTimeoutError, run_local
from dpsgd.comm.codecs import Cast, Compressed

N = peer.N


def check(per_rank: list[dict], directly: bool) -> None:
    for rank, got in enumerate(per_rank):
        left, right = (rank - 1) % N, (rank + 1) % N
        want = [peer.values(left).tolist(), peer.values(right).tolist()]
        assert got["default"] == want and got["out"] == want
        assert got["out_again"] == [[2 * v for v in w] for w in want]
        assert got["out_is_returned"] and got["out_received_in_place"]
        assert got["received_directly"] == [directly, directly]
        assert got["conjugate_real"] == want and got["conjugate_imag"] == [[-v for v in w] for w in want]
        assert got["out_reversed"] == want[::-1]


def test_out_on_local_peers_is_written_and_returned():
    check(run_local(N, peer.results, timeout_s=30), directly=False)


@pytest.mark.timeout(180)
def test_out_on_mpi_is_received_into_directly(tmp_path):
    assert spawn("mpi", N, [peer.__file__, "mpi", str(tmp_path)], timeout_s=120) == 0
    check([json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(N)], directly=True)


@pytest.mark.timeout(180)
def test_out_through_host_staging_is_copied_to_directly(tmp_path):
    """Staged (the path of CUDA tensors on a transport that reads host memory; here CPU tensors, staging=always):
    each host buffer received is copied straight to its out= tensor, with no device buffer between."""
    assert spawn("mpi", N, [peer.__file__, "mpi", str(tmp_path), "staged"], timeout_s=120) == 0
    check([json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(N)], directly=True)


@pytest.mark.timeout(180)
def test_out_on_torch_is_received_into_directly(tmp_path):
    assert spawn("torch", N, [peer.__file__, "torch", str(tmp_path)], timeout_s=150) == 0
    check([json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(N)], directly=True)


def test_a_wrong_out_is_refused_before_anything_is_sent():
    def refusals(comm):
        left, right = (comm.rank - 1) % N, (comm.rank + 1) % N
        x, peers, shared = torch.zeros(4), [left, right], torch.zeros(8)
        c = torch.zeros(4, dtype=torch.complex64)
        wrong = [  # (the error, what its message says, the buffer sent, recv_from, out=)
            (ValueError, "one tensor per peer of recv_from, got 1", x, peers, [torch.zeros(4)]),
            (ValueError, "cannot be used where recv_from names a peer twice", x, [left, left], [torch.zeros(4)] * 2),
            (ValueError, "cannot be used where recv_from names a peer twice", x, [left, left], [torch.zeros(4)]),
            (ValueError, r"is \(5,\) torch.float32", x, peers, [torch.zeros(4), torch.zeros(5)]),
            (ValueError, "torch.float64", x, peers, [torch.zeros(4), torch.zeros(4, dtype=torch.float64)]),
            (ValueError, "is not contiguous", x, peers, [torch.zeros(4), torch.zeros(2, 2).t()]),
            (ValueError, "lazy conjugate", c, peers, [torch.zeros_like(c), torch.zeros_like(c).conj()]),
            (ValueError, "requires grad", x, peers, [torch.zeros(4), torch.zeros(4, requires_grad=True)]),
            (ValueError, "shares memory with the buffer sent", x, peers, [x, torch.zeros(4)]),
            (ValueError, "shares memory with out= tensor 0", x, peers, [shared[:4], shared[2:6]]),
            (ValueError, "tensor 1 .* shares memory with out= tensor 0", x, peers, [shared[2:6], shared[:4]]),
            (ValueError, "tensor 0 .* shares memory with the buffer sent", shared[2:6], peers, [shared[:4], x]),
            (TypeError, "tensor 1 \\(peer .\\) is a NoneType", x, peers, [torch.zeros(4), None]),
        ]
        for error, expected, buf, recv_from, out in wrong:
            with pytest.raises(error, match=f"rank {comm.rank}: neighbor_exchange's out= .*{expected}"):
                comm.neighbor_exchange(buf, peers, recv_from, out=out)
        # nothing was sent: the next exchange meets its partners' and carries the right values; the two halves of one
        # tensor touch without sharing memory, each receives one
        got = comm.neighbor_exchange(torch.full((4,), float(comm.rank)), peers, peers, out=[shared[4:], shared[:4]])
        assert got[0].data_ptr() == shared[4:].data_ptr()
        return [t.tolist() for t in got]

    for rank, got in enumerate(run_local(N, refusals, timeout_s=30)):
        assert got == [[float((rank - 1) % N)] * 4, [float((rank + 1) % N)] * 4]


def test_a_backend_written_before_out_still_exchanges():
    class Older(LocalCommunicator):
        def _start_exchange(self, buf, send_to, recv_from, tag):  # the signature before `into`
            return super()._start_exchange(buf, send_to, recv_from, tag)

    def peer(comm):
        older = Older(comm.world, comm.rank, comm.timeout_s)
        other, x = 1 - comm.rank, torch.full((2,), float(comm.rank))
        alone = older.neighbor_exchange(x, [other], [other])[0].tolist()
        wrapper = Compressed(older, Cast(torch.bfloat16))
        wrapped = wrapper.neighbor_exchange(x, [other], [other])[0].tolist()  # (passed through to `older`)
        ex = wrapper._exchange(x, [other], [other], tag=7)  # the wrapper's own transport primitive, into `older`'s
        ex.wait(time.monotonic() + 30)
        return alone, wrapped, ex.received[other].tolist()

    got = run_local(2, peer, timeout_s=30)
    assert got == [([1.0, 1.0], [1.0, 1.0], [1.0, 1.0]), ([0.0, 0.0], [0.0, 0.0], [0.0, 0.0])]


def test_an_operation_that_timed_out_is_kept_with_its_memory():
    """A transfer still posted after a timeout may write the memory it was given (an MPI request holds only its
    address): the communicator keeps the operation, so that memory is never freed and reused under it."""

    def peer(comm):
        if comm.rank == 1:
            return None  # never answers
        with pytest.raises(PeerTimeoutError, match="neighbor_exchange timed out"):
            comm.neighbor_exchange(torch.zeros(3), [1], [1], out=[torch.zeros(3)])
        return len(comm._timed_out)

    assert run_local(2, peer, timeout_s=0.5)[0] == 1
