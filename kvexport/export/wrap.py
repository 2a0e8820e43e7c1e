"""torch.export of the KV-cached module and of the step program (kvexport.cached), with their
dynamic shapes and examples (docs/design.md §3.3)."""

from __future__ import annotations

import torch
from torch.export import Dim, ExportedProgram

from kvexport.cached import CachedRanker, StepProgram
from kvexport.config import Config
from kvexport.model import SIGNATURE, random_batch
from kvexport.ops import library
from kvexport.ops import wrappers as kv


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
        return torch.export.export(module.eval(), example, dynamic_shapes=dynamic_shapes(config), strict=False)


# A step program's example for export: sizes distinct from each other (no two dimensions unify).
_STEP_EXAMPLE = kv.StepLayout(candidate_rows=16, prefix_rows=24, users=2, pages_per_user=0, tiles=5, real_candidates=16)


def step_dynamic_shapes(config: Config) -> tuple[dict[int, Dim], ...]:
    """Candidate rows, prefix rows, users and tiles vary with the bucket (each with room for
    bucket_size's rounding up); the page table is always the config's pages per user wide."""
    m, max_batch = config.model, config.serving.max_batch_size
    candidate_rows = Dim("candidate_rows", min=16, max=2 * max(16, max_batch * m.max_num_candidates))
    prefix_rows = Dim("prefix_rows", min=16, max=2 * max(16, max_batch * m.max_prefix_length))
    rows = Dim("rows", min=32, max=candidate_rows.max + prefix_rows.max)
    users = Dim("users", min=1, max=2 * max_batch)
    tiles = Dim("tiles", min=2, max=rows.max + users.max)
    return (
        {0: candidate_rows},
        {0: candidate_rows},
        {0: prefix_rows},
        {0: prefix_rows},
        {0: users},
        {0: rows},
        {0: rows},
        {0: rows},
        {0: prefix_rows},
        {0: prefix_rows},
        {0: rows},
        {0: tiles},
    )


def step_example(config: Config, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    """Zeros in the step program's input shapes (export traces them with fake kernels only)."""
    layout = _STEP_EXAMPLE._replace(pages_per_user=config.kv_cache.pages_for(config.model.max_prefix_length))
    inputs, plan = layout.split(torch.zeros(layout.numel(), dtype=torch.int64, device=device))
    return tuple(t.clone() for t in (*inputs, *plan))


def export_step(module: StepProgram, config: Config, device: torch.device | str = "cpu") -> ExportedProgram:
    """torch.export of the step program: one program for every bucket."""
    library.load()
    with torch.no_grad(), torch.fx.experimental._config.patch(backed_size_oblivious=True):
        return torch.export.export(
            module.eval(), step_example(config, device), dynamic_shapes=step_dynamic_shapes(config), strict=False
        )
