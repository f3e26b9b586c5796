"""`neighbor_exchange(..., out=)`: the received buffers written to the caller's tensors and returned (on mpi received
into them directly; on the local backend, whose peers hand each other tensors, copied to), the same values as the
default form, a second call overwriting them; a lazy conjugate sent as its values; every wrong `out=` refused in one
line before anything is sent (dpsgd.comm.base._receive_into)."""

from __future__ import annotations

import json

import pytest
import torch
from peers import exchange_out_peer as peer

from dpsgd.backends import spawn
from dpsgd.comm import run_local

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


def test_out_on_local_peers_is_written_and_returned():
    check(run_local(N, peer.results, timeout_s=30), directly=False)


@pytest.mark.timeout(180)
def test_out_on_mpi_is_received_into_directly(tmp_path):
    assert spawn("mpi", N, [peer.__file__, "mpi", str(tmp_path)], timeout_s=120) == 0
    check([json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(N)], directly=True)


def test_a_wrong_out_is_refused_before_anything_is_sent():
    def refusals(comm):
        left, right = (comm.rank - 1) % N, (comm.rank + 1) % N
        x, peers, shared = torch.zeros(4), [left, right], torch.zeros(8)
        c = torch.zeros(4, dtype=torch.complex64)
        wrong = [  # (what the message says, the buffer sent, out=)
            ("for 2 peer", x, [torch.zeros(4)]),
            ("elements of torch.float32", x, [torch.zeros(4), torch.zeros(5)]),
            ("torch.float64", x, [torch.zeros(4), torch.zeros(4, dtype=torch.float64)]),
            ("not contiguous", x, [torch.zeros(4), torch.zeros(2, 2).t()]),
            ("lazy conjugate", c, [torch.zeros_like(c), torch.zeros_like(c).conj()]),
            ("shares memory with the buffer sent", x, [x, torch.zeros(4)]),
            ("another out= tensor", x, [shared[:4], shared[2:6]]),
        ]
        for expected, buf, out in wrong:
            with pytest.raises(ValueError, match=expected):
                comm.neighbor_exchange(buf, peers, peers, out=out)
        # nothing was sent: the next exchange meets its partners' and carries the right values
        return [t.tolist() for t in comm.neighbor_exchange(torch.full((4,), float(comm.rank)), peers, peers)]

    for rank, got in enumerate(run_local(N, refusals, timeout_s=30)):
        assert got == [[float((rank - 1) % N)] * 4, [float((rank + 1) % N)] * 4]
