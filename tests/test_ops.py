"""Every kvexport:: op: plain-PyTorch reference, torch.library.opcheck, and survival through export."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from kvexport.config import load_config
from kvexport.model.batch import Batch, random_batch
from kvexport.ops import library
from kvexport.ops import wrappers as kv
from tests.helpers import ROOT
from tests.helpers.attention import ALPHA, INV_S, random_paged_inputs, reference_paged_attention, strided_like
from tests.helpers.runtime import host_placement, scratch_runtime


@pytest.mark.parametrize("head_dim", [32, 64, 128, 24])  # the compile-time sizes and the generic path
def test_paged_attention_kernel_head_sizes(head_dim):
    inputs = random_paged_inputs(5, head_dim=head_dim)
    got = kv.hstu_paged_attention(*inputs, ALPHA, INV_S)
    torch.testing.assert_close(got, reference_paged_attention(*inputs), rtol=1e-5, atol=1e-5)


# One thread: the call runs alone, in 64-row tiles. Two threads and more than 2^18 (row, key, head)
# triples (the kernel's inline limit): OpenMP threads share 16-row tiles.
@pytest.mark.parametrize(("threads", "num_rows", "pages"), [(1, 150, 40), (2, 400, 64)])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 24])
def test_paged_attention_kernel_many_rows_per_user(head_dim, threads, num_rows, pages):
    """More rows of one user than a tile holds, with causal and candidate rows mixed, reading more
    keys than a block holds (256 at head size 32), counts of every remainder."""
    g = torch.Generator().manual_seed(6)
    page_size, heads = 16, 2
    cache = torch.randn(pages + 8, 2, page_size, heads, head_dim, generator=g)
    page_table = torch.randperm(pages + 8, generator=g)[:pages].view(1, pages)
    row_user = torch.zeros(num_rows, dtype=torch.int64)
    row_keys = torch.randint(0, pages * page_size + 1, (num_rows,), generator=g)
    row_candidate = torch.rand(num_rows, generator=g) < 0.4
    q, k, v = (torch.randn(num_rows, heads, head_dim, generator=g) for _ in range(3))
    inputs = (q, k, v, cache, page_table, row_user, row_keys, row_candidate)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kv.hstu_paged_attention(*inputs, ALPHA, INV_S)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, reference_paged_attention(*inputs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["slices", "transposed"])
def test_paged_attention_kernel_reads_strided_rows(layout):
    """q, k, v read in place whatever the stride between rows (a copy only when a row is not
    contiguous): the same result as contiguous inputs, and the output contiguous."""
    q, k, v, *rest = random_paged_inputs(8, head_dim=32)
    strided = [strided_like(t, layout) for t in (q, k, v)]
    assert layout != "slices" or strided[0].stride(0) == 4 * 2 * 32
    got = kv.hstu_paged_attention(*strided, *rest, ALPHA, INV_S)
    assert got.is_contiguous()
    torch.testing.assert_close(got, reference_paged_attention(q, k, v, *rest), rtol=1e-5, atol=1e-5)


def test_paged_attention_kernel_rejects_pages_outside_the_cache():
    q, k, v, cache, page_table, row_user, row_keys, row_candidate = random_paged_inputs(7)
    page_table[1, 2] = 8
    with pytest.raises(RuntimeError, match="page 8 outside 0..7"):
        kv.hstu_paged_attention(q, k, v, cache, page_table, row_user, row_keys, row_candidate, ALPHA, INV_S)


def test_paged_attention_kernel_matches_reference():
    inputs = random_paged_inputs(0)
    got = kv.hstu_paged_attention(*inputs, ALPHA, INV_S)
    torch.testing.assert_close(got, reference_paged_attention(*inputs), rtol=1e-5, atol=1e-6)


def test_paged_attention_kernel_bfloat16():
    inputs = random_paged_inputs(1, torch.bfloat16)
    got = kv.hstu_paged_attention(*inputs, ALPHA, INV_S)
    want = reference_paged_attention(*(t.float() if t.is_floating_point() else t for t in inputs))
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_paged_attention_kernel_rejects_reads_past_the_page_table():
    q, k, v, cache, page_table, row_user, row_keys, row_candidate = random_paged_inputs(2)
    row_keys[0] = 13
    with pytest.raises(RuntimeError, match="row 0 reads 13 keys, the page table holds 12"):
        kv.hstu_paged_attention(q, k, v, cache, page_table, row_user, row_keys, row_candidate, ALPHA, INV_S)


def test_opcheck_hstu_paged_attention():
    library.load()
    torch.library.opcheck(torch.ops.kvexport.hstu_paged_attention.default, (*random_paged_inputs(3), ALPHA, INV_S))


CONFIG = json.dumps(
    {
        "num_layers": 1,
        "num_heads": 2,
        "head_dim": 8,
        "page_size": 4,
        "device_pages": 16,
        "host_pages": 16,
        "dtype": "float32",
    }
)


@pytest.fixture
def runtime():
    with scratch_runtime(CONFIG) as name:
        yield name


def batch_inputs():
    user_ids = torch.tensor([3, 4])
    token_ids = torch.arange(7)
    token_lengths = torch.tensor([4, 3])
    num_candidates = torch.tensor([2, 1])
    return user_ids, token_ids, token_lengths, num_candidates


@pytest.mark.parametrize("layout", ["contiguous", "slices", "transposed"])
def test_stateful_ops_match_reference_attention(runtime, layout):
    """paged_attention over the runtime's cache == dense HSTU attention over prefix + candidate,
    whatever the layout of q, k, v (prefix rows read the k/v just stored from them)."""
    user_ids, token_ids, token_lengths, num_candidates = batch_inputs()
    g = torch.Generator().manual_seed(0)
    rows = 3 + 7  # candidates first, then every prefix token (cold cache)
    q, k, v = (torch.randn(rows, 2, 8, generator=g) for _ in range(3))
    new = kv.begin_batch(runtime, CONFIG, user_ids, token_ids, token_lengths, num_candidates, host_placement())
    assert new.index.tolist() == list(range(7))  # a cold cache: every token is new
    assert new.positions.tolist() == [0, 1, 2, 3, 0, 1, 2]
    got = kv.paged_attention(runtime, 0, *(strided_like(t, layout) for t in (q, k, v)), ALPHA, INV_S)
    kv.end_batch(runtime, user_ids, got)
    # Dense reference: user 0 = prefix rows 3..6 + candidates 0, 1; user 1 = prefix rows 7..9 + candidate 2.
    for prefix_rows, candidate_rows in (([3, 4, 5, 6], [0, 1]), ([7, 8, 9], [2])):
        for i, r in enumerate(prefix_rows):
            keys = prefix_rows[: i + 1]
            w = nn.functional.silu(ALPHA * torch.einsum("hd,nhd->nh", q[r], k[keys])) * INV_S
            torch.testing.assert_close(got[r], torch.einsum("nh,nhd->hd", w, v[keys]), rtol=1e-5, atol=1e-6)
        for r in candidate_rows:
            keys = prefix_rows + [r]
            w = nn.functional.silu(ALPHA * torch.einsum("hd,nhd->nh", q[r], k[keys])) * INV_S
            torch.testing.assert_close(got[r], torch.einsum("nh,nhd->hd", w, v[keys]), rtol=1e-5, atol=1e-6)


def test_upload_on_the_host_copies_and_checks(runtime):
    """upload with a host placement returns contiguous copies (never the inputs), and refuses what is
    not an int64 host tensor as an internal error, released like any failing op of a request."""
    host = [torch.arange(4), torch.arange(6).view(2, 3).t()]
    copies = kv.upload(runtime, host, host_placement())
    for before, after in zip(host, copies):
        assert torch.equal(after, before) and after.is_contiguous()
        assert after.untyped_storage().data_ptr() != before.untyped_storage().data_ptr()
    with pytest.raises(RuntimeError, match="upload takes int64 host tensors, got float32 on cpu"):
        kv.upload(runtime, [torch.zeros(2)], host_placement())
    assert kv.last_error(runtime)[0] == "internal"


LIMITS = json.dumps(
    {
        "max_batch_size": 4,
        "max_history_length": 8,
        "max_num_candidates": 4,
        "num_contextual_features": 2,
        "context_vocab_size": 10,
        "item_vocab_size": 300,
        "action_vocab_size": 300,
        "tokens_per_event": 2,
        "context_width": 2,
        "time_code_bits": 0,
    }
)


def layout_request():
    """Three users (3, 0 and 2 events), two context ids each, one candidate each."""
    return (
        torch.tensor([7, 8, 9]),
        torch.tensor([3, 0, 2]),
        torch.arange(5) + 100,
        torch.arange(5) + 200,
        torch.arange(6).view(3, 2),
        torch.tensor([1, 1, 1]),
        torch.tensor([5, 6, 7]),
    )


def test_check_request_lays_out_the_models_prefix_tokens(runtime):
    """check_request's token_ids == the model's tensor layout (prefix_tokens), for users with and
    without history; its token_lengths are C + 2h; what it returns are copies, not the caller's."""
    from kvexport.model.hstu import prefix_tokens

    request = layout_request()
    user_ids, history_lengths, item_ids, action_ids, context_ids, num_candidates, candidate_ids = request
    got = kv.check_request(runtime, LIMITS, *request)
    expected = prefix_tokens(history_lengths, item_ids, action_ids, context_ids)
    assert got[2].tolist() == expected.token_ids.tolist()
    assert got[2][:8].tolist() == [0, 1, 100, 200, 101, 201, 102, 202]
    assert got[1].tolist() == expected.token_lengths.tolist() == [8, 2, 6]
    for out, given in zip((got[0], got[3], got[4]), (user_ids, num_candidates, candidate_ids), strict=True):
        assert out.tolist() == given.tolist()
        assert out.data_ptr() != given.data_ptr()
    assert kv.last_error(runtime) == ("ok", "")


