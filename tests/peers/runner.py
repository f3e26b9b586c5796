"""The entry point the peer scripts share: `python tests/peers/X.py BACKEND OUT_DIR` runs the
script's cases on this rank and writes OUT_DIR/rank{r}.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def main(all_trajectories, **options) -> None:
    """`options`: the backend's `dpsgd.comm.init` options (e.g. staging)."""
    import dpsgd.comm

    torch.set_num_threads(1)
    backend, out_dir = sys.argv[1], Path(sys.argv[2])
    comm = dpsgd.comm.init(backend, timeout_s=60, **options)
    result = all_trajectories(comm)
    (out_dir / f"rank{comm.rank}.json").write_text(json.dumps(result))
    comm.close()
