"""The model driven through the cache runtime (docs/design.md §3.1): the KV-cached module that
`kvexport build` exports, the step program's device part, and the eager cached route the trace
and benchmarks run. The model (kvexport.model.hstu) holds the math; the modules that drive it
through the runtime's ops are here, one per route (the step route's host part, planning and
committing a request, is kvexport.host.step_runner's)."""

from __future__ import annotations

import torch
from torch import nn

from kvexport.model.batch import Batch
from kvexport.model.hstu import HSTURanker
from kvexport.ops import wrappers as kv


class _RuntimeProgram(nn.Module):
    """The model as a program that runs through the named cache runtime (default: the config's name)."""

    def __init__(self, model: HSTURanker, runtime_name: str | None = None):
        super().__init__()
        self.model = model
        self.runtime_name = runtime_name or model.config.name


class CachedRanker(_RuntimeProgram):
    """Plain tensors in (the batch signature), logits out: only each user's uncached prefix suffix
    plus its candidates are computed.

    The request's tensors are on the host: the op library checks them first and lays out the prefix
    tokens in the same pass (check_request's token_ids, the host counterpart of prefix_tokens), and
    plans the batch (begin_batch). New rows are [all candidates][uncached prefix tokens], the layout
    paged_attention expects; cached tokens are neither re-embedded nor re-projected. On a GPU what
    the model computes with is uploaded at once, so no op waits for the device.
    """

    def __init__(self, model: HSTURanker, runtime_name: str | None = None):
        super().__init__(model, runtime_name)
        config = model.config
        self.runtime_config = config.runtime_json()
        self.request_limits = config.request_limits_json()

    def forward(
        self,
        user_ids: torch.Tensor,
        history_lengths: torch.Tensor,
        item_ids: torch.Tensor,
        action_ids: torch.Tensor,
        context_ids: torch.Tensor,
        num_candidates: torch.Tensor,
        candidate_ids: torch.Tensor,
    ) -> torch.Tensor:
        model, runtime = self.model, self.runtime_name
        placement = model.position_embedding.weight  # the runtime lives on the model's device
        request = kv.check_request(
            runtime,
            self.request_limits,
            user_ids,
            history_lengths,
            item_ids,
            action_ids,
            context_ids,
            num_candidates,
            candidate_ids,
        )
        new = kv.begin_batch(
            runtime,
            self.runtime_config,
            request.user_ids,
            request.token_ids,
            request.token_lengths,
            request.num_candidates,
            placement,
        )
        new_ids, new_positions = request.token_ids[new.index], new.positions
        candidate_ids, token_lengths, num_candidates = (
            request.candidate_ids,
            request.token_lengths,
            request.num_candidates,
        )
        if placement.device.type != "cpu":
            new_ids, new_positions, candidate_ids, token_lengths, num_candidates = kv.upload(
                runtime, [new_ids, new_positions, candidate_ids, token_lengths, num_candidates], placement
            )
        candidates = model.embed_candidates(candidate_ids, token_lengths, num_candidates)
        x = torch.cat([candidates, model.embed_prefix(new_ids, new_positions)])  # [T + N_new, d]

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return kv.paged_attention(runtime, layer, q, k, v, model.alpha, 1.0 / model.scaling_seqlen)

        x = model.run_layers(x, attend)
        logits = model.score(x[: candidate_ids.shape[0]], candidate_ids)
        kv.end_batch(runtime, request.user_ids, logits)
        return logits

    def run(self, batch: Batch) -> torch.Tensor:
        """The eager cached route over a Batch. A request interrupted between two ops
        (KeyboardInterrupt) is aborted, so this thread does not keep the runtime until
        kv_cache.stall_timeout_ms; failing ops release it themselves."""
        try:
            return self(*batch.tensors())
        except BaseException:
            kv.abort_batch(self.runtime_name)
            raise


class StepProgram(_RuntimeProgram):
    """The device part of a cached request as a program of its own (docs/design.md 3.9):
    begin_step's inputs and plan in (StepInputs, then StepPlan), logits of every candidate row out
    (the batch's first rows). Inputs and plan are on the model's device, padded to a bucket; no host
    work and no synchronisation, so a CUDA graph of it serves every batch of the bucket."""

    def forward(
        self,
        candidate_ids: torch.Tensor,
        candidate_positions: torch.Tensor,
        new_ids: torch.Tensor,
        new_positions: torch.Tensor,
        page_table: torch.Tensor,
        row_user: torch.Tensor,
        row_keys: torch.Tensor,
        row_candidate: torch.Tensor,
        write_slots: torch.Tensor,
        value_slots: torch.Tensor,
        row_order: torch.Tensor,
        tiles: torch.Tensor,
    ) -> torch.Tensor:
        model, runtime = self.model, self.runtime_name
        plan = kv.StepPlan(page_table, row_user, row_keys, row_candidate, write_slots, value_slots, row_order, tiles)
        candidates = model.embed_candidates_at(candidate_ids, candidate_positions)
        x = torch.cat([candidates, model.embed_prefix(new_ids, new_positions)])  # [Tp + Np, d]

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return kv.paged_attention_step(
                runtime, layer, q, k, v, plan, model.max_prefix_length, model.alpha, 1.0 / model.scaling_seqlen
            )

        x = model.run_layers(x, attend)
        return model.score(x[: candidate_ids.shape[0]], candidate_ids)
