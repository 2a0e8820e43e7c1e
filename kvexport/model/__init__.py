"""The eager HSTU ranking model, its batch format and its checkpoint format."""

from __future__ import annotations

from pathlib import Path

import torch

from kvexport.config import Config
from kvexport.model.batch import SIGNATURE, Batch, random_batch
from kvexport.model.checkpoint import load_checkpoint
from kvexport.model.hstu import DTYPES, HSTURanker

__all__ = ["SIGNATURE", "Batch", "HSTURanker", "build_model", "random_batch"]


def build_model(config: Config, checkpoint: str | Path | None = None, seed: int = 0) -> HSTURanker:
    """The eager model in eval mode and the config's dtype: seeded init, or a checked checkpoint."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = HSTURanker(config)
    if checkpoint is not None:
        model.load_state_dict(load_checkpoint(checkpoint, model))
    return model.to(DTYPES[config.model.dtype]).eval()
