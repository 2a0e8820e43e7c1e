"""Meta generative-recommenders' DLRMv3 `DlrmHSTU` inference, written from reading its model
(db1bf8f2: the contextual preprocessor, action encoder, positional encoder, STU layer, timestamp
postprocessor, item tower and multitask head), in plain PyTorch float32 on the checkpoint's own
tensors (dense_dict names; tables by name, rows [rows, E]) — shares nothing with kvexport's model
or importers.

Per user (C contextual features, U history events oldest first, T candidates, query time Q):
tokens [z_1..z_C, h(e_1)..h(e_U), h(c_1)..h(c_T)], z_c = emb_c @ W_c + b_c (emb_c zeroed while
U + T is below the feature's minimum), h = content MLP(item row) + action MLP(each action bit's
8-wide row where the event has it, concatenated; every candidate the target row), an MLP being
Linear, SwishLN (x * sigmoid(LN x)), Linear, LN, eps 1e-5. x = sqrt(D) tokens + P[p] + Tm[b] with
p = c for contextual token c, C + U - k + 1 for event k, C for every candidate (capped at the last
row), b = trunc(sqrt(max(Q - s, 1e-6) / 60)) capped at the last row (contextual s = 0). Per layer
n = LN(x, 1e-6), [u | v | q | k] = n @ W + beta, u = SiLU(u), attention SiLU(q.k / sqrt(dqk)) / N
with N = C + max U + max T over the padded batch, causal over the prefix, candidates seeing the
prefix and themselves, x += [u, o, u * LN(o, 1e-6)] @ W_out. Candidates: LN(Linear([x, cos, sin of
the hour-of-day and day-of-week angles of Q])) * item tower(candidate row), then Linear, SwishLN,
Linear: the logits.

Rules selects cache-exact replacements for the three of those choices that no per-user KV cache can
follow (the batch's N, positions from the end, buckets relative to Q); its defaults are upstream's,
and benchmarks/meta_rules.py measures how far each moves the logits.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.nn import functional as F

STU = "_hstu_transducer._stu_module._stu_layers."
PRE = "_hstu_transducer._input_preprocessor."
POS = "_hstu_transducer._positional_encoder."
POST = "_hstu_transducer._output_postprocessor."
HEAD = "_multitask_module._prediction_module."


@dataclasses.dataclass(frozen=True)
class Features:
    """What the checkpoint's tensors do not say: the head count and the table each input reads.

    item_table: the post-id table, read by history events, candidates and the item tower.
    contextual_tables: one per contextual feature, in feature order (each of max length 1, as in
    every DLRMv3 config). contextual_min_uih_lengths: per feature, the merged length (U + T) below
    which its input is zeroed; empty or 0 means no gate.
    """

    num_heads: int
    item_table: str
    contextual_tables: tuple[str, ...]
    contextual_min_uih_lengths: tuple[int, ...] = ()


POSITION_RULES = ("from_end", "from_max", "from_start", "none")
TIME_RULES = ("query", "previous", "zero", "none")
NORMALISER_RULES = ("batch", "fixed", "causal")


@dataclasses.dataclass(frozen=True)
class Rules:
    """How history tokens are placed and how attention rows are normalised; the defaults are upstream's.

    positions (event k of U, oldest first): "from_end" C + U - k + 1 (upstream); "from_max"
    C + M - k + 1 (M = max_history; upstream's when U = M); "from_start" C + k; "none" no position
    row. times (event k's bucket): "query" of Q - s_k (upstream); "previous" of s_k - s_(k-1), the
    first event the last row; "zero" row 0 (as if s_k = Q); "none" no time row. normaliser (the
    prefix rows' N): "batch" upstream's C + max U + max T over the batch (or dlrm_hstu_forward's
    normaliser when given); "fixed" C + max_history + max_candidates; "causal" prefix row i
    (0-based) max(i + 1, C) + max_candidates, the N it would have as the end of its own prefix
    (candidates: C + U + max_candidates). candidate_normaliser: "same" as the prefix rows (as
    above); "batch" upstream's whatever the prefix's; "own" the user's own C + U + T (upstream's in
    a one-user batch). Candidates are not cached: their rows may follow any of these.
    Contextual tokens and candidates keep upstream's positions and buckets under every rule.
    """

    positions: str = "from_end"
    times: str = "query"
    normaliser: str = "batch"
    candidate_normaliser: str = "same"
    max_history: int = 0
    max_candidates: int = 0

    def __post_init__(self):
        for name, allowed in (
            ("positions", POSITION_RULES),
            ("times", TIME_RULES),
            ("normaliser", NORMALISER_RULES),
            ("candidate_normaliser", ("same", "batch", "own")),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}: one of {allowed}")


UPSTREAM = Rules()


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def swish_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """x times the sigmoid of its affine LayerNorm (not SiLU of the LayerNorm)."""
    return x * torch.sigmoid(layer_norm(x, weight, bias, eps))


def mlp(dense: dict, prefix: str, x: torch.Tensor) -> torch.Tensor:
    """Sequential(Linear, SwishLayerNorm, Linear, LayerNorm), every norm at eps 1e-5."""
    h = F.linear(x, dense[prefix + "0.weight"], dense[prefix + "0.bias"])
    h = swish_layer_norm(h, dense[prefix + "1.weight"], dense[prefix + "1.bias"])
    h = F.linear(h, dense[prefix + "2.weight"], dense[prefix + "2.bias"])
    return layer_norm(h, dense[prefix + "3.weight"], dense[prefix + "3.bias"], 1e-5)


def position_indices(
    num_contextual: int,
    num_history: int,
    num_candidates: int,
    num_rows: int,
    rule: str = "from_end",
    max_history: int = 0,
) -> list[int | None]:
    """Each token's row of the position table: contextual tokens their index, history counted back
    from its end (newest C + 1, oldest C + U), every candidate C; all but contextual capped at the
    last row. rule (Rules.positions) places the history otherwise; None: no row."""
    if rule == "from_max" and num_history > max_history:
        raise ValueError(f"from_max: {num_history} events over max_history {max_history}")
    offsets = {
        "from_end": lambda k: num_history - k + 1,
        "from_max": lambda k: max_history - k + 1,
        "from_start": lambda k: k,
        "none": lambda k: None,
    }[rule]  # event k, 1-based, oldest first
    history = [offsets(k) for k in range(1, num_history + 1)]
    return (
        list(range(num_contextual))
        + [None if offset is None else min(num_contextual + offset, num_rows - 1) for offset in history]
        + [min(num_contextual, num_rows - 1)] * num_candidates
    )


def time_buckets(timestamps: torch.Tensor, query_time: int, num_rows: int) -> torch.Tensor:
    """Each token's row of the time table: trunc(sqrt(max(Q - s, 1e-6) / 60)) in float32, within [0, rows - 1]."""
    minutes = (query_time - timestamps).float().clamp(min=1e-6) / 60.0
    return minutes.sqrt().long().clamp(0, num_rows - 1)


def history_time_buckets(timestamps: torch.Tensor, query_time: int, num_rows: int, rule: str = "query") -> list:
    """The history events' rows of the time table under Rules.times (None: no row)."""
    if rule == "query":
        return time_buckets(timestamps, query_time, num_rows).tolist()
    if rule == "previous":  # each event's gap to the one before it; the first has none: the last row
        earlier = torch.cat([timestamps[:1], timestamps[:-1]])  # the same formula with s_(k-1) as the query
        minutes = (timestamps - earlier).float().clamp(min=1e-6) / 60.0
        return ([num_rows - 1] + minutes[1:].sqrt().long().clamp(0, num_rows - 1).tolist())[: len(timestamps)]
    return [0 if rule == "zero" else None] * len(timestamps)


def time_features(
    query_times: torch.Tensor, period_units: torch.Tensor, units_per_period: torch.Tensor
) -> torch.Tensor:
    """[T, 4]: cos and sin of each period's angle (periods [1, P] seconds, [1, P] units per cycle:
    hour of day, day of week), the angle 2 * 3.14 (not pi) * ((floor(tau / unit) mod n) / n), tau
    taken to float32 first."""
    units = torch.div(query_times.float()[:, None], period_units.float(), rounding_mode="floor")  # [T, P]
    angles = torch.remainder(units, units_per_period.float()) / units_per_period.float() * 2 * 3.14
    return torch.stack([angles.cos(), angles.sin()], dim=-1).flatten(1)  # [T, P, 2] -> [T, 2P]


def action_features(bitmasks: torch.Tensor, action_weights: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """[U, nA * 8]: for each action bit k (in action_weights order), its 8-wide row where the
    event's bitmask has it, zeros where not."""
    hits = (bitmasks[:, None] & action_weights[None, :]) > 0  # [U, nA]
    return (hits[..., None] * table[None]).flatten(1)


def contextual_tokens(dense: dict, tables: dict, features: Features, keys: list, merged_length: int) -> torch.Tensor:
    """[C, D]: contextual feature c's row (zeros if missing or gated) through its own affine map."""
    gates = features.contextual_min_uih_lengths
    rows = []
    for c, (table, key) in enumerate(zip(features.contextual_tables, keys)):
        gate_open = merged_length >= (gates[c] if c < len(gates) else 0)
        present = key is not None and gate_open
        rows.append(tables[table][key].float() if present else torch.zeros(tables[table].shape[1]))
    weights = dense[PRE + "_batched_contextual_linear_weights"]  # [C, E, D]
    return torch.einsum("ce,ced->cd", torch.stack(rows), weights) + dense[PRE + "_batched_contextual_linear_bias"]


def event_tokens(dense: dict, tables: dict, features: Features, user: dict) -> torch.Tensor:
    """[U + T, D]: content MLP of each event's and candidate's item row, plus the action MLP."""
    ids = torch.tensor(user["history"] + user["candidates"], dtype=torch.int64)
    tokens = mlp(dense, PRE + "_content_embedding_mlp.", tables[features.item_table][ids].float())
    if PRE + "_action_encoder._action_embedding_table" in dense:
        bits = action_features(
            torch.tensor(user["actions"], dtype=torch.int64),
            dense[PRE + "_action_encoder._combined_action_weights"],
            dense[PRE + "_action_encoder._action_embedding_table"],
        )
        target = dense[PRE + "_action_encoder._target_action_embedding_table"].expand(len(user["candidates"]), -1)
        tokens = tokens + mlp(dense, PRE + "_action_embedding_mlp.", torch.cat([bits, target]))
    return tokens


def attention_mask(length: int, num_prefix: int) -> torch.Tensor:
    """[L, L] bool: i sees j when i == j or min(i, prefix) > min(j, prefix)."""
    ranks = torch.arange(length).clamp(max=num_prefix)
    return (ranks[:, None] > ranks[None, :]) | torch.eye(length, dtype=torch.bool)


def stu_layer(
    dense: dict, prefix: str, x: torch.Tensor, num_prefix: int, num_heads: int, normaliser: int | torch.Tensor
) -> torch.Tensor:
    """One STU layer on one user's tokens x [L, D]; normaliser: N, or [L] one for each query row."""
    length = x.shape[0]
    normed = layer_norm(x, dense[prefix + "_input_norm_weight"], dense[prefix + "_input_norm_bias"], 1e-6)
    uvqk = normed @ dense[prefix + "_uvqk_weight"] + dense[prefix + "_uvqk_beta"]
    width_v = dense[prefix + "_output_norm_weight"].shape[0]  # dv * H
    width_qk = (uvqk.shape[1] - 2 * width_v) // 2  # dqk * H
    u, v, q, k = uvqk.split([width_v, width_v, width_qk, width_qk], dim=1)
    u = F.silu(u)
    q, k = (t.reshape(length, num_heads, -1).transpose(0, 1) for t in (q, k))  # [H, L, dqk]
    v = v.reshape(length, num_heads, -1).transpose(0, 1)  # [H, L, dv]
    alpha = 1.0 / math.sqrt(q.shape[-1])
    if isinstance(normaliser, torch.Tensor):
        normaliser = normaliser.reshape(length, 1)  # row i of every head divided by its own N
    scores = F.silu(q @ k.transpose(1, 2) * alpha) / normaliser  # [H, L, L]
    attended = (scores * attention_mask(length, num_prefix)) @ v  # [H, L, dv]
    attended = attended.transpose(0, 1).reshape(length, width_v)
    normed_attended = layer_norm(
        attended, dense[prefix + "_output_norm_weight"], dense[prefix + "_output_norm_bias"], 1e-6
    )
    return x + torch.cat([u, attended, u * normed_attended], dim=1) @ dense[prefix + "_output_weight"]


def layer_inputs(dense: dict, tables: dict, features: Features, user: dict, rules: Rules = UPSTREAM) -> torch.Tensor:
    """[C + U + T, D]: the tokens times sqrt(D), plus their position and time rows (history's per rules)."""
    num_contextual = len(features.contextual_tables)
    num_history, num_candidates = len(user["history"]), len(user["candidates"])
    tokens = event_tokens(dense, tables, features, user)
    if num_contextual:
        merged_length = num_history + num_candidates
        tokens = torch.cat([contextual_tokens(dense, tables, features, user["contextual"], merged_length), tokens])
    timestamps = torch.tensor(
        [0] * num_contextual + list(user["timestamps"]) + [user["query_time"]] * num_candidates, dtype=torch.int64
    )
    positions, times = dense[POS + "_position_embeddings_weight"], dense[POS + "_timestamp_embeddings_weight"]
    position_rows = position_indices(
        num_contextual, num_history, num_candidates, positions.shape[0], rules.positions, rules.max_history
    )
    time_rows = time_buckets(timestamps, user["query_time"], times.shape[0]).tolist()
    history = slice(num_contextual, num_contextual + num_history)
    time_rows[history] = history_time_buckets(timestamps[history], user["query_time"], times.shape[0], rules.times)
    return tokens * math.sqrt(tokens.shape[1]) + table_rows(positions, position_rows) + table_rows(times, time_rows)


def table_rows(table: torch.Tensor, rows: list) -> torch.Tensor:
    """[len(rows), D]: the table's rows, zeros where a row is None."""
    present = torch.tensor([row is not None for row in rows], dtype=torch.bool)
    return torch.where(present[:, None], table[[0 if row is None else row for row in rows]], 0.0)


def candidate_logits(dense: dict, states: torch.Tensor, query_times: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
    """[T, K]: the candidates' last-layer states [T, D] through the timestamp postprocessor, times
    the item tower of their rows [T, E], through the prediction head."""
    time = time_features(query_times, dense[POST + "_period_units"], dense[POST + "_units_per_period"])
    combined = F.linear(
        torch.cat([states, time], dim=1),
        dense[POST + "_time_feature_combiner.weight"],
        dense[POST + "_time_feature_combiner.bias"],
    )
    user_state = layer_norm(combined, dense[POST + "_layer_norm.weight"], dense[POST + "_layer_norm.bias"], 1e-5)
    item_state = mlp(dense, "_item_embedding_mlp.", items)
    hidden = F.linear(user_state * item_state, dense[HEAD + "0.weight"], dense[HEAD + "0.bias"])
    hidden = swish_layer_norm(hidden, dense[HEAD + "1.weight"], dense[HEAD + "1.bias"])
    return F.linear(hidden, dense[HEAD + "2.weight"], dense[HEAD + "2.bias"])


def row_normalisers(
    num_contextual: int, num_prefix: int, num_candidates: int, normaliser: int, batch_normaliser: int, rules: Rules
) -> int | torch.Tensor:
    """N for the whole user (upstream), or [L]: each attention row's N under rules."""
    if rules.normaliser == "fixed":
        normaliser = num_contextual + rules.max_history + rules.max_candidates
    if rules.normaliser != "causal" and rules.candidate_normaliser == "same":
        return normaliser
    rows = torch.full((num_prefix + num_candidates,), float(normaliser))
    if rules.normaliser == "causal":
        rows[:num_prefix] = torch.arange(1, num_prefix + 1).clamp(min=num_contextual).float() + rules.max_candidates
        rows[num_prefix:] = num_prefix + rules.max_candidates
    if rules.candidate_normaliser != "same":
        rows[num_prefix:] = batch_normaliser if rules.candidate_normaliser == "batch" else num_prefix + num_candidates
    return rows


def user_logits(
    dense: dict,
    tables: dict,
    features: Features,
    user: dict,
    normaliser: int,
    rules: Rules = UPSTREAM,
    batch_normaliser: int | None = None,
) -> torch.Tensor:
    """[T, K] for one user under the given attention normaliser (prefix rows' per rules;
    batch_normaliser: upstream's N for this batch, the candidates' under candidate_normaliser "batch")."""
    num_contextual = len(features.contextual_tables)
    num_prefix = num_contextual + len(user["history"])
    num_candidates = len(user["candidates"])
    normaliser = row_normalisers(
        num_contextual,
        num_prefix,
        num_candidates,
        normaliser,
        normaliser if batch_normaliser is None else batch_normaliser,
        rules,
    )
    x = layer_inputs(dense, tables, features, user, rules)
    num_layers = sum(1 for name in dense if name.startswith(STU) and name.endswith("._uvqk_weight"))
    for i in range(num_layers):
        x = stu_layer(dense, f"{STU}{i}.", x, num_prefix, features.num_heads, normaliser)
    query_times = torch.full((num_candidates,), user["query_time"], dtype=torch.int64)
    items = tables[features.item_table][user["candidates"]].float()
    return candidate_logits(dense, x[num_prefix:], query_times, items)


def dlrm_hstu_forward(
    dense: dict[str, torch.Tensor],
    tables: dict[str, torch.Tensor],
    batch: list[dict],
    features: Features,
    normaliser: int | None = None,
    rules: Rules = UPSTREAM,
) -> torch.Tensor:
    """The batch's logits [sum of T, K] in float32, users in order, one row per candidate.

    Each user: {"contextual": ids in feature order (None: missing), "history": item ids oldest
    first, "actions": action bitmasks, "timestamps": seconds, "candidates": item ids,
    "query_time": seconds, every candidate's}. normaliser: the attention's N; None is upstream's
    rule, C + the batch's longest history + its most candidates; an int fixes it for every user.
    rules: cache-exact replacements (Rules); upstream's by default.
    """
    dense = {name: t.float() if t.is_floating_point() else t for name, t in dense.items()}
    batch_normaliser = (
        len(features.contextual_tables)
        + max(len(user["history"]) for user in batch)
        + max(len(user["candidates"]) for user in batch)
    )
    if normaliser is None:
        normaliser = batch_normaliser
    return torch.cat(
        [user_logits(dense, tables, features, user, normaliser, rules, batch_normaliser) for user in batch]
    )
