"""One peer of a ring of 3 calling the blocking average and mix on one contiguous tensor (lent for the call: read
in place, dpsgd.comm.base._start_neighbor_average), the blocking all-reduce mean and the started average (sent as a
copy), checking on the way that the lent tensor is left as it was and each result is new memory.

Imported by tests/test_blocking_forms.py (local backend) and run as a script under mpiexec:
`python tests/peers/blocking_forms_peer.py BACKEND OUT_DIR` writes OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import torch

import topologies

N = 3


def values(rank: int) -> torch.Tensor:
    return torch.arange(5, dtype=torch.float64) * (rank + 1) + 10 * rank


def results(comm) -> dict:
    """{average, mix, mean, started}: this peer's results as lists."""
    ring = topologies.make("ring", comm.size)
    x = values(comm.rank)
    kept = x.clone()
    got = {
        "average": comm.neighbor_average([x], ring.neighbors(comm.rank))[0],
        "mix": comm.mix([x], ring, 0)[0],
        "mean": comm.allreduce_mean([x])[0],
    }
    assert torch.equal(x, kept), "a lent tensor was written"
    for name, result in got.items():
        assert result.data_ptr() != x.data_ptr(), f"{name} returned the lent tensor's memory"
        result.add_(1.0)  # the result is the caller's own: writing it leaves the lent tensor alone
        result.sub_(1.0)
    assert torch.equal(x, kept), "a result shares memory with the lent tensor"
    got["started"] = comm.start_neighbor_average([x], ring.neighbors(comm.rank)).wait()[0]
    if comm.exact is comm:  # (a codec's wire values are real)
        # a lazy conjugate is no flat buffer a transport can send as it is (numpy refuses it): copied, then averaged
        conjugate = comm.neighbor_average([(x * (1 + 1j)).conj()], ring.neighbors(comm.rank))[0]
        got["conjugate_real"], got["conjugate_imag"] = conjugate.real, conjugate.imag
    return {name: t.tolist() for name, t in got.items()}


if __name__ == "__main__":
    from runner import main

    main(results)