COMBINED_LIMITS = json.dumps(
    {**json.loads(LIMITS), "action_vocab_size": 5, "combined_action_bits": 3, "tokens_per_event": 1}
)


def test_check_request_lays_out_combined_event_tokens(runtime):
    """model.event_tokens combined: one token (item << bits) | action an event, C + h tokens a user,
    the model's layout; an action id the bits cannot hold is refused like any other."""
    from kvexport.model.hstu import prefix_tokens

    request = list(layout_request())
    request[3] = torch.tensor([0, 4, 1, 3, 2])
    got = kv.check_request(runtime, COMBINED_LIMITS, *request)
    expected = prefix_tokens(request[1], request[2], request[3], request[4], action_bits=3)
    assert got[2].tolist() == expected.token_ids.tolist()
    assert got[2][:5].tolist() == [0, 1, 100 << 3, (101 << 3) | 4, (102 << 3) | 1]
    assert got[1].tolist() == expected.token_lengths.tolist() == [5, 2, 4]
    torch.library.opcheck(torch.ops.kvexport.check_request.default, (runtime, COMBINED_LIMITS, *request))
    request[3] = torch.tensor([0, 4, 1, 5, 2])
    with pytest.raises(ValueError, match=r"^action_ids has 5, outside the action vocabulary \[0, 4\]"):
        kv.check_request(runtime, COMBINED_LIMITS, *request)
    # Limits whose items would overflow the shift are refused, whoever wrote them.
    overflowing = json.dumps({**json.loads(COMBINED_LIMITS), "item_vocab_size": 2**61})
    with pytest.raises(RuntimeError, match="items do not fit a token of combined_action_bits 3"):
        kv.check_request(runtime, overflowing, *request)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"tokens_per_event": 2}, "tokens_per_event 2 and context_width 2 do not fit"),
        ({"context_width": 3}, "tokens_per_event 1 and context_width 3 do not fit"),
        (
            {"query_time_periods": [[3600, 24]], "context_width": 3, "time_code_bits": 4},
            "time_code_bits 4 cannot hold 24 query time codes",
        ),
        ({"time_code_bits": 2}, "time_code_bits 2 cannot hold 1 query time codes"),
        ({"context_width": None}, "request limits lack context_width: the package was built by an older kvexport"),
    ],
)
def test_limits_whose_derived_sizes_disagree_are_refused(runtime, change, message):
    """The token layout's sizes come from kvexport.config; the op library lays out and shifts by them
    only when they fit the event tokens, context features and query time periods they describe."""
    request = list(layout_request())
    request[3] = torch.tensor([0, 4, 1, 3, 2])
    limits = {**json.loads(COMBINED_LIMITS), **change}
    limits = json.dumps({key: value for key, value in limits.items() if value is not None})
    with pytest.raises(RuntimeError, match=message):
        kv.check_request(runtime, limits, *request)


