"""Typed Python wrappers of the kvexport:: ops: the only way the model touches the cache runtime.
Each op's fake (meta) implementation for torch.export sits right after its wrapper (library.fake).

A *runtime* is named by a string (the model's config name); each process holds at most one
runtime per name. The stateful ops of one request run in this order:
check_request -> begin_batch -> (upload) -> paged_attention per layer -> end_batch.
A request's tensors are on the host, whatever the runtime's device: check_request, begin_batch and
end_batch read them there without waiting for a device, and `upload` puts what
the model computes with on the device from one pinned staging buffer, asynchronously.
"""

from __future__ import annotations

import json
import logging
from typing import NamedTuple

import torch

from kvexport.ops import library
from kvexport.remote import DEFAULT_WRITE_POLICY

log = logging.getLogger(__name__)


def _ops():
    library.load()
    return torch.ops.kvexport


class CheckedRequest(NamedTuple):
    """A request as check_request returns it, on the host: what the rest of the graph reads."""

    user_ids: torch.Tensor  # [B]
    token_lengths: torch.Tensor  # [B] each user's prefix length P
    token_ids: torch.Tensor  # [sum(P)] the users' prefix tokens, one user after another
    num_candidates: torch.Tensor  # [B]
    candidate_ids: torch.Tensor  # [sum(T)] checked (with model.head item_tower, time-coded)


def check_request(
    runtime: str,
    limits_json: str,
    user_ids: torch.Tensor,
    history_lengths: torch.Tensor,
    item_ids: torch.Tensor,
    action_ids: torch.Tensor,
    context_ids: torch.Tensor,
    num_candidates: torch.Tensor,
    candidate_ids: torch.Tensor,
) -> CheckedRequest:
    """Checks a request (host tensors) against the package's limits (Config.request_limits_json)
    inside the op library, and lays out its prefix tokens in the same pass over its events.

    Returns, on the host, what the rest of the graph reads, so no kernel sees an unchecked id:
    (user_ids, token_lengths, token_ids, num_candidates, candidate_ids). token_lengths [B] are the
    users' prefix lengths C + 2h and token_ids [sum(P)] their prefix tokens, users one after another:
    context ids, then item and action ids interleaved (i_1 a_1 i_2 a_2 ...), or with model.event_tokens
    combined C + h and one token (item << bits) | action an event, as
    kvexport.model.hstu.prefix_tokens lays them out for the full recompute. A tensor on a GPU is
    refused. A refused request raises ValueError and records ("invalid_request", message) for
    last_error(runtime); every request starts by clearing it.
    """
    return CheckedRequest(
        *_ops().check_request(
            runtime,
            limits_json,
            user_ids,
            history_lengths,
            item_ids,
            action_ids,
            context_ids,
            num_candidates,
            candidate_ids,
        )
    )


@library.fake("check_request")
def _check_request_fake(
    runtime, limits, user_ids, history_lengths, item_ids, action_ids, context_ids, num_candidates, candidate_ids
):
    # One batch size for every per-user input, and the jagged sizes the checks guarantee.
    torch._check(history_lengths.shape[0] == user_ids.shape[0], lambda: "history_lengths must match user_ids")
    torch._check(num_candidates.shape[0] == user_ids.shape[0], lambda: "num_candidates must match user_ids")
    torch._check(context_ids.shape[0] == user_ids.shape[0], lambda: "context_ids must match user_ids")
    torch._check(action_ids.shape[0] == item_ids.shape[0], lambda: "action_ids must match item_ids")
    limits = json.loads(limits)  # the token layout's sizes, as kvexport.config derives them
    num_tokens = (
        context_ids.shape[0] * limits["num_contextual_features"] + limits["tokens_per_event"] * item_ids.shape[0]
    )
    token_ids = item_ids.new_empty(num_tokens)
    return (
        torch.empty_like(user_ids),
        torch.empty_like(history_lengths),
        token_ids,
        torch.empty_like(num_candidates),
        torch.empty_like(candidate_ids),
    )


def last_error(runtime: str) -> tuple[str, str]:
    """Why this thread's last request on `runtime` failed: (code, one-line message).

    code is "ok", "invalid_request", "capacity_exceeded" or "internal". Hosts branch on the code,
    never on exception text (torch versions differ in what of it they pass on).
    """
    code, message = _ops().last_error(runtime)
    return code, message


def stat_names() -> list[str]:
    """Names of runtime_stats' values, in order, as the op library defines them."""
    return list(_ops().stat_names())


