"""HSTU ranking model (inference): the math of docs/design.md §1. forward is the full recompute;
the KV-cached routes (kvexport.cached) drive the same embeddings, layer stack and head through the
cache runtime's ops, each with its own attention.

Token order of one user: [ctx_1..ctx_C][i_1, a_1, ..., i_h, a_h][cand_1..cand_T]. The first
C + 2h tokens are the user's *prefix* (cacheable); candidates all share position C + 2h (or,
with model.candidate_position shared_row, the position table's last row). With
model.event_tokens: combined an event is one token e_k (its item's row plus its action's), so the
prefix is [ctx_1..ctx_C][e_1..e_h], C + h tokens.

With model.head: item_tower a request's context_ids carry its query time as a last column, which
is no token: the head reads its calendar code, which travels in the low bits of each checked
candidate id, (item << time_code_bits) | code (kvexport::check_request, time_codes below).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from kvexport.config import CONTEXT_FEATURE_SHIFT, Config, ModelConfig
from kvexport.model.batch import Batch
from kvexport.ops import jagged
from kvexport.ops import wrappers as kv

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A route's attention in the layer stack: (layer index, q, k, v) -> o, each [N, H, dh].
Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# The item_tower head's norms (DLRMv3's postprocessor and prediction MLP use LayerNorm's default).
HEAD_EPS = 1e-5


class PrefixTokens(NamedTuple):
    """Each user's prefix as one jagged token sequence. Token ids are the raw ids (a combined event
    token's id holds its item and action); a token's kind (context, item, action, event) follows
    from its position."""

    token_ids: torch.Tensor  # [sum(P)]
    positions: torch.Tensor  # [sum(P)] absolute, from 0 per user
    token_lengths: torch.Tensor  # [B] P = C + 2h (pairs) or C + h (combined)
    token_user: torch.Tensor  # [sum(P)] batch index of each token


def prefix_tokens(
    history_lengths: torch.Tensor,
    item_ids: torch.Tensor,
    action_ids: torch.Tensor,
    context_ids: torch.Tensor,
    action_bits: int | None = None,
) -> PrefixTokens:
    """Lays out each user's context and history as one jagged token sequence: events as item/action
    pairs, or (action_bits given: model.event_tokens combined) one token (item << action_bits) | action
    each."""
    num_users, num_context = context_ids.shape
    # One batch size for all per-user inputs (lets export unify their symbols up front).
    torch._check(history_lengths.shape[0] == num_users, lambda: "history_lengths and context_ids disagree on B")
    per_event = 2 if action_bits is None else 1
    num_history_tokens = per_event * item_ids.shape[0]
    token_lengths = num_context + per_event * history_lengths  # [B]
    offsets = jagged.lengths_to_offsets(token_lengths)  # [B + 1]
    if action_bits is None:
        history = torch.stack([item_ids, action_ids], dim=1).reshape(-1)  # [2 sum(h)] i_1 a_1 i_2 a_2 ...
    else:
        history = (item_ids << action_bits) | action_ids  # [sum(h)]
    history_user = torch.repeat_interleave(
        torch.arange(num_users, device=item_ids.device), per_event * history_lengths, output_size=num_history_tokens
    )
    history_offsets = jagged.lengths_to_offsets(per_event * history_lengths)
    history_local = torch.arange(num_history_tokens, device=item_ids.device) - history_offsets[history_user]
    history_dest = offsets[history_user] + num_context + history_local
    context_local = torch.arange(num_context, device=item_ids.device).unsqueeze(0)  # [1, C]
    context_dest = (offsets[:-1].unsqueeze(1) + context_local).reshape(-1)  # [B * C]

    total = num_users * num_context + num_history_tokens
    token_ids = item_ids.new_empty(total)
    token_ids[context_dest] = context_ids.reshape(-1)
    token_ids[history_dest] = history
    token_user = torch.repeat_interleave(
        torch.arange(num_users, device=item_ids.device), token_lengths, output_size=total
    )
    positions = torch.arange(total, device=item_ids.device) - offsets[token_user]
    return PrefixTokens(token_ids, positions, token_lengths, token_user)


def time_codes(query_times: torch.Tensor, periods: tuple) -> torch.Tensor:
    """[B] calendar codes of query times [B] (seconds): for each [seconds per unit, units per cycle]
    period, floor(t / seconds) mod units, mixed radix with the first period most significant. In
    float32, as DLRMv3 computes its time features (t taken to float32 first, torch's floor division
    and remainder); kvexport::check_request computes the same in C++."""
    seconds = query_times.float()
    code = torch.zeros_like(query_times)
    for unit, units in periods:
        index = torch.remainder(
            torch.div(seconds, torch.tensor(float(unit), device=seconds.device), rounding_mode="floor"),
            torch.tensor(float(units), device=seconds.device),
        )
        code = code * units + index.long().clamp(0, units - 1)
    return code


class SwishLayerNorm(nn.Module):
    """x * sigmoid(LN(x)), the LN with its own affine."""

    def __init__(self, size: int, eps: float = HEAD_EPS):
        super().__init__()
        self.norm = nn.LayerNorm(size, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.norm(x))


class ItemTowerHead(nn.Module):
    """model.head: item_tower (docs/design.md §1.5): the candidate's state combined with its query
    time's calendar features, LN(state W_c + time[code]) (time[code] holds the features' part of
    the combining layer and its bias), times the candidate's row of the item tower table, then
    Linear, SwishLayerNorm, Linear."""

    def __init__(self, m: ModelConfig):
        super().__init__()
        self.combiner = nn.Linear(m.hidden_size, m.hidden_size, bias=False)
        self.time_embedding = nn.Embedding(m.num_time_codes, m.hidden_size)
        self.user_norm = nn.LayerNorm(m.hidden_size, eps=HEAD_EPS)
        self.tower_embedding = nn.Embedding(m.item_vocab_size, m.hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(m.hidden_size, m.mlp_hidden_size),
            SwishLayerNorm(m.mlp_hidden_size),
            nn.Linear(m.mlp_hidden_size, m.num_tasks),
        )

    def forward(self, states: torch.Tensor, item_rows: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        user = self.user_norm(self.combiner(states) + self.time_embedding(codes))
        return self.mlp(user * self.tower_embedding(item_rows))

    def score(self, states: torch.Tensor, candidate_ids: torch.Tensor, model: HSTURanker) -> torch.Tensor:
        """Final states [T, d] of checked candidate ids [T] -> [T, num_tasks]: each reads its item's
        tower row and its query time's code."""
        items = model.candidates.items(candidate_ids)
        return self(states, model.item_rows(items), model.candidates.codes(candidate_ids))


