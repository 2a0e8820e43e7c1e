"""Fake (meta) implementations of every kvexport:: op, for torch.export and AOTInductor.

Imported by kvexport/ops/library.py right after the .so is loaded.
"""

from __future__ import annotations

import json

import torch


@torch.library.register_fake("kvexport::check_request")
def _check_request(runtime, limits, user_ids, history_lengths, item_ids, action_ids, context_ids, num_candidates,
                   candidate_ids):
    # One batch size for every per-user input, and the jagged sizes the checks guarantee.
    torch._check(history_lengths.shape[0] == user_ids.shape[0], lambda: "history_lengths must match user_ids")
    torch._check(num_candidates.shape[0] == user_ids.shape[0], lambda: "num_candidates must match user_ids")
    torch._check(context_ids.shape[0] == user_ids.shape[0], lambda: "context_ids must match user_ids")
    torch._check(action_ids.shape[0] == item_ids.shape[0], lambda: "action_ids must match item_ids")
    limits = json.loads(limits)
    per_event = 1 if limits.get("combined_action_bits", -1) >= 0 else 2  # model.event_tokens
    num_context = context_ids.shape[1] - (1 if limits.get("query_time_periods") else 0)  # the query time's column
    token_ids = item_ids.new_empty(context_ids.shape[0] * num_context + per_event * item_ids.shape[0])
    return (torch.empty_like(user_ids), torch.empty_like(history_lengths), token_ids,
            torch.empty_like(num_candidates), torch.empty_like(candidate_ids))


@torch.library.register_fake("kvexport::upload")
def _upload(runtime, host, placement):
    return [t.new_empty(t.shape, device=placement.device) for t in host]


@torch.library.register_fake("kvexport::begin_batch")
def _begin_batch(runtime, config, user_ids, token_ids, token_lengths, num_candidates, placement):
    torch._check(user_ids.dim() == 1, lambda: f"user_ids must be 1-D, got {user_ids.dim()}-D")
    torch._check(token_lengths.shape[0] == user_ids.shape[0], lambda: "token_lengths must have one entry per user")
    torch._check(num_candidates.shape[0] == user_ids.shape[0], lambda: "num_candidates must have one entry per user")
    # How many tokens are not cached is known only when the runtime has planned the batch; the op
    # returns their index and positions, so the model needs no data-dependent op of its own.
    num_new = torch.library.get_ctx().new_dynamic_size()
    torch._check(num_new <= token_ids.shape[0], lambda: "more uncached tokens than tokens")
    return token_ids.new_empty(2, num_new, dtype=torch.int64)


@torch.library.register_fake("kvexport::paged_attention")
def _paged_attention(runtime, layer, q, k, v, alpha, inv_scaling_seqlen):
    torch._check(q.dim() == 3, lambda: f"q must be [N, H, dh], got {q.dim()}-D")
    torch._check(q.shape == k.shape and q.shape == v.shape, lambda: "q, k and v must have one shape")
    return torch.empty_like(q)


@torch.library.register_fake("kvexport::end_batch")
def _end_batch(runtime, user_ids, after):
    torch._check(user_ids.dim() == 1, lambda: f"user_ids must be 1-D, got {user_ids.dim()}-D")


@torch.library.register_fake("kvexport::begin_step")
def _begin_step(runtime, config, user_ids, token_ids, token_lengths, num_candidates, candidate_ids, placement,
                max_prefix_length):
    torch._check(user_ids.dim() == 1, lambda: f"user_ids must be 1-D, got {user_ids.dim()}-D")
    staged = token_ids.new_empty(torch.library.get_ctx().new_dynamic_size(), dtype=torch.int64)
    return staged, torch.empty(7, dtype=torch.int64)


@torch.library.register_fake("kvexport::paged_attention_step")
def _paged_attention_step(runtime, layer, q, k, v, page_table, row_user, row_keys, row_candidate, write_slots,
                          value_slots, row_order, tiles, max_keys, alpha, inv_scaling_seqlen):
    torch._check(q.dim() == 3, lambda: f"q must be [N, H, dh], got {q.dim()}-D")
    torch._check(q.shape == k.shape and q.shape == v.shape, lambda: "q, k and v must have one shape")
    # The plan's sizes are the step program's own inputs (rows = candidate rows + prefix rows); the
    # op checks them against q when it runs.
    return torch.empty_like(q)


@torch.library.register_fake("kvexport::hstu_paged_attention")
def _hstu_paged_attention(q, k, v, cache, page_table, row_user, row_keys, row_candidate, alpha, inv_scaling_seqlen):
    torch._check(q.dim() == 3, lambda: f"q must be [N, H, dh], got {q.dim()}-D")
    torch._check(cache.dim() == 5, lambda: f"cache must be [pages, 2, page_size, H, dh], got {cache.dim()}-D")
    torch._check(row_user.shape[0] == q.shape[0], lambda: "row_user must have one entry per row of q")
    return torch.empty_like(q)


@torch.library.register_fake("kvexport::runtime_stats")
def _runtime_stats(runtime):
    return torch.empty(len(torch.ops.kvexport.stat_names()), dtype=torch.int64)


@torch.library.register_fake("kvexport::device_users_lru")
def _device_users_lru(runtime):
    return torch.empty(torch.library.get_ctx().new_dynamic_size(), dtype=torch.int64)


@torch.library.register_fake("kvexport::create_runtime")
def _create_runtime(runtime, config, device):
    return None


@torch.library.register_fake("kvexport::abort_batch")
def _abort_batch(runtime):
    return None


@torch.library.register_fake("kvexport::reset_runtime")
def _reset_runtime(runtime):
    return None


@torch.library.register_fake("kvexport::evict_user")
def _evict_user(runtime, user_id):
    return False


@torch.library.register_fake("kvexport::cached_length")
def _cached_length(runtime, user_id):
    return 0


@torch.library.register_fake("kvexport::read_user_kv")
def _read_user_kv(runtime, user_id):
    ctx = torch.library.get_ctx()
    layers, length, heads, head_dim = (ctx.new_dynamic_size() for _ in range(4))
    return torch.empty(layers, 2, length, heads, head_dim)


@torch.library.register_fake("kvexport::drop_runtime")
def _drop_runtime(runtime):
    return False


@torch.library.register_fake("kvexport::gpu_info")
def _gpu_info(device):
    return "", ""


@torch.library.register_fake("kvexport::attach_remote")
def _attach_remote(runtime, url, write_policy):
    return False


@torch.library.register_fake("kvexport::flush_remote")
def _flush_remote(runtime, timeout_ms):
    return True