class NewTokens(NamedTuple):
    """The tokens of a request not served from the cache (begin_batch), users in order, positions
    ascending: the runtime's row order."""

    index: torch.Tensor  # [N_new] into the request's token_ids
    positions: torch.Tensor  # [N_new] absolute positions


def begin_batch(
    runtime: str,
    config_json: str,
    user_ids: torch.Tensor,
    token_ids: torch.Tensor,
    token_lengths: torch.Tensor,
    num_candidates: torch.Tensor,
    placement: torch.Tensor,
) -> NewTokens:
    """Plans a request: reuses each user's longest cached common prefix, evicts and allocates.

    user_ids [B], token_ids [sum(P)] (each user's prefix tokens, jagged), token_lengths [B] (P),
    num_candidates [B], all on the host. placement: any tensor on the runtime's device (the model
    passes a weight); the runtime is created there from `config_json` on first use. Returns, on the
    host, the tokens not served from the cache (each user's tokens after its longest cached prefix).
    The model then computes new rows laid out as [all candidates][token_ids[new.index]], which
    paged_attention relies on.
    """
    new = _ops().begin_batch(runtime, config_json, user_ids, token_ids, token_lengths, num_candidates, placement)
    return NewTokens(new[0], new[1])


@library.fake("begin_batch")
def _begin_batch_fake(runtime, config, user_ids, token_ids, token_lengths, num_candidates, placement):
    torch._check(user_ids.dim() == 1, lambda: f"user_ids must be 1-D, got {user_ids.dim()}-D")
    torch._check(token_lengths.shape[0] == user_ids.shape[0], lambda: "token_lengths must have one entry per user")
    torch._check(num_candidates.shape[0] == user_ids.shape[0], lambda: "num_candidates must have one entry per user")
    # How many tokens are not cached is known only when the runtime has planned the batch; the op
    # returns their index and positions, so the model needs no data-dependent op of its own.
    num_new = torch.library.get_ctx().new_dynamic_size()
    torch._check(num_new <= token_ids.shape[0], lambda: "more uncached tokens than tokens")
    return token_ids.new_empty(2, num_new, dtype=torch.int64)


def upload(runtime: str, host: list[torch.Tensor], placement: torch.Tensor) -> list[torch.Tensor]:
    """Contiguous copies of int64 host tensors on placement's device: on a GPU staged in one pinned
    buffer and copied asynchronously on the current stream, so the host does not wait for the
    device. A failure is one of request `runtime`'s (last_error; its batch is released)."""
    return _ops().upload(runtime, host, placement)


@library.fake("upload")
def _upload_fake(runtime, host, placement):
    return [t.new_empty(t.shape, device=placement.device) for t in host]


def paged_attention(
    runtime: str, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alpha: float, inv_scaling_seqlen: float
) -> torch.Tensor:
    """Stores the layer's new prefix rows of k, v [N, H, dh] in their pages (candidate rows are not
    cached), then HSTU attention of the new rows q over the cached and new k/v -> [N, H, dh].

    Prefix rows read the cache up to themselves; candidates read the whole prefix and their own k, v.
    """
    return _ops().paged_attention(runtime, layer, q, k, v, alpha, inv_scaling_seqlen)


@library.fake("paged_attention")
def _paged_attention_fake(runtime, layer, q, k, v, alpha, inv_scaling_seqlen):
    torch._check(q.dim() == 3, lambda: f"q must be [N, H, dh], got {q.dim()}-D")
    torch._check(q.shape == k.shape and q.shape == v.shape, lambda: "q, k and v must have one shape")
    return torch.empty_like(q)


class StepPlan(NamedTuple):
    """A step program's plan of one batch (docs/design.md 3.9), on the runtime's device: new rows
    are [candidate rows][prefix rows], each part padded to its bucket, the real rows first."""

    page_table: torch.Tensor  # [Bp, pages_per_user] each user's pages
    row_user: torch.Tensor  # [R] batch index of each row (padding rows: 0)
    row_keys: torch.Tensor  # [R] cached keys each row reads (padding rows: 0)
    row_candidate: torch.Tensor  # [R] 1 for candidate rows
    write_slots: torch.Tensor  # [Np] cache slot of each prefix row's k (padding rows: a trash page)
    value_slots: torch.Tensor  # [Np] its v
    row_order: torch.Tensor  # [R] rows grouped by user (tiles index it), padding rows last
    tiles: torch.Tensor  # [TT, 3] (user, first index into row_order, rows); empty ones last


