"""recsys-examples' HSTU ranking inference, written from reading its model (examples/hstu at
43465aea: the preprocessor, the fused layer, the postprocessor and the MLP head), in plain PyTorch
on the trainer's own tensors — shares nothing with kvexport's model or importer.

Per user: one token per contextual feature (in the order given), then i_1 a_1 … i_n a_n, then the
candidates; each token's row (a dynamic table answers a missing key with zeros at evaluation) times
sqrt(D), plus position row min(t, buckets - 1), every candidate at t = C + 2n; per layer
u, v, q, k = SiLU(LN(x) @ W + b), attention SiLU(q·k / sqrt(dh)) / S with
S = 2 (max history + max candidates) + C, causal over the prefix, candidates seeing the prefix and
themselves, x += (u * LN(attention)) @ W_proj; candidates L2-normalised (norm clamped at 1e-6)
into Linear, ReLU, Linear.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F


def _row(table: dict, key: int) -> torch.Tensor:
    if table["kind"] == "dynamic":
        keys = list(table["keys"])
        return table["rows"][keys.index(key)] if key in keys else torch.zeros(table["rows"].shape[1])
    return table["rows"][key]


def nvidia_ranking_forward(
    state: dict,
    tables: dict,
    gin: dict,
    items: list[int],
    actions: list[int],
    candidates: list[int],
    contexts: dict[str, int] | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """One user's logits [len(candidates), tasks] in float32; contexts: feature table -> id, in token order."""
    hidden, heads = gin["NetworkArgs.hidden_size"], gin["NetworkArgs.num_attention_heads"]
    head_dim, layers = gin["NetworkArgs.kv_channels"], gin["NetworkArgs.num_layers"]
    buckets = gin["NetworkArgs.num_position_buckets"]
    contexts = contexts or {}
    scaling = 2 * (gin["DatasetArgs.max_history_seqlen"] + gin["DatasetArgs.max_num_candidates"]) + len(contexts)
    rows = [_row(tables[feature], key) for feature, key in contexts.items()]
    for item, action in zip(items, actions):
        rows += [_row(tables["video_id"], item), _row(tables["action_weights"], action)]
    prefix = len(rows)
    rows += [_row(tables["video_id"], c) for c in candidates]
    positions = [min(t, prefix, buckets - 1) for t in range(len(rows))]
    pos_table = state["_hstu_block._preprocessor._positional_encoder._position_embeddings_weight"].float()
    x = torch.stack(rows).float() * math.sqrt(hidden) + pos_table[positions]
    n = x.shape[0]
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            allowed[i, j] = (j <= i and j < prefix) or i == j
    for layer in range(layers):
        p = f"_hstu_block._attention_layers.{layer}."
        h = F.layer_norm(
            x, (hidden,), state[p + "_input_layernorm_weight"].float(), state[p + "_input_layernorm_bias"].float(), eps
        )
        uvqk = F.silu(h @ state[p + "_linear_uvqk_weight"].float() + state[p + "_linear_uvqk_bias"].float())
        u, v, q, k = (t.reshape(n, heads, head_dim) for t in uvqk.split(hidden, dim=1))
        attention = torch.zeros(n, heads, head_dim)
        for head in range(heads):
            scores = F.silu(q[:, head] @ k[:, head].T / math.sqrt(head_dim)) / scaling
            attention[:, head] = (scores * allowed) @ v[:, head]
        normed = F.layer_norm(
            attention.reshape(n, hidden),
            (hidden,),
            state[p + "_output_layernorm_weight"].float(),
            state[p + "_output_layernorm_bias"].float(),
            eps,
        )
        x = x + (u.reshape(n, hidden) * normed) @ state[p + "_linear_proj_weight"].float()
    states = x[prefix:]
    states = states / states.norm(dim=1, keepdim=True).clamp(min=1e-6)
    hidden_layer = F.relu(states @ state["_mlp._mlp.0.weight"].float().T + state["_mlp._mlp.0.bias"].float())
    return hidden_layer @ state["_mlp._mlp.2.weight"].float().T + state["_mlp._mlp.2.bias"].float()
