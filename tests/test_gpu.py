"""On a CUDA GPU only (`make gpu-check` runs these there): placement, staging and overlap on the device,
AD-PSGD's host messages, the fleet on the GPU. Elsewhere they skip, saying why."""

from __future__ import annotations

import pytest
import torch

from dpsgd import placement
from dpsgd.comm.local import run_local
from dpsgd.comm.staging import HostStaging
from topologies import Neighbors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU (torch.cuda.is_available() is False); `make gpu-check` runs it on a GPU machine",
    ),
]


def test_place_makes_the_peers_gpu_current():
    from dpsgd.config import parse

    cfg = {"device": "cuda", "device_share": True, "backend": {"name": "mpi"}}
    device = placement.place(parse(cfg), 0, 1)
    assert device == torch.device("cuda", 0) and torch.cuda.current_device() == 0
    assert placement.single_device("auto") == torch.device("cuda", 0)
    # peers in one process (local threads) share its GPU, named with its index
    local = parse({**cfg, "backend": {"name": "local"}})
    assert placement.place(local, 3, 8, in_process=True) == torch.device("cuda", 0)


def _operations(comm, device: str, staged: bool) -> list[torch.Tensor]:
    if staged:
        comm.staging = HostStaging()  # auto: CUDA tensors only
    g = torch.Generator().manual_seed(comm.rank)
    x = [torch.randn(64, 33, generator=g).to(device), torch.randn(7, generator=g).to(device)]
    out = list(comm.allreduce_mean(x))
    other = comm.rank ^ 1
    out += comm.neighbor_average(x, Neighbors({other: 0.5}, {other: 0.5}, 0.5))
    out += comm.exchange(x, other)
    buf = torch.empty(12, device=device)
    recv = comm.start_recv(buf, other, tag=3)
    send = comm.start_send(torch.arange(12.0, device=device) * (comm.rank + 1), other, tag=3)
    comm.wait_request("send", send, [other])
    comm.wait_request("recv", recv, [other])
    return [t.cpu() for t in [*out, buf]]


def test_staged_cuda_tensors_equal_the_cpu_path_bit_for_bit():
    on_cpu = run_local(2, _operations, "cpu", False)
    staged = run_local(2, _operations, "cuda", True)
    direct = run_local(2, _operations, "cuda", False)
    for a, b, c in zip(on_cpu, staged, direct):
        assert all(torch.equal(u, v) and torch.equal(u, w) for u, v, w in zip(a, b, c))


def test_overlap_is_timed_on_the_device():
    def peer(comm):
        x = [torch.randn(1024, 1024, device="cuda")]
        handle = comm.start_allreduce_mean(x)
        for _ in range(20):  # device work queued between start and wait: what the exchange hides behind
            x[0] = x[0] @ x[0] / 1024
        handle.wait()  # timed without waiting for the device: counted once the device has got past it
        torch.cuda.synchronize()
        comm.allreduce_mean(x)
        return comm.stats.overlap_s

    assert all(s > 0 for s in run_local(2, peer))


def test_fleet_on_the_gpu_matches_the_cpu_fleet():
    from dpsgd.config import parse
    from dpsgd.sim import Fleet
    from experiments.bench.fleet_gpu import config

    losses = {}
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False  # full float32, as the CPU
    try:
        for device in ("cpu", "cuda"):
            fleet = Fleet(parse(config(8, 4, device, samples=200)))
            losses[device] = torch.stack([fleet.step(k).detach().cpu() for k in (1, 2, 3)])
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    assert torch.allclose(losses["cuda"], losses["cpu"], rtol=1e-3)


def test_adpsgd_peers_on_the_gpu_finish(app, tmp_path):
    args = ["backend=local", "algorithm=adpsgd", "peers=2", "epochs=1", "device=cuda", "device_share=true"]
    proc = app(args, tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