@pytest.mark.parametrize(
    "item,action,expected",
    [
        (-1, 0, r"^item_ids has -1, outside the item vocabulary \[0, 299\]"),
        (300, 0, r"^item_ids has 300, outside the item vocabulary \[0, 299\]"),
        (0, -5, r"^action_ids has -5, outside the action vocabulary \[0, 299\]"),
        (0, 2**63 - 1, r"^action_ids has 9223372036854775807, outside the action vocabulary \[0, 299\]"),
    ],
)
def test_check_request_names_a_bad_event_in_one_line(runtime, item, action, expected):
    """Events are checked while they are laid out; the refusal names the bad value in one line."""
    request = list(layout_request())
    request[2], request[3] = request[2].clone(), request[3].clone()
    request[2][4], request[3][4] = item, action
    with pytest.raises(ValueError, match=expected):
        kv.check_request(runtime, LIMITS, *request)
    assert kv.last_error(runtime)[0] == "invalid_request"


def test_check_request_names_items_before_actions_wherever_they_lie(runtime):
    """A bad action early and a bad item late: the item is named, as the checks' order says (the
    layout meets the action first)."""
    request = list(layout_request())
    request[2], request[3] = request[2].clone(), request[3].clone()
    request[3][0], request[2][4] = 999, 777
    with pytest.raises(ValueError, match=r"^item_ids has 777, outside the item vocabulary"):
        kv.check_request(runtime, LIMITS, *request)


