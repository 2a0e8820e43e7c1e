"""Plain-PyTorch reference of docs/design.md §1, written for obviousness, not speed. Tests only.

It reads the model's parameters but calls none of its methods: tokens are built one user at a
time with Python lists, each layer is written out with F.linear / F.layer_norm, and the attention
mask is written out element by element.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F


def reference_attention(q, k, v, prefix_length: int, alpha: float, scaling_seqlen: int, context_rows: int = 0):
    """One user's sequence [n, H, dh] (prefix then candidates) -> [n, H, dh]; the first
    `context_rows` rows read the whole prefix."""
    n = q.shape[0]
    mask = torch.zeros(n, n, dtype=q.dtype)
    for i in range(n):
        for j in range(n):
            is_candidate = i >= prefix_length
            if i < context_rows and j < prefix_length:
                mask[i, j] = 1.0
            elif (not is_candidate and j <= i) or (is_candidate and (j < prefix_length or j == i)):
                mask[i, j] = 1.0
    out = torch.zeros_like(q)
    for h in range(q.shape[1]):
        scores = F.silu(alpha * q[:, h] @ k[:, h].T) / scaling_seqlen
        out[:, h] = (scores * mask) @ v[:, h]
    return out


def item_row(model, item: int, item_ids: str) -> int:
    """The item table's row of an id: the id itself, or (item_ids "keys") the position of the id
    among the model's item_keys, and the table's last row for an id that is not a key."""
    if item_ids == "rows":
        return item
    rows = {key: row for row, key in enumerate(model.item_keys.tolist())}
    return rows.get(item, model.item_embedding.weight.shape[0] - 1)


def context_row(model, feature: int, context: int, context_ids: str) -> int:
    """The context table's row of a feature's id: the id itself, or (context_ids "keys") the position
    of the pair among the model's context_keys (feature in the top bits, docs/checkpoint.md), and
    the table's last row for a pair that is not a key."""
    if context_ids == "rows":
        return context
    rows = {key: row for row, key in enumerate(model.context_keys.tolist())}
    return rows.get((feature << 56) | context, model.context_embedding.weight.shape[0] - 1)


def user_tokens(
    model, context, items, actions, item_ids: str = "rows", context_ids: str = "rows", event_tokens: str = "pairs"
):
    """Embeddings [P, d] of one user's prefix: context, then each event's item and action tokens
    ("pairs") or one token of the two rows' sum ("combined"), at absolute positions."""
    rows = [
        model.context_embedding.weight[context_row(model, f, c, context_ids)] for f, c in enumerate(context.tolist())
    ]
    for item, action in zip(items.tolist(), actions.tolist()):
        item_vector = model.item_embedding.weight[item_row(model, item, item_ids)]
        if event_tokens == "combined":
            rows.append(item_vector + model.action_embedding.weight[action])
        else:
            rows.append(item_vector)
            rows.append(model.action_embedding.weight[action])
    tokens = torch.stack(rows) * math.sqrt(model.item_embedding.embedding_dim)
    return tokens + model.position_embedding.weight[: len(rows)]


def reference_forward(
    model,
    batch,
    head_activation: str = "silu",
    layer_norm_eps: float = 1e-5,
    silu_on: str = "uvqk",
    layer_output: str = "gated",
    item_ids: str = "rows",
    context_ids: str = "rows",
    event_tokens: str = "pairs",
    candidate_position: str = "after_prefix",
    head: str = "mlp",
    query_time_periods: tuple = (),
    context_attention: str = "causal",
) -> torch.Tensor:
    """Logits [sum(T), num_tasks] computed user by user; the keyword arguments are the config's
    semantics switches of the same names (docs/design.md §1.3-1.5) and model.item_ids,
    context_ids, event_tokens, candidate_position, head, query_time_periods and
    context_attention, given by the caller."""
    outputs = []
    history_start = candidate_start = 0
    for b in range(batch.user_ids.shape[0]):
        h, t = int(batch.history_lengths[b]), int(batch.num_candidates[b])
        items = batch.item_ids[history_start : history_start + h]
        actions = batch.action_ids[history_start : history_start + h]
        candidates = batch.candidate_ids[candidate_start : candidate_start + t]
        history_start, candidate_start = history_start + h, candidate_start + t
        context = batch.context_ids[b]
        if head == "item_tower":  # the last column is the query time
            context, query_time = context[:-1], int(context[-1])
        prefix = user_tokens(model, context, items, actions, item_ids, context_ids, event_tokens)
        p = prefix.shape[0]
        scale = math.sqrt(model.item_embedding.embedding_dim)
        candidate_rows = [item_row(model, c, item_ids) for c in candidates.tolist()]
        slot = p if candidate_position == "after_prefix" else model.position_embedding.weight.shape[0] - 1
        cand = model.item_embedding.weight[candidate_rows] * scale + model.position_embedding.weight[slot]
        x = torch.cat([prefix, cand])
        for layer in model.layers:
            context_rows = len(context) if context_attention == "whole_prefix" else 0
            x = reference_layer(layer, x, p, model.scaling_seqlen, layer_norm_eps, silu_on, layer_output, context_rows)
        if head == "item_tower":
            code = time_code(query_time, query_time_periods)
            outputs.append(reference_item_tower(model.head, x[p:], candidate_rows, code))
        else:
            outputs.append(reference_head(model.head, x[p:], head_activation))
    return torch.cat(outputs)


