"""Starting a peer script of tests/peers/ under torchrun for the integrations' tests: one launch, every process
of it ended (its own session is killed as a group on a timeout), each rank's JSON read back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from dpsgd.backends.launch import peer_env

PEERS = Path(__file__).resolve().parent / "peers"


def torchrun(script: str, out: Path, peers: int = 2, args: tuple[str, ...] = (), timeout_s: float = 240) -> list[dict]:
    """`torchrun --standalone --nproc-per-node PEERS tests/peers/SCRIPT OUT ARGS`; each rank's OUT/rank{r}.json."""
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", f"--nproc-per-node={peers}"]
    env = peer_env({"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    proc = subprocess.Popen(
        [*cmd, str(PEERS / script), str(out), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # torchrun and its ranks in one group: a timeout ends them all
    )
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        raise AssertionError(f"{script} ran past {timeout_s} s:\n{log[-3000:]}") from None
    if proc.returncode != 0:
        raise AssertionError(f"{script} exited {proc.returncode}:\n{log[-4000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(peers)]