def test_check_request_refuses_inconsistent_jagged_sizes(runtime):
    request = list(layout_request())
    request[1] = torch.tensor([3, 0, 1])
    with pytest.raises(ValueError, match="^history_lengths sum to 4 but item_ids has 5 entries"):
        kv.check_request(runtime, LIMITS, *request)


def test_opcheck_check_request(runtime):
    torch.library.opcheck(torch.ops.kvexport.check_request.default, (runtime, LIMITS, *layout_request()))


def test_opcheck_upload(runtime):
    torch.library.opcheck(
        torch.ops.kvexport.upload.default,
        (runtime, [torch.arange(4), torch.arange(6).view(2, 3).t()], host_placement()),
    )


def _in_batch(runtime, rows):
    user_ids, token_ids, token_lengths, num_candidates = batch_inputs()
    kv.begin_batch(runtime, CONFIG, user_ids, token_ids, token_lengths, num_candidates, host_placement())
    return torch.randn(rows, 2, 8)


def test_opcheck_begin_batch(runtime):
    torch.library.opcheck(torch.ops.kvexport.begin_batch.default, (runtime, CONFIG, *batch_inputs(), host_placement()))


def test_opcheck_paged_attention(runtime):
    x = _in_batch(runtime, 10)
    torch.library.opcheck(torch.ops.kvexport.paged_attention.default, (runtime, 0, x, x, x, ALPHA, INV_S))


def test_opcheck_end_batch(runtime):
    user_ids = batch_inputs()[0]
    _in_batch(runtime, 10)
    # end_batch commits once per begin_batch and fails without one, so only its schema is checked
    # here (test_schema runs it once); the commit itself is checked by the runtime tests.
    torch.library.opcheck(
        torch.ops.kvexport.end_batch.default, (runtime, user_ids, torch.zeros(3, 4)), test_utils=("test_schema",)
    )


def test_stateful_ops_survive_export_and_decompositions(tiny_config, tiny_model):
    """The cached model's graph keeps check_request, begin_batch, every layer's attention, and end_batch."""
    from kvexport.export.wrap import CachedRanker, export_cached

    ep = export_cached(CachedRanker(tiny_model, "export-survival"), tiny_config).run_decompositions()
    called = [str(node.args[1]) for node in ep.graph.nodes if "with_effects" in str(node.target)]
    layers = tiny_config.model.num_layers
    assert called.count("kvexport.begin_batch.default") == 1
    assert called.count("kvexport.paged_attention.default") == layers
    assert called.count("kvexport.end_batch.default") == 1
    checks = [n for n in ep.graph.nodes if str(n.target) == "kvexport.check_request.default"]
    assert len(checks) == 1


def test_hstu_paged_attention_survives_export():
    class Attend(nn.Module):
        def forward(self, q, k, v, cache, page_table, row_user, row_keys, row_candidate):
            return kv.hstu_paged_attention(q, k, v, cache, page_table, row_user, row_keys, row_candidate, ALPHA, INV_S)

    ep = torch.export.export(Attend(), random_paged_inputs(4)).run_decompositions()
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert "kvexport.hstu_paged_attention.default" in targets
    torch.testing.assert_close(ep.module()(*random_paged_inputs(4)), Attend()(*random_paged_inputs(4)))


