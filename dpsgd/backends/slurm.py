"""The world a plain `srun` started, for backend=torch: each task of the job step is one rank (SLURM_PROCID of
SLURM_STEP_NUM_TASKS), its rank on its node SLURM_LOCALID, and the master the first host of the step's node
list, so `srun python -m experiments.train backend=torch` needs no torchrun. (MPI reads srun's world itself,
through PMI.) A batch script's own process is no step's task: it sees no world here."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping

PORT_BASE, PORT_SPAN = 20000, 20000  # MASTER_PORT from the job and step ids, where the user sets none


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list ('gpu[03-04,07],cpu1' -> 'gpu03'): `scontrol show hostnames` where
    Slurm's tools are installed, else the list's first entry expanded here."""
    if shutil.which("scontrol"):
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()[0]
    m = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,]*)", nodelist.strip())
    if not m or not (m.group(1) or m.group(2)):
        raise ValueError(f"cannot read the first host of the Slurm node list {nodelist!r}; set MASTER_ADDR yourself")
    first = (m.group(2) or "").split(",")[0].split("-")[0]
    return f"{m.group(1)}{first}{m.group(3)}"


def torch_env(env: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """torch.distributed's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
    of this srun task, those set already kept; None outside a job step of more than one task."""
    env = os.environ if env is None else env
    size = env.get("SLURM_STEP_NUM_TASKS", "")
    if not size.isdigit() or int(size) <= 1 or not env.get("SLURM_PROCID", "").isdigit():
        return None
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    # tasks per node, where every node runs as many ('4(x2)'); an uneven step ('4,3') leaves it unsaid
    uniform = re.fullmatch(r"(\d+)(\(x\d+\))?", env.get("SLURM_STEP_TASKS_PER_NODE", ""))
    step = int(env.get("SLURM_JOB_ID", "0") or 0) * 100 + int(env.get("SLURM_STEP_ID", "0") or 0)
    derived: dict[str, str | None] = {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": size,
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": uniform.group(1) if uniform else None,
        "MASTER_ADDR": None if "MASTER_ADDR" in env else first_host(nodes or "localhost"),
        "MASTER_PORT": str(PORT_BASE + step % PORT_SPAN),
    }
    return {k: str(env.get(k) or v) for k, v in derived.items() if env.get(k) or v}