class StepInputs(NamedTuple):
    """What a step program embeds: candidate ids and positions [Tp], new prefix token ids and
    positions [Np] (padding: id 0 at position 0)."""

    candidate_ids: torch.Tensor
    candidate_positions: torch.Tensor
    new_ids: torch.Tensor
    new_positions: torch.Tensor


# int64 values per 16 bytes: begin_step starts each part of its buffer on such a boundary.
STEP_ALIGN = 2


class StepLayout(NamedTuple):
    """Sizes of begin_step's buffer (csrc/runtime/batch_plan.h, StepLayout): the bucket, and how
    many of its candidate rows are the batch's."""

    candidate_rows: int
    prefix_rows: int
    users: int
    pages_per_user: int
    tiles: int
    real_candidates: int

    @property
    def bucket(self) -> tuple[int, int, int]:
        """What a captured step depends on besides the model: (candidate rows, prefix rows, users)."""
        return self.candidate_rows, self.prefix_rows, self.users

    def sizes(self) -> tuple[int, ...]:
        """Elements of each part of the buffer, in its order (StepInputs', then StepPlan's)."""
        t, n, rows = self.candidate_rows, self.prefix_rows, self.candidate_rows + self.prefix_rows
        return t, t, n, n, self.users * self.pages_per_user, rows, rows, rows, n, n, rows, 3 * self.tiles

    def offsets(self) -> tuple[int, ...]:
        """Where each part starts: on a 16-byte boundary (STEP_ALIGN values), as AOTInductor compiles
        the step program's inputs to expect (an input off it is copied on every run)."""
        starts, start = [], 0
        for size in self.sizes():
            starts.append(start)
            start += -(-size // STEP_ALIGN) * STEP_ALIGN
        return tuple(starts)

    def numel(self) -> int:
        """Values in the whole buffer."""
        return self.offsets()[-1] + -(-self.sizes()[-1] // STEP_ALIGN) * STEP_ALIGN

    def split(self, buffer: torch.Tensor) -> tuple[StepInputs, StepPlan]:
        """Views of begin_step's buffer (on the host, or a copy of it on the device), in its order."""
        parts = [buffer.narrow(0, start, size) for start, size in zip(self.offsets(), self.sizes())]
        parts[4] = parts[4].view(self.users, self.pages_per_user)
        parts[11] = parts[11].view(self.tiles, 3)
        return StepInputs(*parts[:4]), StepPlan(*parts[4:])


def begin_step(
    runtime: str,
    config_json: str,
    user_ids: torch.Tensor,
    token_ids: torch.Tensor,
    token_lengths: torch.Tensor,
    num_candidates: torch.Tensor,
    candidate_ids: torch.Tensor,
    placement: torch.Tensor,
    max_prefix_length: int,
) -> tuple[torch.Tensor, StepLayout]:
    """begin_batch for a step program: plans the batch (check_request's host tensors, and its
    candidate_ids) and returns, on the host (pinned for a GPU runtime), the step's inputs and plan
    in one int64 buffer padded to a bucket, with its layout (StepLayout.split views it). The host
    uploads the buffer, runs the step program on it, then calls end_batch. Refusals as begin_batch's.
    """
    staged, layout = _ops().begin_step(
        runtime,
        config_json,
        user_ids,
        token_ids,
        token_lengths,
        num_candidates,
        candidate_ids,
        placement,
        max_prefix_length,
    )
    values = layout.tolist()  # StepLayout's fields, then the alignment of the buffer's parts
    if len(values) != len(StepLayout._fields) + 1 or values[-1] != STEP_ALIGN:
        raise RuntimeError(
            f"begin_step's layout is not this version's ({len(values)} values): the op library "
            "was built from other kvexport sources"
        )
    return staged, StepLayout(*values[:-1])


@library.fake("begin_step")
def _begin_step_fake(
    runtime, config, user_ids, token_ids, token_lengths, num_candidates, candidate_ids, placement, max_prefix_length
):
    torch._check(user_ids.dim() == 1, lambda: f"user_ids must be 1-D, got {user_ids.dim()}-D")
    staged = token_ids.new_empty(torch.library.get_ctx().new_dynamic_size(), dtype=torch.int64)
    return staged, torch.empty(7, dtype=torch.int64)


def paged_attention_step(
    runtime: str,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: StepPlan,
    max_keys: int,
    alpha: float,
    inv_scaling_seqlen: float,
) -> torch.Tensor:
    """paged_attention with the plan as tensors (a step program's): stores the layer's prefix rows
    of k, v [R, H, dh] (the last plan.write_slots rows) in their slots, then attends. max_keys
    bounds every row's keys (the model's max_prefix_length); a CUDA graph of the step replays the
    same launch for every batch of its bucket. The calling thread must be in a batch (begin_step).
    """
    return _ops().paged_attention_step(runtime, layer, q, k, v, *plan, max_keys, alpha, inv_scaling_seqlen)


@library.fake("paged_attention_step")
def _paged_attention_step_fake(
    runtime,
    layer,
    q,
    k,
    v,
    page_table,
    row_user,
    row_keys,
    row_candidate,
    write_slots,
    value_slots,
    row_order,
    tiles,
    max_keys,
    alpha,
    inv_scaling_seqlen,
):
    torch._check(q.dim() == 3, lambda: f"q must be [N, H, dh], got {q.dim()}-D")
    torch._check(q.shape == k.shape and q.shape == v.shape, lambda: "q, k and v must have one shape")
    # The plan's sizes are the step program's own inputs (rows = candidate rows + prefix rows); the
    # op checks them against q when it runs.
    return torch.empty_like(q)


def end_batch(runtime: str, user_ids: torch.Tensor, after: torch.Tensor) -> None:
    """Commits the request: the users' caches now hold their whole prefix.

    user_ids are on the host. `after` (the request's logits) is not read; it makes end_batch
    depend on every layer by data.
    """
    _ops().end_batch(runtime, user_ids, after)


@library.fake("end_batch")
def _end_batch_fake(runtime, user_ids, after):
    torch._check(user_ids.dim() == 1, lambda: f"user_ids must be 1-D, got {user_ids.dim()}-D")


def abort_batch(runtime: str) -> None:
    """Releases this thread's unfinished request without committing it (no-op without one).

    Never required: a failing op releases its request's batch itself, and a request that stops
    between ops loses the runtime after kv_cache.stall_timeout_ms. Users keep only the prefixes
    that were already cached.
    """
    _ops().abort_batch(runtime)


@library.fake("abort_batch")
def _abort_batch_fake(runtime):
    return None


def hstu_paged_attention(
    q, k, v, cache, page_table, row_user, row_keys, row_candidate, alpha: float, inv_scaling_seqlen: float
) -> torch.Tensor:
    """The kernel behind paged_attention with every input explicit (no runtime state).

    cache [pages, 2, page_size, H, dh] in q's dtype, or FP8 pages [pages, page_bytes] of uint8
    (docs/design.md §2.7); page_table [B, max_pages], row_user/row_keys/row_candidate [N].
    """
    return _ops().hstu_paged_attention(
        q, k, v, cache, page_table, row_user, row_keys, row_candidate, alpha, inv_scaling_seqlen
    )


@library.fake("hstu_paged_attention")
def _hstu_paged_attention_fake(
    q, k, v, cache, page_table, row_user, row_keys, row_candidate, alpha, inv_scaling_seqlen
):
    torch._check(q.dim() == 3, lambda: f"q must be [N, H, dh], got {q.dim()}-D")
    torch._check(
        cache.dim() == (2 if cache.dtype == torch.uint8 else 5),
        lambda: (
            f"cache must be [pages, 2, page_size, H, dh] or FP8 pages [pages, page_bytes], "
            f"got {cache.dim()}-D {cache.dtype}"
        ),
    )
    torch._check(row_user.shape[0] == q.shape[0], lambda: "row_user must have one entry per row of q")
    return torch.empty_like(q)


def fp8_round(x: torch.Tensor) -> torch.Tensor:
    """Rows x [N, H, dh] rounded as FP8 pages store them, in x's dtype: e4m3 with one power-of-two
    scale per row and head (docs/design.md §2.7). The full recompute of a model with FP8 pages
    attends over these; its cached path reads the same values from its pages."""
    return _ops().fp8_round(x)


@library.fake("fp8_round")
def _fp8_round_fake(x):
    torch._check(x.dim() == 3, lambda: f"x must be [N, H, dh], got {x.dim()}-D")
    return torch.empty_like(x)


def create_runtime(runtime: str, config_json: str, device: torch.device | str = "cpu") -> None:
    """Creates the named runtime (no-op when it exists with the same config and device)."""
    _ops().create_runtime(runtime, config_json, torch.device(device))


@library.fake("create_runtime")
def _create_runtime_fake(runtime, config, device):
    return None


def runtime_stats(runtime: str) -> dict[str, int]:
    """Counters and occupancy of the named runtime."""
    values = _ops().runtime_stats(runtime).tolist()
    return dict(zip(stat_names(), values, strict=True))


@library.fake("runtime_stats")
def _runtime_stats_fake(runtime):
    return torch.empty(len(torch.ops.kvexport.stat_names()), dtype=torch.int64)


def reset_runtime(runtime: str) -> None:
    """Empties both tiers and zeroes the counters."""
    _ops().reset_runtime(runtime)


@library.fake("reset_runtime")
def _reset_runtime_fake(runtime):
    return None


def evict_user(runtime: str, user_id: int) -> bool:
    """Moves a user from the device tier to the offload tier; False if it was not on the device.
    ValueError for a user of the calling thread's own batch in flight."""
    return _ops().evict_user(runtime, user_id)


@library.fake("evict_user")
def _evict_user_fake(runtime, user_id):
    return False


def cached_length(runtime: str, user_id: int) -> int:
    """Prefix tokens cached for a user on either tier (0 if none)."""
    return _ops().cached_length(runtime, user_id)


@library.fake("cached_length")
def _cached_length_fake(runtime, user_id):
    return 0


def device_users_lru(runtime: str) -> list[int]:
    """Users on the device tier, least recently used first."""
    return _ops().device_users_lru(runtime).tolist()


@library.fake("device_users_lru")
def _device_users_lru_fake(runtime):
    return torch.empty(torch.library.get_ctx().new_dynamic_size(), dtype=torch.int64)


def read_user_kv(runtime: str, user_id: int) -> torch.Tensor:
    """A device-tier user's cached k/v, [layers, 2, cached_length, H, dh] (a copy)."""
    return _ops().read_user_kv(runtime, user_id)


@library.fake("read_user_kv")
def _read_user_kv_fake(runtime, user_id):
    ctx = torch.library.get_ctx()
    layers, length, heads, head_dim = (ctx.new_dynamic_size() for _ in range(4))
    return torch.empty(layers, 2, length, heads, head_dim)


def drop_runtime(runtime: str) -> bool:
    """Removes the named runtime from this process; False if there was none."""
    return _ops().drop_runtime(runtime)


@library.fake("drop_runtime")
def _drop_runtime_fake(runtime):
    return False


def gpu_info(device: torch.device) -> tuple[str, str]:
    """The CUDA device's compute capability ("major.minor") and name as the op library sees them;
    ("", "") for a CPU device, a device this host lacks, or an op library built without CUDA.
    The replay harness checks a CUDA package's build GPU with it."""
    return tuple(_ops().gpu_info(device))


@library.fake("gpu_info")
def _gpu_info_fake(device):
    return "", ""


def attach_remote(runtime: str, url: str, write_policy: str = DEFAULT_WRITE_POLICY) -> bool:
    """Adds the remote tier (a Redis/Valkey server at redis://[[user]:password@]host[:port][/db];
    with a password, every connection authenticates with it, as that Redis 6 ACL user if one is
    named) behind the host tier; write_policy is one of kvexport.remote.WRITE_POLICIES.

    Shared by every process whose runtime has this name. Users the host tier lets go are written
    there (write_policy "after_batch": also every user of every committed batch), asynchronously,
    to expire after the runtime config's remote_ttl_s; a user missing from both local tiers is read
    from it, ahead of its batch, within remote_read_budget_us. Returns False, and logs one warning,
    when the server does not answer: the runtime then runs without the tier. ValueError for a bad
    URL or policy, a server that answers but refuses the connection (a wrong or missing password:
    "WRONGPASS ...", "NOAUTH ..."), an unknown runtime, a remote tier attached already, or an op
    library built without the remote tier. Messages and logs show the URL's credentials as ***.
    """
    attached = _ops().attach_remote(runtime, url, write_policy)
    if not attached:
        log.warning("remote tier %s is unreachable; runtime '%s' runs without it", redact_url(url), runtime)
    return attached


@library.fake("attach_remote")
def _attach_remote_fake(runtime, url, write_policy):
    return False


def redact_url(url: str) -> str:
    """`url` for a message or a log, as the op library writes it: everything between its scheme (an
    RFC 3986 "scheme://", else none) and its last '@' (the user and the password of
    redis://user:password@host, however malformed the URL) as ***."""
    return _ops().redact_url(url)


def flush_remote(runtime: str, timeout_ms: int) -> bool:
    """Waits up to timeout_ms (without the GIL) for the remote tier's queued writes to reach the
    server; False if some are still queued. True at once when the runtime has no remote tier."""
    return _ops().flush_remote(runtime, timeout_ms)


@library.fake("flush_remote")
def _flush_remote_fake(runtime, timeout_ms):
    return True