@pytest.mark.parametrize(
    "op,args",
    [
        ("runtime_stats", ()),
        ("device_users_lru", ()),
        ("cached_length", (3,)),
        ("evict_user", (99,)),
        ("reset_runtime", ()),
        ("create_runtime", (CONFIG, torch.device("cpu"))),
    ],
)
def test_opcheck_management_ops(runtime, op, args):
    """Eager-only ops (never in a graph): their schemas must declare no hidden mutation of inputs."""
    library.load()
    torch.library.opcheck(getattr(torch.ops.kvexport, op).default, (runtime, *args), test_utils=("test_schema",))


def test_opcheck_read_user_kv_and_drop(runtime):
    _in_batch(runtime, 10)
    x = torch.randn(10, 2, 8)
    kv.paged_attention(runtime, 0, x, x, x, ALPHA, INV_S)
    kv.end_batch(runtime, batch_inputs()[0], x)
    torch.library.opcheck(torch.ops.kvexport.read_user_kv.default, (runtime, 3), test_utils=("test_schema",))
    assert torch.equal(kv.read_user_kv(runtime, 3)[0, 0], x[3:7])  # user 3's prefix rows follow 3 candidates
    other = runtime + "-dropped"
    kv.create_runtime(other, CONFIG)
    torch.library.opcheck(torch.ops.kvexport.drop_runtime.default, (other,), test_utils=("test_schema",))
    assert kv.drop_runtime(other) is False  # opcheck already dropped it


def test_the_op_list_is_the_librarys():
    """library.OPS (checked when a library is loaded) is exactly what register.cpp defines; each op
    has its typed wrapper in wrappers.py, and each one a graph may hold its fake beside it."""
    import re

    defined = re.findall(r'm\.def\(\s*"(\w+)\(', (ROOT / "csrc" / "ops" / "register.cpp").read_text())
    assert list(library.OPS) == defined
    assert all(callable(getattr(kv, name, None)) for name in library.OPS)
    # last_error, stat_names and redact_url answer the host in strings: no graph holds them, so no fake.
    assert library.faked_ops() == [
        name for name in library.OPS if name not in ("last_error", "stat_names", "redact_url")
    ]
    library.load()
    assert all(hasattr(torch.ops.kvexport, name) for name in library.OPS)


def test_check_request_lays_out_requests_of_many_events_on_several_threads_exactly():
    """Four users of 4,100 events (more than the 2^15 tokens a request needs to be laid out on the
    OpenMP threads): the tokens are each user's context ids, then its item and action ids
    interleaved, users in order; a bad id in the last user is still named."""
    config = load_config(ROOT / "configs" / "hstu-bench.yaml")
    batch = random_batch(
        config.model, seed=11, history_lengths=[4100, 4090, 4100, 4095], num_candidates=[2] * 4, first_user_id=60
    )
    _, lengths, tokens, _, _ = kv.check_request("", config.request_limits_json(), *batch.tensors())
    expected, first = [], 0
    for b, events in enumerate(batch.history_lengths.tolist()):
        items, actions = batch.item_ids[first : first + events], batch.action_ids[first : first + events]
        expected += [*batch.context_ids[b].tolist(), *torch.stack([items, actions], dim=1).flatten().tolist()]
        first += events
    assert tokens.tolist() == expected and len(expected) > 2**15
    assert lengths.tolist() == [config.model.num_contextual_features + 2 * e for e in batch.history_lengths.tolist()]
    bad = batch.to_dict()
    bad["action_ids"] = bad["action_ids"].clone()
    bad["action_ids"][-3] = config.model.action_vocab_size
    with pytest.raises(ValueError, match=f"action_ids has {config.model.action_vocab_size}, outside"):
        kv.check_request("", config.request_limits_json(), *Batch(**bad).tensors())


def test_paged_attention_refuses_k_v_of_another_shape_before_storing(runtime):
    """k/v rows that do not match the cache's [heads, head_dim] are refused before any row is
    stored (a row copy of the wrong width would read past them)."""
    user_ids, token_ids, token_lengths, num_candidates = batch_inputs()
    kv.begin_batch(runtime, CONFIG, user_ids, token_ids, token_lengths, num_candidates, host_placement())
    q = torch.randn(10, 2, 8)
    expected = r"cannot store rows of shape \[7, 2, 4\] at \[7\] slots of a cache of rows \[136, 2, 8\]"
    with pytest.raises(RuntimeError, match=expected):
        kv.paged_attention(runtime, 0, q, torch.randn(10, 2, 4), torch.randn(10, 2, 4), ALPHA, INV_S)
