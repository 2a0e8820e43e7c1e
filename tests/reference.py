"""Plain-PyTorch reference of DESIGN.md §1, written for obviousness, not speed. Tests only.

It shares the model's parameters but none of its code paths: tokens are built one user at a
time with Python lists, and the attention mask is written out element by element.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def reference_attention(q, k, v, prefix_length: int, alpha: float, scaling_seqlen: int):
    """One user's sequence [n, H, dh] (prefix then candidates) -> [n, H, dh]."""
    n = q.shape[0]
    mask = torch.zeros(n, n, dtype=q.dtype)
    for i in range(n):
        for j in range(n):
            is_candidate = i >= prefix_length
            if (not is_candidate and j <= i) or (is_candidate and (j < prefix_length or j == i)):
                mask[i, j] = 1.0
    out = torch.zeros_like(q)
    for h in range(q.shape[1]):
        scores = nn.functional.silu(alpha * q[:, h] @ k[:, h].T) / scaling_seqlen
        out[:, h] = (scores * mask) @ v[:, h]
    return out


def user_tokens(model, context, items, actions):
    """Embeddings [P, d] of one user's prefix: context, then item/action pairs, absolute positions."""
    rows = [model.context_embedding.weight[c] for c in context.tolist()]
    for item, action in zip(items.tolist(), actions.tolist()):
        rows.append(model.item_embedding.weight[item])
        rows.append(model.action_embedding.weight[action])
    tokens = torch.stack(rows) * math.sqrt(model.item_embedding.embedding_dim)
    return tokens + model.position_embedding.weight[: len(rows)]


def reference_forward(model, batch) -> torch.Tensor:
    """Logits [sum(T), num_tasks] computed user by user."""
    outputs = []
    history_start = candidate_start = 0
    for b in range(batch.user_ids.shape[0]):
        h, t = int(batch.history_lengths[b]), int(batch.num_candidates[b])
        items = batch.item_ids[history_start:history_start + h]
        actions = batch.action_ids[history_start:history_start + h]
        candidates = batch.candidate_ids[candidate_start:candidate_start + t]
        history_start, candidate_start = history_start + h, candidate_start + t
        prefix = user_tokens(model, batch.context_ids[b], items, actions)
        p = prefix.shape[0]
        scale = math.sqrt(model.item_embedding.embedding_dim)
        cand = model.item_embedding.weight[candidates] * scale + model.position_embedding.weight[p]
        x = torch.cat([prefix, cand])
        for layer in model.layers:
            u, v, q, k = layer.project(x)
            o = reference_attention(q, k, v, p, model.alpha, model.scaling_seqlen)
            x = layer.finish(x, u, o)
        outputs.append(model.score(x[p:]))
    return torch.cat(outputs)
