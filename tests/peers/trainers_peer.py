"""One rank of tests/test_integrations.py: accelerate_peer's loops, lightning_peer's fits and hf_peer's Trainer, in
one launch (the processes, their imports and the process group started once for all three).

    torchrun --standalone --nproc-per-node 2 tests/peers/trainers_peer.py OUT_DIR [--plant ddp|no-peer-files]

writes OUT_DIR/rank{r}.json: {"accelerate": ..., "lightning": ..., "transformers": ...}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import accelerate_peer
import hf_peer
import lightning_peer
import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--plant", default="", help="a bug put in on purpose (see each peer module)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {
        "accelerate": accelerate_peer.run(args.out / "accelerate", args.plant),  # Accelerate starts the group
        "lightning": lightning_peer.run(args.out / "lightning", args.plant),
    }
    # Accelerate keeps one state per process: the Trainer's own Accelerator (fp32) after the bf16 one above
    AcceleratorState._reset_state()
    result["transformers"] = hf_peer.run(args.out / "transformers", args.plant)
    result["peers"] = dist.get_world_size()
    (args.out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()


if __name__ == "__main__":
    main()
