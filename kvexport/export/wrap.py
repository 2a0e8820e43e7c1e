"""The exportable KV-cached module and its torch.export call (docs/design.md §3.3)."""

from __future__ import annotations

import torch
from torch import nn
from torch.export import Dim, ExportedProgram

from kvexport.config import Config
from kvexport.model import SIGNATURE, random_batch
from kvexport.model.hstu import HSTURanker
from kvexport.ops import library


class CachedRanker(nn.Module):
    """Plain tensors in (the batch signature), logits out, through the named cache runtime."""

    def __init__(self, model: HSTURanker, runtime_name: str):
        super().__init__()
        self.model = model
        self.runtime_name = runtime_name

    def forward(self, user_ids: torch.Tensor, history_lengths: torch.Tensor, item_ids: torch.Tensor,
                action_ids: torch.Tensor, context_ids: torch.Tensor, num_candidates: torch.Tensor,
                candidate_ids: torch.Tensor) -> torch.Tensor:
        return self.model.cached_logits(self.runtime_name, user_ids, history_lengths, item_ids, action_ids,
                                        context_ids, num_candidates, candidate_ids)


def dynamic_shapes(config: Config) -> dict[str, dict[int, Dim]]:
    """Batch 1..max_batch_size, events 0..B*max_history, candidates 1..B*max_candidates."""
    m, max_batch = config.model, config.serving.max_batch_size
    batch = Dim("batch", min=1, max=max_batch)
    events = Dim("events", min=0, max=max_batch * m.max_history_length)
    candidates = Dim("candidates", min=1, max=max_batch * m.max_num_candidates)
    per_name = {"item_ids": events, "action_ids": events, "candidate_ids": candidates}
    return {name: {0: per_name.get(name, batch)} for name in SIGNATURE}


def example_batch(config: Config):
    """Export-time example: batch 2, so no dimension specialises to 0 or 1."""
    return random_batch(config.model, seed=0, history_lengths=[3, 5], num_candidates=[2, 3])


def export_cached(module: CachedRanker, config: Config) -> ExportedProgram:
    """torch.export of the cached module; one program serves batch 1, one new token and the
    maxima. The request is on the host whatever the parameters' device (the model
    checks, lays out and plans it there and uploads what it computes with)."""
    library.load()  # effects must be declared before tracing
    with torch.no_grad(), torch.fx.experimental._config.patch(backed_size_oblivious=True):
        example = example_batch(config).tensors()
        return torch.export.export(module.eval(), example,
                                   dynamic_shapes=dynamic_shapes(config), strict=False)
