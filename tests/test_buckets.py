"""Gradient buckets: the plan, AllReduce(overlap=True) equal to large-batch SGD with its all-reduces
started inside the backward pass, and the same numbers as without overlap on real processes."""

from __future__ import annotations

import pytest
import torch
from runs import summary

from dpsgd.comm import codecs, run_local
from dpsgd.optim import AllReduce
from dpsgd.optim.buckets import plan_buckets

N, STEPS = 3, 4


def test_plan_packs_consecutive_parameters_up_to_the_size():
    ps = [torch.zeros(n) for n in (10, 10, 30, 5, 5)]  # float32: 40, 40, 120, 20, 20 bytes
    sizes = [[p.numel() for p in b] for b in plan_buckets(ps, 80)]
    assert sizes == [[10, 10], [30], [5, 5]]  # a tensor larger than a bucket travels alone
    mixed = plan_buckets(
        [torch.zeros(2), torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)], 1000
    )
    assert [[p.dtype for p in b] for b in mixed] == [[torch.float32], [torch.float64] * 2]


def _fresh_model():
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)
    ).double()


with torch.random.fork_rng():  # made once: local peers are threads sharing torch's global RNG
    torch.manual_seed(0)
    _INITIAL = _fresh_model().state_dict()


def _model():
    model = _fresh_model()
    model.load_state_dict(_INITIAL)
    return model


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N * 8, 6, generator=g, dtype=torch.float64), torch.randn(
        N * 8, 2, generator=g, dtype=torch.float64
    )


@pytest.mark.parametrize("overlap", [True, False])
def test_bucketed_allreduce_is_large_batch_sgd(overlap):
    X, Y = _data()

    def peer(comm):
        model = _model()
        # 300 bytes: each bucket holds one or two of the six tensors
        opt = AllReduce(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), comm=comm, overlap=overlap, bucket_mb=300 / 2**20
        )
        xs, ys = X[comm.rank * 8 : (comm.rank + 1) * 8], Y[comm.rank * 8 : (comm.rank + 1) * 8]
        started_in_backward, storages = [], []
        for _ in range(STEPS):
            opt.zero_grad()
            before = comm.stats.calls.get("allreduce_sum", 0)
            (model(xs) - ys).pow(2).mean().backward()
            started_in_backward.append(comm.stats.calls.get("allreduce_sum", 0) - before)
            opt.step()
            storages.append({p.grad.untyped_storage().data_ptr() for p in model.parameters()})
        return [p.detach() for p in model.parameters()], started_in_backward, len(opt.buckets.buckets), storages

    model = _model()
    big = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(STEPS):
        big.zero_grad()
        (model(X) - Y).pow(2).mean().backward()
        big.step()
    for params, started, buckets, storages in run_local(N, peer):
        assert buckets >= 4
        # the averaged gradients are views of one buffer per bucket, the same buffers every step
        assert len(storages[0]) == buckets and all(s == storages[0] for s in storages)
        for got, want in zip(params, model.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-12)
        # overlap: every bucket's all-reduce was started by the backward pass itself
        assert started == ([buckets] * STEPS if overlap else [0] * STEPS)


def test_in_place_allreduce_sums_into_the_buffer():
    def peer(comm):
        buf = torch.full((5,), float(comm.rank + 1), dtype=torch.float64)
        (out,) = comm.start_allreduce_sum_(buf).wait()
        with pytest.raises(ValueError, match="one flat contiguous buffer"):
            comm.start_allreduce_sum_(torch.zeros(4, 2, dtype=torch.float64).t())
        return out.data_ptr() == buf.data_ptr(), buf.tolist()

    assert run_local(N, peer) == [(True, [6.0] * 5)] * N


def test_second_backward_before_step_is_refused():
    def peer(comm):
        model = _model()
        AllReduce(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, overlap=True)  # its hooks stay
        x = torch.ones(2, 6, dtype=torch.float64)
        model(x).sum().backward()
        with pytest.raises(RuntimeError, match="call step\\(\\) after every backward"):
            model(x).sum().backward()
        return True

    assert run_local(1, peer) == [True]


@pytest.mark.parametrize("backend", ["mpi", pytest.param("torch", marks=pytest.mark.slow)])
def test_overlap_gives_the_same_numbers_on_real_processes(app, backend, tmp_path):
    """Tiny buckets (several per step) started during backward on real peers: the numbers of the
    unbucketed, unoverlapped run on the local backend."""
    short = ["epochs=1", "peers=2", "algorithm=allreduce"]
    runs = {}
    for name, extra in (
        ("plain", ["backend=local", "algorithm.bucket_mb=100"]),
        ("overlap", [f"backend={backend}", "algorithm.overlap=true", "algorithm.bucket_mb=0.002"]),
    ):
        proc = app(short + extra, tmp_path / name)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        runs[name] = summary(tmp_path / name)
    assert runs["overlap"]["steps"] == runs["plain"]["steps"]
    for key in ("test_accuracy", "train_loss", "test_loss", "mb_sent_per_peer"):
        assert runs["overlap"][key] == pytest.approx(runs["plain"][key], rel=1e-4, abs=1e-6), key


def test_overlap_with_compression_is_refused():
    def peer(comm):
        model = _model()
        with pytest.raises(ValueError, match="use compression=none or overlap=false"):
            AllReduce(torch.optim.SGD(model.parameters(), lr=0.1), comm=codecs.wrap(comm, "int8"), overlap=True)
        return True

    assert run_local(2, peer) == [True, True]
