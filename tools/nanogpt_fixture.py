"""Writes tests/fixtures/nanogpt_char_gpt.json: the logits and loss of nanoGPT's own GPT (Karpathy, model.py) for
a tiny configuration with weights drawn by the recipe below, the reference tests/test_real_data.py holds
dpsgd.models.CharGPT to. nanoGPT's code is imported from the user's clone, never copied into this project.

    python tools/nanogpt_fixture.py /path/to/nanoGPT   # a clone of github.com/karpathy/nanoGPT
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

CONFIG = {"block_size": 8, "vocab_size": 11, "n_layer": 2, "n_head": 2, "n_embd": 16, "dropout": 0.0, "bias": False}
SEED = 0


def weights(named_shapes: list[tuple[str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """The recipe: one generator seeded with SEED draws normal(0, 0.3) values for each parameter in the order
    given (nanoGPT's names, sorted), then 1 + those values for the LayerNorm weights."""
    g = torch.Generator().manual_seed(SEED)
    out = {}
    for name, shape in sorted(named_shapes):
        values = torch.randn(shape, generator=g) * 0.3
        out[name] = values + 1 if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")) else values
    return out


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + 1)
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, CONFIG["block_size"] + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def main(clone: str) -> None:
    sys.path.insert(0, clone)
    from model import GPT, GPTConfig  # nanoGPT's model.py

    model = GPT(GPTConfig(**CONFIG)).eval()
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]  # lm_head is tied to wte: one entry
    with torch.no_grad():
        for name, value in weights(shapes).items():
            model.get_parameter(name).copy_(value)
        x, y = inputs()
        logits, loss = model(x, y)
    commit = subprocess.run(["git", "-C", clone, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "nanogpt_char_gpt.json"
    out.write_text(
        json.dumps(
            {
                "source": "github.com/karpathy/nanoGPT, model.py (GPT, GPTConfig)",
                "commit": commit,
                "command": "python tools/nanogpt_fixture.py /path/to/nanoGPT",
                "config": CONFIG,
                "parameter_names": [n for n, _ in sorted(shapes)],
                "logits": [[[round(v, 6) for v in row] for row in seq] for seq in logits.tolist()],
                "loss": round(float(loss), 6),
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1])
