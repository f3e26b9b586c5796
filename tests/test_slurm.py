"""Several nodes under Slurm: a plain srun's tasks are backend=torch's ranks (dpsgd.backends.slurm), gloo's and
NCCL's interface is the one on the route to the master (dpsgd.netif), and the sbatch recipe for 2 nodes x 4 GPUs
(examples/sbatch_2x4_nccl.sh) runs, dry, on this machine's CPU with gloo: a stand-in `srun` starts its tasks
with the variables Slurm gives them (2 simulated nodes x 1 task, both nodes this host: 2 processes keep the
suite short; the tasks of one node are the unit test's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dpsgd import netif
from dpsgd.backends import slurm

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "nodelist, first",
    [("gpu[03-04,07],cpu1", "gpu03"), ("node7", "node7"), ("a,b", "a"), ("rack1-n[12-13]-ib", "rack1-n12-ib")],
)
def test_first_host_of_a_node_list(nodelist, first, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: the list is read here
    assert slurm.first_host(nodelist) == first


def test_srun_tasks_are_torch_ranks():
    task = {
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
        "SLURM_STEP_NODELIST": "gpu[03-04]",
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
    }
    env = slurm.torch_env({**task, "PATH": "/nonexistent"})
    assert env == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu03",
        "MASTER_PORT": str(slurm.PORT_BASE + 424200 % slurm.PORT_SPAN),
    }
    mine = slurm.torch_env({**task, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "PATH": "/nonexistent"})
    assert (mine["MASTER_ADDR"], mine["MASTER_PORT"]) == ("10.0.0.1", "29500")  # the user's own are kept
    uneven = slurm.torch_env({**task, "SLURM_STEP_TASKS_PER_NODE": "4,3", "PATH": "/nonexistent"})
    assert "LOCAL_WORLD_SIZE" not in uneven
    # the batch script's own process (SLURM_PROCID=0, no step) and a one-task step are no world
    batch = {k: v for k, v in task.items() if not k.startswith("SLURM_STEP")} | {"SLURM_NTASKS": "8"}
    assert slurm.torch_env(batch) is None and slurm.torch_env({**task, "SLURM_STEP_NUM_TASKS": "1"}) is None


def test_gloo_and_nccl_take_the_interface_to_the_master():
    env: dict[str, str] = {}
    assert netif.set_torch_interface("127.0.0.1", env) == "lo"
    assert env == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    own = {"NCCL_SOCKET_IFNAME": "ib0"}
    netif.set_torch_interface("127.0.0.1", own)
    assert own == {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "lo"}  # the user's choice stays


# srun's part for the dry run: every task of the step, with the variables Slurm sets in a task
FAKE_SRUN = textwrap.dedent(
    """\
    #!{python}
    import os, subprocess, sys, time
    args = sys.argv[1:]
    while args and args[0].startswith("-"):
        args.pop(0)
    nodes, per_node = int(os.environ["SLURM_NNODES"]), int(os.environ["SLURM_NTASKS_PER_NODE"])
    procs = []
    for node in range(nodes):
        for local in range(per_node):
            env = dict(os.environ, SLURM_PROCID=str(node * per_node + local), SLURM_LOCALID=str(local),
                       SLURM_NODEID=str(node), SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS=str(nodes * per_node),
                       SLURM_STEP_NODELIST=os.environ["SLURM_JOB_NODELIST"],
                       SLURM_STEP_TASKS_PER_NODE=f"{{per_node}}(x{{nodes}})")
            procs.append(subprocess.Popen(args, env=env))
    while True:  # --kill-on-bad-exit: the first failure ends the step
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes) or any(c not in (None, 0) for c in codes):
            break
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
    sys.exit(max(abs(p.wait()) for p in procs))
    """
)


@pytest.mark.slow  # soak: a whole sbatch recipe
def test_sbatch_recipe_dry_run_on_cpu_with_gloo(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN.format(python=sys.executable))
    (bin_dir / "srun").chmod(0o755)
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHON": sys.executable,
        "DPSGD_DEVICE": "cpu",
        "DPSGD_DIST_BACKEND": "gloo",
        "DPSGD_RUN_DIR": str(run_dir),
        "DPSGD_PROGRESS": "0",
        # what sbatch gives the batch script: 2 nodes x 1 task here (x 4 GPUs on the cluster)
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": "2",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_PROCID": "0",
    }
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "PMI_SIZE"):
        env.pop(var, None)
    proc = subprocess.run(
        ["bash", str(ROOT / "examples" / "sbatch_2x4_nccl.sh"), "epochs=1", "log_every=5"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["backend"], summary["peers"]) == ("torch", 2)
    assert sorted(p.name for p in run_dir.glob("train_rank*.log")) == ["train_rank0.log", "train_rank1.log"]
