"""One rank of the soak in tests/test_integrations.py: a 10M-parameter model (two Linear layers, 1000 x 5000 and
5000 x 1000) trained 4 steps by Lightning with DecentralizedStrategy (dpsgd), then the process exits as a user's
script does; the soak counts how the ranks end.

    torchrun --standalone --nproc-per-node 4 tests/peers/big_lightning_peer.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from dpsgd.integrations import Algorithm
from dpsgd.integrations.lightning import DecentralizedStrategy


class Big(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(1000, 5000), torch.nn.ReLU(), torch.nn.Linear(5000, 1000))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(64, 1000)), batch_size=8)


def main() -> None:
    torch.set_num_threads(1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=DecentralizedStrategy(Algorithm("dpsgd", timeout_s=120)),
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Big()
    trainer.fit(model)
    out = Path(sys.argv[1])
    parameters = sum(p.numel() for p in model.parameters())
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({"parameters": parameters}))


if __name__ == "__main__":
    main()
