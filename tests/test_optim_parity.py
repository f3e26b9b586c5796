"""AllReduce and DPSGD (both orders) against the numpy reference, on every backend with 4 peers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import reference
import torch
from peers import quadratic as q

import topologies
from dpsgd.backends import spawn
from dpsgd.comm import run_local

N = 4
PEER_SCRIPT = str(Path(__file__).parent / "peers" / "quadratic.py")


def expected(case):
    algorithm, topo_name, order, momentum = case
    A, b, x0 = q.problem(N)
    topo = topologies.make(topo_name, N)
    return reference.run(algorithm, A, b, x0, q.STEPS, q.LR, momentum, topo.mixing_matrix, order or "cta")


def check(per_rank):
    """per_rank[r][case] is rank r's trajectory (steps, d)."""
    for c, case in enumerate(q.CASES):
        got = np.stack([np.array(per_rank[r][c]) for r in range(N)], axis=1)  # (steps, n, d)
        np.testing.assert_allclose(got, expected(case), rtol=0, atol=1e-10, err_msg=f"case {case}")


def test_local_backend_matches_reference():
    check(run_local(N, q.all_trajectories))


@pytest.mark.parametrize("backend", ["mpi", pytest.param("torch", marks=pytest.mark.slow)])  # soak: torch's
def test_real_processes_match_reference(backend, tmp_path):
    code = spawn(backend, N, [PEER_SCRIPT, backend, str(tmp_path)], timeout_s=120)
    assert code == 0, f"{backend} peers exited with {code}"
    check([json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(N)])


def test_allreduce_equals_large_batch_sgd():
    """4 peers with batches of 8 under AllReduce == one model with the union batch of 32."""
    torch.manual_seed(0)
    X, Y = torch.randn(32, 6, dtype=torch.float64), torch.randn(32, 2, dtype=torch.float64)
    w0 = torch.randn(6, 2, dtype=torch.float64)

    def peer(comm):
        w = torch.nn.Parameter(w0.clone())
        from dpsgd.optim import AllReduce

        opt = AllReduce(torch.optim.SGD([w], lr=0.1, momentum=0.9), comm=comm)
        xs, ys = X[comm.rank * 8 : (comm.rank + 1) * 8], Y[comm.rank * 8 : (comm.rank + 1) * 8]
        for _ in range(5):
            opt.zero_grad()
            (xs @ w - ys).pow(2).mean().backward()
            opt.step()
        return w.detach()

    w = torch.nn.Parameter(w0.clone())
    big = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    for _ in range(5):
        big.zero_grad()
        (X @ w - Y).pow(2).mean().backward()
        big.step()
    for got in run_local(N, peer):
        torch.testing.assert_close(got, w.detach(), rtol=0, atol=1e-12)


def test_single_peer_is_plain_sgd():
    def peer(comm):
        return q.trajectory(comm, ("dpsgd", "ring", "cta", 0.9))

    got = np.array(run_local(1, peer)[0])
    A, b, x0 = q.problem(1)
    want = reference.run("allreduce", A, b, x0, q.STEPS, q.LR, 0.9)[:, 0]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_overlap_gives_the_same_trajectory_and_counts_the_window():
    """DPSGD(overlap=True): x^k is sent before the forward pass; the update is unchanged."""
    import time

    from dpsgd.optim import DPSGD

    HIDDEN_S = 0.02

    def peer(comm, overlap):
        A, b, x0 = q.problem(comm.size)
        A_i, b_i = torch.tensor(A[comm.rank]), torch.tensor(b[comm.rank])
        x = torch.nn.Parameter(torch.tensor(x0[comm.rank]))
        opt = DPSGD(
            torch.optim.SGD([x], lr=q.LR, momentum=0.9),
            topology=topologies.make("ring", comm.size),
            comm=comm,
            overlap=overlap,
        )
        for _ in range(q.STEPS):
            if opt.overlap:
                opt.start_communication()
            time.sleep(HIDDEN_S)  # the "forward and backward" the exchange hides behind
            opt.zero_grad()
            (0.5 / q.ROWS * (A_i @ x - b_i).pow(2).sum()).backward()
            opt.step()
        return x.detach().clone(), comm.stats.overlap_s

    plain, early = run_local(N, peer, False), run_local(N, peer, True)
    for (a, window_a), (b, window_b) in zip(plain, early):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        # the overlapped run counts every hidden window; the plain one counts only the moments
        # between send and wait inside step (a few ms on a loaded machine, never half of them)
        assert window_b >= q.STEPS * HIDDEN_S
        assert window_a < q.STEPS * HIDDEN_S / 2
