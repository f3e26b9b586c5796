"""One spawned peer: `python -m experiments.peer RUN_DIR` trains with RUN_DIR/config.yaml.

experiments.train starts these (through mpiexec or as torch.distributed processes) after it
has validated and written the resolved config; users do not call it directly.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from dpsgd import backends
from dpsgd.config import parse


def main() -> None:
    run_dir = Path(sys.argv[1])
    config = parse(OmegaConf.load(run_dir / "config.yaml"))
    torch.set_num_threads(1)
    backends.join(config, run_dir, save_config=False)
    # the results are written and the group is down: leave without the interpreter's teardown, where
    # gloo's threads aborted about one torch peer in ten at exit ("terminate called without an active exception")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
