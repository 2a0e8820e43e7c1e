"""The eager HSTU ranking model, its batch format and its checkpoint format."""

from __future__ import annotations

from pathlib import Path

import torch

from kvexport.config import Config
from kvexport.model.batch import SIGNATURE, Batch, random_batch, sample_batch
from kvexport.model.checkpoint import load_checkpoint
from kvexport.model.hstu import DTYPES, HSTURanker
from kvexport.options import INIT_SEED, SampleOptions

__all__ = ["SIGNATURE", "Batch", "HSTURanker", "build_model", "random_batch", "score_sample"]


def build_model(config: Config, checkpoint: str | Path | None = None, seed: int = INIT_SEED) -> HSTURanker:
    """The eager model in eval mode and the config's dtype: seeded init, or a checked checkpoint."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = HSTURanker(config)
    if checkpoint is not None:
        model.load_state_dict(load_checkpoint(checkpoint, model))
    return model.to(DTYPES[config.model.dtype]).eval()


def score_sample(config: Config, checkpoint: str | Path | None, options: SampleOptions) -> torch.Tensor:
    """The eager model's logits (full recompute) [sum(num_candidates), num_tasks] for
    sample_batch(config, options); checkpoint None: build_model's seeded init."""
    model = build_model(config, checkpoint)
    with torch.no_grad():
        return model(sample_batch(config, options))