class MlpHead(nn.Sequential):
    """model.head: mlp (docs/design.md §1.5): the L2-normalised state through Linear, the
    activation, Linear (a Sequential, so that its weights keep the names head.0 and head.2)."""

    def __init__(self, m: ModelConfig):
        activation = {"silu": nn.SiLU, "relu": nn.ReLU}[m.head_activation]  # config.HEAD_ACTIVATIONS
        super().__init__(
            nn.Linear(m.hidden_size, m.mlp_hidden_size), activation(), nn.Linear(m.mlp_hidden_size, m.num_tasks)
        )

    def score(self, states: torch.Tensor, candidate_ids: torch.Tensor, model: HSTURanker) -> torch.Tensor:
        """Final states [T, d] -> [T, num_tasks]; the candidate ids play no part."""
        return self(nn.functional.normalize(states, dim=-1))


class PairEvents:
    """model.event_tokens pairs: an event is two tokens, its item's then its action's."""

    action_bits = None  # prefix_tokens' layout of pairs

    def embed(
        self, model: HSTURanker, token_ids: torch.Tensor, positions: torch.Tensor, is_context: torch.Tensor
    ) -> torch.Tensor:
        """History tokens [N] at their positions [N] -> [N, d] (rows of context tokens are zeros)."""
        is_item = ~is_context & ((positions - model.num_contextual_features) % 2 == 0)
        is_action = ~is_context & ~is_item
        item = model.item_embedding(model.item_rows(torch.where(is_item, token_ids, 0)))
        action = model.action_embedding(torch.where(is_action, token_ids, 0))
        return torch.where(is_item.unsqueeze(1), item, action)


class CombinedEvents:
    """model.event_tokens combined: an event is one token (item << action_bits) | action, its item's
    row plus its action's."""

    def __init__(self, action_bits: int):
        self.action_bits = action_bits

    def embed(
        self, model: HSTURanker, token_ids: torch.Tensor, positions: torch.Tensor, is_context: torch.Tensor
    ) -> torch.Tensor:
        event = torch.where(is_context, 0, token_ids)
        item = model.item_embedding(model.item_rows(event >> self.action_bits))
        return item + model.action_embedding(event & ((1 << self.action_bits) - 1))


class PlainCandidates:
    """model.head mlp: a checked candidate id is its item id."""

    def checked(self, batch: Batch) -> torch.Tensor:
        return batch.candidate_ids

    def items(self, candidate_ids: torch.Tensor) -> torch.Tensor:
        return candidate_ids