def reference_layer(
    layer,
    x,
    prefix_length: int,
    scaling_seqlen: int,
    eps: float = 1e-5,
    silu_on: str = "uvqk",
    layer_output: str = "gated",
    context_rows: int = 0,
):
    """docs/design.md §1 steps 1-4 for one user's sequence x [n, d]."""
    heads, head_dim = layer.num_heads, layer.head_dim
    size = heads * head_dim
    normed = F.layer_norm(x, (x.shape[1],), layer.input_norm.weight, layer.input_norm.bias, eps)
    projected = F.linear(normed, layer.uvqk.weight, layer.uvqk.bias)
    parts = [projected[:, i * size : (i + 1) * size] for i in range(4)]  # u, v, q, k
    parts = [F.silu(part) if i == 0 or silu_on == "uvqk" else part for i, part in enumerate(parts)]
    u, v, q, k = (part.reshape(-1, heads, head_dim) for part in parts)
    o = reference_attention(q, k, v, prefix_length, 1.0 / math.sqrt(head_dim), scaling_seqlen, context_rows).reshape(
        -1, size
    )
    u = u.reshape(-1, size)
    gated = u * F.layer_norm(o, (size,), layer.attention_norm.weight, layer.attention_norm.bias, eps)
    features = torch.cat([u, o, gated], dim=1) if layer_output == "concat" else gated
    return x + F.linear(features, layer.output.weight, layer.output.bias)


def reference_head(head, states, activation: str):
    """L2-normalised candidate states through Linear -> activation -> Linear, as float32 logits."""
    states = states / states.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    hidden = F.linear(states, head[0].weight, head[0].bias)
    hidden = F.silu(hidden) if activation == "silu" else hidden.clamp_min(0.0)
    return F.linear(hidden, head[2].weight, head[2].bias).float()


def time_code(query_time: int, periods) -> int:
    """The calendar code of a query time in numpy's float32 arithmetic: each period's
    floor(t / seconds) mod units, mixed radix, the first period most significant (numpy's own
    float32 floor division, not torch's)."""
    import numpy as np  # only here: the serve extra brings it, and only item_tower tests need it

    seconds, code = np.float32(query_time), 0
    for unit, units in periods:
        index = np.remainder(np.floor_divide(seconds, np.float32(unit)), np.float32(units))
        code = code * units + int(index)
    return code


def reference_item_tower(head, states, candidate_rows: list[int], code: int):
    """model.head item_tower: LN(states W_c + time[code]) times the candidates' tower rows, then
    Linear, x * sigmoid(LN(x)), Linear, as float32 logits."""
    width = states.shape[1]
    combined = F.linear(states, head.combiner.weight) + head.time_embedding.weight[code]
    user = F.layer_norm(combined, (width,), head.user_norm.weight, head.user_norm.bias, 1e-5)
    hidden = F.linear(user * head.tower_embedding.weight[candidate_rows], head.mlp[0].weight, head.mlp[0].bias)
    swish = head.mlp[1].norm
    hidden = hidden * torch.sigmoid(F.layer_norm(hidden, (hidden.shape[1],), swish.weight, swish.bias, 1e-5))
    return F.linear(hidden, head.mlp[2].weight, head.mlp[2].bias).float()
