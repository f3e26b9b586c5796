"""One peer of a ring of 3 exchanging with both neighbours through `neighbor_exchange`: its default form (new
buffers), `out=` (the caller's tensors, written and returned; on mpi and torch received into directly), and a lazy
conjugate (sent as its values, resolved in a copy: the transports send memory as it is).

Imported by tests/test_exchange_out.py (local backend) and run as a script under mpiexec:
`python tests/peers/exchange_out_peer.py BACKEND OUT_DIR [staged]` writes OUT_DIR/rank{r}.json (staged: through host
buffers, as CUDA tensors on a transport that reads host memory only; `backend.staging=always`).
"""

from __future__ import annotations

import torch

N = 3


def values(rank: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32) * (rank + 1) - 7 * rank


def results(comm) -> dict:
    """{default, out, out_again, out_reversed, conjugate_real, conjugate_imag: what came from each peer in recv_from
    order; out_is_returned, out_received_in_place, received_directly}."""
    left, right = (comm.rank - 1) % comm.size, (comm.rank + 1) % comm.size
    x = values(comm.rank)
    got = {"default": [t.tolist() for t in comm.neighbor_exchange(x, [left, right], [left, right])]}
    out = [torch.full((2, 3), -1.0), torch.full((2, 3), -1.0)]  # another shape, the same elements: flat views
    pointers = [o.data_ptr() for o in out]
    returned = comm.neighbor_exchange(x, [left, right], [left, right], out=out)
    got["out_is_returned"] = all(r is o for r, o in zip(returned, out))
    got["out"] = [o.reshape(-1).tolist() for o in out]
    got["out_received_in_place"] = [o.data_ptr() for o in out] == pointers
    # a second call into the same tensors overwrites them (nothing of the first call left); did the transport
    # receive into them (its exchange's buffers are theirs) or into buffers of its own, copied from?
    handle = comm.start_neighbor_exchange(x * 2, [left, right], [left, right], out=out)
    handle.wait()
    got["out_again"] = [o.reshape(-1).tolist() for o in out]
    received = handle._pending.received
    got["received_directly"] = [received[p].data_ptr() == o.data_ptr() for p, o in zip([left, right], out)]
    reversed_out = [torch.empty(6), torch.empty(6)]  # recv_from in another order than the peers' ranks
    comm.neighbor_exchange(x, [left, right], [right, left], out=reversed_out)
    got["out_reversed"] = [o.tolist() for o in reversed_out]
    conjugate = comm.neighbor_exchange((x * (1 + 1j)).conj(), [left, right], [left, right])
    got["conjugate_real"] = [c.real.tolist() for c in conjugate]
    got["conjugate_imag"] = [c.imag.tolist() for c in conjugate]
    return got


if __name__ == "__main__":
    import sys

    from runner import main

    main(results, **({"staging": "always"} if sys.argv[3:] == ["staged"] else {}))
