"""GPU peers without a GPU: which device each launcher's environment gives a peer, the one-line refusals,
and the host-staging path (dpsgd.comm.staging) forced on CPU tensors, equal bit for bit to the direct one."""

from __future__ import annotations

import os

import pytest
import torch

from dpsgd import placement
from dpsgd.comm.local import run_local
from dpsgd.comm.staging import HostStaging
from dpsgd.config import RunConfig, parse
from tests.runs import EXACT, summary
from topologies import Neighbors

TORCHRUN_4 = [{"LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "4", "RANK": str(r), "WORLD_SIZE": "4"} for r in range(4)]
LAUNCHERS = {
    "torchrun": lambda r, n: {"LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(n)},
    "mpich": lambda r, n: {"MPI_LOCALRANKID": str(r), "MPI_LOCALNRANKS": str(n), "PMI_RANK": str(r + 10)},
    "openmpi": lambda r, n: {"OMPI_COMM_WORLD_LOCAL_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_SIZE": str(n)},
    "srun": lambda r, n: {"SLURM_LOCALID": str(r), "SLURM_NTASKS_PER_NODE": str(n), "SLURM_PROCID": str(r + 4)},
}


def cfg(device="cuda", share=False, backend="mpi", dist_backend=None) -> RunConfig:
    backend_options = {"dist_backend": dist_backend} if backend == "torch" else {}
    return parse({"device": device, "device_share": share, "backend": {"name": backend, **backend_options}})


def device_of(config: RunConfig, rank: int, peers: int, **kw) -> torch.device:
    """The device placement gives peer `rank` of `peers` under the run `config`."""
    return placement.peer_device(config.device, rank, peers, share=config.device_share, **kw)


def nccl(config: RunConfig) -> bool:
    return placement.uses_nccl(config.backend, config.device)


def test_torchrun_4_processes_on_4_gpus_put_peer_r_on_cuda_r_and_nccl_never_shares():
    config = cfg(backend="torch")  # nccl: the default with device=cuda
    assert nccl(config)
    devices = [device_of(config, 0, 4, env=env, gpus=4, nccl=True) for env in TORCHRUN_4]
    assert devices == [torch.device("cuda", r) for r in range(4)]
    with pytest.raises(RuntimeError, match="4 peers on this node but 2 GPU"):
        device_of(config, 0, 4, env=TORCHRUN_4[3], gpus=2, nccl=True)
    with pytest.raises(RuntimeError, match="nccl needs one GPU per peer"):  # device_share does not lift it
        device_of(config.replace(device_share=True), 0, 4, env=TORCHRUN_4[3], gpus=2, nccl=True)


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_every_launchers_local_rank_picks_the_gpu(launcher):
    # 2 nodes of 4 peers, 4 GPUs each: the global rank never decides, the rank on the node does
    for local in range(4):
        env = LAUNCHERS[launcher](local, 4)
        assert device_of(cfg(), rank=99, peers=8, env=env, gpus=4) == torch.device("cuda", local)


def test_sharing_gpus_only_when_asked_and_never_for_nccl():
    env = LAUNCHERS["mpich"](5, 8)
    with pytest.raises(RuntimeError, match="set device_share=true"):
        device_of(cfg(), 5, 8, env=env, gpus=4)
    assert device_of(cfg(share=True), 5, 8, env=env, gpus=4) == torch.device("cuda", 1)
    # no launcher's variables (the app's own spawner): every peer on this node, by rank
    assert device_of(cfg(share=True), 6, 8, env={}, gpus=4) == torch.device("cuda", 2)
    with pytest.raises(RuntimeError, match="8 peers on this node but 1 GPU"):
        device_of(cfg(), 6, 8, env={}, gpus=1)
    # srun without --ntasks-per-node does not say how many share the node: nothing to refuse
    assert device_of(cfg(), 5, 8, env={"SLURM_LOCALID": "1"}, gpus=4) == torch.device("cuda", 1)
    # one GPU named for every peer of the node is sharing too
    with pytest.raises(RuntimeError, match="device=cuda:1 puts them all on one GPU"):
        device_of(cfg(device="cuda:1"), 0, 4, env=LAUNCHERS["mpich"](0, 4), gpus=2)
    assert device_of(cfg(device="cuda:1", share=True), 0, 4, env={}, gpus=2) == torch.device("cuda", 1)


def test_device_values():
    assert device_of(cfg(device="cpu"), 3, 4, env={}, gpus=8) == torch.device("cpu")
    assert device_of(cfg(device="cuda:3"), 0, 1, env={}, gpus=4) == torch.device("cuda", 3)
    with pytest.raises(ValueError, match="has 4 GPU"):
        device_of(cfg(device="cuda:4"), 0, 1, env={}, gpus=4)
    # peers in one process (local threads, the fleet) share its device, however many
    assert placement.place(cfg(device="cpu", backend="local"), 5, 64, in_process=True) == torch.device("cpu")
    with pytest.raises(ValueError, match="device must be one of cpu, cuda, auto"):
        placement.kind("gpu")
    assert placement.kind("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert not nccl(cfg(backend="torch", dist_backend="gloo"))
    assert not nccl(cfg(device="cpu", backend="torch"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_cuda_without_a_gpu_says_so_in_one_line():
    with pytest.raises(RuntimeError) as err:
        device_of(cfg(), 0, 1, env={})
    assert "torch sees no GPU" in str(err.value) and "\n" not in str(err.value)


def _every_operation(comm, staged: bool) -> list[torch.Tensor]:
    """The communicator's operations on a rank's own values; with `staged`, through host buffers."""
    if staged:
        comm.staging = HostStaging(always=True)
    g = torch.Generator().manual_seed(comm.rank)
    x = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g)]
    out = list(comm.allreduce_mean(x))
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    nb = Neighbors({left: 0.25, right: 0.25}, {left: 0.25, right: 0.25}, 0.5)
    out += comm.neighbor_average(x, nb)
    out += comm.exchange(x, comm.rank ^ 1)
    b = [t.clone() for t in x]
    comm.broadcast_(b, root=2)
    out += b
    buf = torch.empty(12)
    recv = comm.start_recv(buf, None, tag=5)
    send = comm.start_send(torch.arange(12.0) * comm.rank, (comm.rank + 1) % comm.size, tag=5)
    comm.wait_request("send", send, [right])
    comm.wait_request("recv", recv, [left])
    assert recv.source == left
    return [*out, buf]


def test_staging_on_cpu_equals_the_direct_path_bit_for_bit():
    direct = run_local(4, _every_operation, False)
    staged = run_local(4, _every_operation, True)
    for a, b in zip(direct, staged):
        assert len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


# make soak: the staged path is checked bit for bit on local peers above and by the gpu-check dry run below
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mpi"])  # torch/gloo: the gpu-check dry run below compares the same
def test_staged_peers_end_with_the_direct_runs_numbers(app, backend, tmp_path):
    """Real processes: backend.staging=always (every message through host buffers) against never."""
    runs = {}
    for mode in ("never", "always"):
        run_dir = tmp_path / mode
        args = [f"backend={backend}", f"backend.staging={mode}", "peers=2", "epochs=1", "log_every=5"]
        proc = app(args, run_dir)
        assert proc.returncode == 0, proc.stderr
        runs[mode] = summary(run_dir)
    assert {k: runs["always"][k] for k in EXACT} == {k: runs["never"][k] for k in EXACT}


def test_bad_staging_and_device_are_refused_in_one_line(app, tmp_path):
    cases = [
        (["backend.staging=sometimes"], "backend.staging must be one of auto, always, never"),
        (["device=gpu"], "device must be one of cpu, cuda, auto"),
    ]
    for i, (args, words) in enumerate(cases):
        proc = app(["backend=mpi", "epochs=1", *args], tmp_path / str(i))
        assert proc.returncode == 2, proc.stderr
        assert words in proc.stderr, proc.stderr


@pytest.mark.slow  # soak: the whole device check, app runs and all (its coverage: tests/test_gpu_check_coverage.py)
@pytest.mark.timeout(600)
def test_gpu_check_dry_run_passes_on_cpu(tmp_path):
    """`make gpu-check` with GPU_CHECK_DRY=1: the prepared device check's own script, on CPU tensors."""
    import json
    import subprocess
    import sys

    out = tmp_path / "gpu_check.json"
    cmd = [
        "make",
        "-s",
        "gpu-check",
        f"PYTHON={sys.executable}",
        f"GPU_CHECK_OUT={out}",
        f"WHEELS={tmp_path / 'no-wheels'}",  # CI has none: the checkout's own Python packages
    ]
    proc = subprocess.run(cmd, env={**os.environ, "GPU_CHECK_DRY": "1"}, capture_output=True, text=True, timeout=590)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    from experiments.bench import gpu_features

    result = json.loads(out.read_text())
    assert result["dry_run"] and set(result["parts"]) == {
        "gpu_tests",
        "peers",
        "adpsgd",
        "nccl",
        "fleet",
        "events",
        "fleet_vs_batch",
        "cifar10",
        *gpu_features.CHECKS,  # every feature's check (tests/test_gpu_check_coverage.py: they cover every feature)
    }
    for name in gpu_features.CHECKS:  # each passed, or was skipped with its reason (a trainer's extra not installed)
        part = result["parts"][name]
        assert part.get("passed") or part.get("skipped"), (name, part)
        assert f"{name} " in proc.stdout and part["seconds"] >= 0
    cifar = result["parts"]["cifar10"]  # the CIFAR-10 recipe cut short, on synthetic files in the binary layout
    assert cifar["passed"] and cifar["synthetic"] and cifar["steps"] >= 1, cifar
    assert all(r["differences"]["train_loss"] == 0 for r in result["parts"]["peers"]["runs"])  # staged == direct
    assert "largest n at >= 1 step/s" in proc.stdout
