"""The optimizers inside other trainers: PyTorch Lightning (`dpsgd.integrations.lightning`), Hugging Face
Accelerate (`dpsgd.integrations.accelerate`) and the Transformers `Trainer` (`dpsgd.integrations.transformers`).

Each is an optional extra (`pip install dpsgd[lightning]`, `[accelerate]`, `[transformers]`), imported only by
its own module, so `import dpsgd.integrations` needs none of them. The guide: docs/guide/trainers.md.
"""

from .wrap import Algorithm, resolve

__all__ = ["Algorithm", "resolve"]