class TimeCodedCandidates:
    """model.head item_tower: a checked candidate id carries its user's query-time code in its low
    bits, (item << time_code_bits) | code, as kvexport::check_request writes it."""

    def __init__(self, m: ModelConfig):
        self.periods, self.bits = m.query_time_periods, m.time_code_bits
        self.query_time_column = m.num_contextual_features  # context_ids' last column

    def checked(self, batch: Batch) -> torch.Tensor:
        codes = time_codes(batch.context_ids[:, self.query_time_column], self.periods)
        codes = torch.repeat_interleave(codes, batch.num_candidates, output_size=batch.candidate_ids.shape[0])
        return (batch.candidate_ids << self.bits) | codes

    def items(self, candidate_ids: torch.Tensor) -> torch.Tensor:
        return candidate_ids >> self.bits

    def codes(self, candidate_ids: torch.Tensor) -> torch.Tensor:
        return candidate_ids & ((1 << self.bits) - 1)


class HSTULayer(nn.Module):
    """One HSTU layer, split around its attention so the cached path can put its ops there.

    The config's semantics switches (docs/design.md §1.3) act here, before the k/v that are cached
    and after the attention: layer_norm_eps, silu_on, layer_output.
    """

    def __init__(self, m: ModelConfig):
        super().__init__()
        self.num_heads, self.head_dim = m.num_heads, m.head_dim
        self.activate = _silu_uvqk if m.silu_on == "uvqk" else _silu_u
        self.combine = _concat_output if m.layer_output == "concat" else _gated_output
        size = m.num_heads * m.head_dim
        self.input_norm = nn.LayerNorm(m.hidden_size, eps=m.layer_norm_eps)
        self.uvqk = nn.Linear(m.hidden_size, 4 * size)
        self.attention_norm = nn.LayerNorm(size, eps=m.layer_norm_eps)
        self.output = nn.Linear((3 if m.layer_output == "concat" else 1) * size, m.hidden_size)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [N, d] -> u, v, q, k, each [N, H, dh]."""
        u, v, q, k = self.activate(self.uvqk(self.input_norm(x)))
        return tuple(t.unflatten(1, (self.num_heads, self.head_dim)) for t in (u, v, q, k))

    def finish(self, x: torch.Tensor, u: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Residual update x + (u * LN(o)) W_o, or x + [u, o, u * LN(o)] W_o; u, o [N, H, dh]."""
        u, o = u.flatten(1), o.flatten(1)
        return x + self.output(self.combine(u, o, u * self.attention_norm(o)))


def _silu_uvqk(uvqk: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """model.silu_on uvqk: one activation over all four (the default, and the eager hot path)."""
    return nn.functional.silu(uvqk).chunk(4, dim=1)


def _silu_u(uvqk: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """model.silu_on u: only u is activated."""
    u, v, q, k = uvqk.chunk(4, dim=1)
    return nn.functional.silu(u), v, q, k


def _gated_output(u: torch.Tensor, o: torch.Tensor, gated: torch.Tensor) -> torch.Tensor:
    """model.layer_output gated: u * LN(o)."""
    return gated


def _concat_output(u: torch.Tensor, o: torch.Tensor, gated: torch.Tensor) -> torch.Tensor:
    """model.layer_output concat: [u, o, u * LN(o)]."""
    return torch.cat([u, o, gated], dim=1)


def attention_mask(
    prefix_lengths: torch.Tensor, sequence_lengths: torch.Tensor, max_length: int, context_rows: int = 0
) -> torch.Tensor:
    """[B, L, L] bool: query i may read key j (docs/design.md §1.4).

    Causal over the prefix; a candidate reads the whole prefix and itself; padding reads nothing.
    context_rows: the first rows that read the whole prefix (model.context_attention: whole_prefix).
    """
    steps = torch.arange(max_length, device=prefix_lengths.device)
    i, j = steps.view(1, -1, 1), steps.view(1, 1, -1)
    prefix = prefix_lengths.view(-1, 1, 1)
    valid = (i < sequence_lengths.view(-1, 1, 1)) & (j < sequence_lengths.view(-1, 1, 1))
    return valid & (((j < prefix) & ((j <= i) | (i < context_rows))) | (i == j))


def jagged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    prefix_lengths: torch.Tensor,
    alpha: float,
    scaling_seqlen: int,
    context_rows: int = 0,
) -> torch.Tensor:
    """HSTU attention over user-major jagged rows [N, H, dh] (each user: prefix, then candidates)."""
    lengths = offsets[1:] - offsets[:-1]
    max_length = int(lengths.max())
    padded = [
        jagged.jagged_to_padded(t.flatten(1), offsets, max_length).unflatten(2, t.shape[1:]) for t in (q, k, v)
    ]  # each [B, L, H, dh]
    qp, kp, vp = (t.transpose(1, 2) for t in padded)  # [B, H, L, dh]
    scores = nn.functional.silu(alpha * qp @ kp.transpose(-1, -2)) / scaling_seqlen  # [B, H, L, L]
    scores = scores * attention_mask(prefix_lengths, lengths, max_length, context_rows).unsqueeze(1)
    out = (scores @ vp).transpose(1, 2)  # [B, L, H, dh]
    return jagged.padded_to_jagged(out.flatten(2), offsets, q.shape[0]).unflatten(1, q.shape[1:])


class HSTURanker(nn.Module):
    """HSTU ranking model: jagged batch in, [sum(T), num_tasks] float32 logits out."""

    def __init__(self, config: Config):
        super().__init__()
        m = config.model
        self.config = config
        self.num_contextual_features = m.num_contextual_features
        self.embedding_scale = math.sqrt(m.hidden_size)
        self.alpha = 1.0 / math.sqrt(m.head_dim)
        self.scaling_seqlen = m.scaling_seqlen
        self.max_prefix_length = m.max_prefix_length
        self.events = CombinedEvents(m.action_bits) if m.event_tokens == "combined" else PairEvents()
        self.shared_candidate_row = m.candidate_position == "shared_row"
        self.context_rows_see_prefix = m.context_rows_see_prefix
        # model.head: item_tower: checked candidate ids carry a query-time code in their low bits.
        self.candidates = TimeCodedCandidates(m) if m.head == "item_tower" else PlainCandidates()
        # FP8 pages (docs/design.md §2.7): the model attends over FP8-rounded prefix keys and values
        # on every route; the full recompute rounds them as the pages store them. None: unrounded.
        self.round_kv = kv.fp8_round if config.kv_cache.fp8_pages else None
        self.context_embedding = nn.Embedding(m.context_vocab_size, m.hidden_size)
        if m.context_ids == "keys":
            # (feature << CONTEXT_FEATURE_SHIFT) | key of rows 0..V-2, ascending; the last row is every
            # other pair's. A random model's rows are dealt to the features in turn, keys spread out.
            rows = torch.arange(m.context_vocab_size - 1)
            feature, local = rows % m.num_contextual_features, rows // m.num_contextual_features
            keys = (feature << CONTEXT_FEATURE_SHIFT) | (local * 3 + 1)
            self.register_buffer("context_keys", keys.sort().values)
        self.item_embedding = nn.Embedding(m.item_vocab_size, m.hidden_size)
        if m.item_ids == "keys":
            # The trainer's item keys of rows 0..V-2, ascending; the last row is every other id's.
            # A random model's keys are spread out, so that ids between them are unknown.
            self.register_buffer("item_keys", torch.arange(m.item_vocab_size - 1, dtype=torch.int64) * 3 + 1)
        self.action_embedding = nn.Embedding(m.action_vocab_size, m.hidden_size)
        self.position_embedding = nn.Embedding(m.max_prefix_length + 1, m.hidden_size)
        self.layers = nn.ModuleList(HSTULayer(m) for _ in range(m.num_layers))
        self.head = ItemTowerHead(m) if m.head == "item_tower" else MlpHead(m)

    def item_rows(self, item_ids: torch.Tensor) -> torch.Tensor:
        """The item table's rows of a request's item ids: the ids themselves, or (model.item_ids:
        keys) the row of each id among item_keys, and the last row for an id not among them."""
        if not hasattr(self, "item_keys"):
            return item_ids
        return _keyed_rows(self.item_keys, item_ids)

    def context_rows(self, context_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The context table's rows of context ids of the given features (their positions 0..C-1):
        the ids themselves, or (model.context_ids: keys) the row of each (feature, id) pair among
        context_keys, and the last row for a pair not among them."""
        if not hasattr(self, "context_keys"):
            return context_ids
        return _keyed_rows(self.context_keys, (features << CONTEXT_FEATURE_SHIFT) | context_ids)

    def embed_prefix(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Prefix tokens [N] at absolute positions [N] -> [N, d]."""
        is_context = positions < self.num_contextual_features
        context = self.context_embedding(
            self.context_rows(torch.where(is_context, token_ids, 0), torch.where(is_context, positions, 0))
        )
        events = self.events.embed(self, token_ids, positions, is_context)
        tokens = torch.where(is_context.unsqueeze(1), context, events)
        return tokens * self.embedding_scale + self.position_embedding(positions)

    def embed_candidates(
        self, candidate_ids: torch.Tensor, token_lengths: torch.Tensor, num_candidates: torch.Tensor
    ) -> torch.Tensor:
        """Candidates [T] -> [T, d]; a user's candidates share position P (its prefix length)."""
        positions = torch.repeat_interleave(token_lengths, num_candidates, output_size=candidate_ids.shape[0])
        return self.embed_candidates_at(candidate_ids, positions)

    def embed_candidates_at(self, candidate_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Checked candidates [T] at their users' prefix lengths [T] -> [T, d]; with
        model.candidate_position shared_row every candidate reads the position table's last row,
        which no prefix token reads."""
        rows = self.item_embedding(self.item_rows(self.candidates.items(candidate_ids))) * self.embedding_scale
        if self.shared_candidate_row:
            return rows + self.position_embedding.weight[-1]
        return rows + self.position_embedding(positions)

    def score(self, candidate_states: torch.Tensor, candidate_ids: torch.Tensor) -> torch.Tensor:
        """Final candidate states [T, d] of checked candidate ids [T] -> float32 logits [T, num_tasks]."""
        return self.head.score(candidate_states, candidate_ids, self).float()

    def run_layers(self, x: torch.Tensor, attend: Attention) -> torch.Tensor:
        """The layer stack over rows x [N, d]: each layer projects, attends through `attend`
        (layer index, q, k, v -> o, the route's attention) and updates the residual."""
        for i, layer in enumerate(self.layers):
            u, v, q, k = layer.project(x)
            x = layer.finish(x, u, attend(i, q, k, v))
        return x

    def forward(self, batch: Batch) -> torch.Tensor:
        """Full recompute: every token of every user, no cache."""
        token_ids, positions, token_lengths, _ = prefix_tokens(
            batch.history_lengths,
            batch.item_ids,
            batch.action_ids,
            batch.context_ids[:, : self.num_contextual_features],
            self.events.action_bits,
        )
        num_candidates = batch.num_candidates
        candidate_ids = self.candidates.checked(batch)
        prefix = self.embed_prefix(token_ids, positions)
        candidates = self.embed_candidates(candidate_ids, token_lengths, num_candidates)
        rows, offsets = _user_major_rows(token_lengths, num_candidates)
        x = torch.cat([prefix, candidates])[rows]  # [N, d] user-major: prefix_b, candidates_b
        is_prefix = (rows < prefix.shape[0]).view(-1, 1, 1)  # [N, 1, 1]

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if self.round_kv is not None:
                # Rounded as the cache stores the prefix; a candidate's own k/v are never cached.
                k = torch.where(is_prefix, self.round_kv(k), k)
                v = torch.where(is_prefix, self.round_kv(v), v)
            return jagged_attention(
                q, k, v, offsets, token_lengths, self.alpha, self.scaling_seqlen, self.context_rows_see_prefix
            )

        x = self.run_layers(x, attend)
        candidate_rows = torch.empty_like(rows)
        candidate_rows[rows] = torch.arange(rows.shape[0], device=rows.device)
        return self.score(x[candidate_rows[prefix.shape[0] :]], candidate_ids)


def _keyed_rows(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Row of each id among ascending `keys` (a table of len(keys) + 1 rows); the last row for an id
    that is not a key."""
    if keys.shape[0] == 0:  # no keys: every id reads the one row
        return torch.zeros_like(ids)
    last = keys.shape[0] - 1
    rows = torch.searchsorted(keys, ids).clamp(max=last)
    return torch.where(keys[rows] == ids, rows, last + 1)


def _user_major_rows(token_lengths: torch.Tensor, num_candidates: torch.Tensor):
    """Order of rows of cat([prefix, candidates]) that groups each user's prefix with its candidates.

    Returns the gather index [N] and the user-major offsets [B + 1].
    """
    num_prefix = int(token_lengths.sum())
    sequence_offsets = jagged.lengths_to_offsets(token_lengths + num_candidates)
    prefix_offsets = jagged.lengths_to_offsets(token_lengths)
    candidate_offsets = jagged.lengths_to_offsets(num_candidates)
    rows = []
    for b in range(token_lengths.shape[0]):
        rows.append(torch.arange(prefix_offsets[b], prefix_offsets[b + 1]))
        rows.append(num_prefix + torch.arange(candidate_offsets[b], candidate_offsets[b + 1]))
    return torch.cat(rows).to(token_lengths.device), sequence_offsets
