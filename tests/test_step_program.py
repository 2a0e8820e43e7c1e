"""The step program (step.pt2, docs/design.md 3.9): the request's device part, which kvexport's
hosts run on its own after planning the request on the host, on a GPU as CUDA graphs captured per
bucket. Every output is compared with the eager model's full recompute (no cache, no padding)."""

from __future__ import annotations

import json
import subprocess
import threading

import pytest
import torch

import kvexport
from kvexport.bench.suite import SweepRequests
from kvexport.commands.describe import describe
from kvexport.errors import RequestFailed
from kvexport.host import step_runner
from kvexport.model import build_model
from kvexport.model.batch import Batch, UserRequest, random_batch, random_user
from kvexport.ops import wrappers as kv
from kvexport.trace.replay import replay_command

ATOL = 1e-5  # float32: padded and unpadded rows run the same kernels row by row


@pytest.fixture(scope="session")
def reference(tiny_config, tiny_checkpoint):
    """The eager model's full recompute (no cache) with the artifacts' weights."""
    model = build_model(tiny_config, tiny_checkpoint).eval()

    def recompute(batch):
        with torch.no_grad():
            return model(batch)

    return recompute


def test_build_writes_the_step_program_only_when_asked(step_artifact, tiny_artifact, tiny_config):
    manifest = json.loads((step_artifact / "manifest.json").read_text())
    layers = tiny_config.model.num_layers
    assert manifest["step_program"]["package_ops"] == {"kvexport::paged_attention_step": layers}
    assert "step.pt2" in manifest["files"]
    plain = json.loads((tiny_artifact / "manifest.json").read_text())
    assert "step_program" not in plain and not (tiny_artifact / "step.pt2").exists()
    assert describe(step_artifact)["step_program"] == manifest["step_program"]  # kvexport inspect
    assert describe(tiny_artifact)["step_program"] is None


def test_step_route_matches_the_full_recompute_through_eviction(step_artifact, tiny_config, reference):
    config = tiny_config
    sweeps = [
        SweepRequests(config, 60 + 9 * i, 1, first_user=500 + i, new_events=3, candidates=2 + i % 5) for i in range(10)
    ]
    with kvexport.load(step_artifact) as package:
        for r in range(3):
            for sweep in sweeps:  # ten users of 60-141 events: more than the device tier holds
                batch = sweep.variant(r)
                torch.testing.assert_close(package.score(batch), reference(batch), atol=ATOL, rtol=0)
        stats = package.stats()
    assert stats["hit_tokens"] > 0 and stats["offloads"] > 0 and stats["onboards"] > 0


TILE_ROWS = 192  # the attention kernels' tile: rows of one user at most (kAttentionTileRows)


def assert_rows_tiled_by_user(plan, layout, real_prefix: int) -> None:
    """row_order holds the real rows grouped by user, in row order within a user, then the padding
    rows; tiles cut each user's rows into runs of at most TILE_ROWS, then zeros."""
    row_user, rows = plan.row_user.tolist(), layout.candidate_rows + layout.prefix_rows
    real = [
        i
        for i in range(rows)
        if (i < layout.real_candidates if i < layout.candidate_rows else i - layout.candidate_rows < real_prefix)
    ]
    padding = sorted(set(range(rows)) - set(real))
    assert plan.row_order.tolist() == sorted(real, key=lambda i: row_user[i]) + padding
    tiles, first = [], 0
    for user in sorted({row_user[i] for i in real}):
        count = sum(1 for i in real if row_user[i] == user)
        tiles += [[user, first + start, min(TILE_ROWS, count - start)] for start in range(0, count, TILE_ROWS)]
        first += count
    assert plan.tiles[: len(tiles)].tolist() == tiles and not plan.tiles[len(tiles) :].any()


def test_buckets_pad_each_part_by_at_most_a_quarter(step_artifact, tiny_config, reference):
    """Batches of 1-4 users and 1-64 candidates: each part's bucket holds the batch, is at least
    16 rows, and has at most a quarter of padding above that; every output is exact."""
    seen = set()
    with kvexport.load(step_artifact) as package:
        for i, (users, candidates, events) in enumerate([(1, 1, 1), (1, 17, 9), (2, 33, 40), (3, 64, 70), (4, 50, 96)]):
            batch = random_batch(
                tiny_config.model,
                seed=i,
                history_lengths=[events] * users,
                num_candidates=[candidates] * users,
                first_user_id=1000 * (i + 1),
            )
            user_ids, lengths, token_ids, num_candidates, candidate_ids = kv.check_request(
                "", tiny_config.request_limits_json(), *batch.tensors()
            )
            name = f"bucket-probe-{i}"
            staged, layout = kv.begin_step(
                name,
                tiny_config.runtime_json(),
                user_ids,
                token_ids,
                lengths,
                num_candidates,
                candidate_ids,
                torch.empty(0),
                tiny_config.model.max_prefix_length,
            )
            kv.abort_batch(name)
            kv.drop_runtime(name)
            assert staged.numel() == layout.numel()
            inputs, plan = layout.split(staged)
            # Every input on a 16-byte boundary (AOTInductor would copy one that is not, every run),
            # and the parts are the batch's: the first of them its candidates, the page table its users'.
            assert all(part.data_ptr() % 16 == 0 for part in (*inputs, *plan))
            assert torch.equal(inputs.candidate_ids[: users * candidates], candidate_ids)
            assert plan.page_table.shape == (layout.users, layout.pages_per_user)
            assert_rows_tiled_by_user(plan, layout, real_prefix=int(lengths.sum()))
            real_prefix = int(lengths.sum())  # an empty cache: every prefix token is new
            for padded, real in ((layout.candidate_rows, users * candidates), (layout.prefix_rows, real_prefix)):
                assert real <= padded <= max(16, real * 5 // 4 + 1)
            assert layout.real_candidates == users * candidates and users <= layout.users <= 2 * users
            seen.add(layout.bucket)
            torch.testing.assert_close(package.score(batch), reference(batch), atol=ATOL, rtol=0)
    assert len(seen) == 5


def test_step_plan_rebuilt_row_by_row_from_the_request(tiny_config):
    """begin_step's parts for users who reuse part of a cached prefix (grown histories), a user with
    an unchanged history (candidates only) and a new user, against the plan rebuilt in Python from
    the request's tokens and what the first request cached."""
    m, page_size = tiny_config.model, tiny_config.kv_cache.page_size
    name, limits, runtime = "plan-rows-probe", tiny_config.request_limits_json(), tiny_config.runtime_json()
    g = torch.Generator().manual_seed(3)
    first = [
        random_user(m, g, 70 + i, events, candidates)
        for i, (events, candidates) in enumerate([(10, 2), (3, 5), (20, 1)])
    ]

    def begin(users):
        user_ids, lengths, token_ids, num_candidates, candidate_ids = kv.check_request(
            name, limits, *Batch.concat(users).tensors()
        )
        staged, layout = kv.begin_step(
            name,
            runtime,
            user_ids,
            token_ids,
            lengths,
            num_candidates,
            candidate_ids,
            torch.empty(0),
            m.max_prefix_length,
        )
        return user_ids, lengths.tolist(), token_ids.tolist(), candidate_ids, staged, layout

    try:
        user_ids, cached, *_ = begin(first)
        kv.end_batch(name, user_ids, torch.empty(0))  # commits the three users' prefixes
        grown = [
            UserRequest(
                u.user_id,
                torch.cat([u.item_ids, random_user(m, g, 0, extra, 1).item_ids]),
                torch.cat([u.action_ids, random_user(m, g, 0, extra, 1).action_ids]),
                u.context_ids,
                random_user(m, g, 0, 1, candidates).candidate_ids,
            )
            for u, extra, candidates in zip(first, (4, 0, 9), (3, 2, 6))
        ]
        users = [grown[2], random_user(m, g, 99, 7, 4), grown[0], grown[1]]
        cached = [cached[2], 0, cached[0], cached[1]]
        _, lengths, tokens, candidate_ids, staged, layout = begin(users)
        kv.abort_batch(name)
    finally:
        kv.drop_runtime(name)
    inputs, plan = layout.split(staged)
    counts = [len(u.candidate_ids) for u in users]
    starts = [sum(lengths[:b]) for b in range(len(users))]
    tp, trash = layout.candidate_rows, tiny_config.kv_cache.device_pages * 2 * page_size
    pages = plan.page_table.tolist()
    rows = [(b, lengths[b], 1) for b in range(len(users)) for _ in range(counts[b])]
    rows += [(0, 0, 0)] * (tp - len(rows))
    new = [(b, p) for b in range(len(users)) for p in range(cached[b], lengths[b])]
    rows += [(b, p + 1, 0) for b, p in new] + [(0, 0, 0)] * (layout.prefix_rows - len(new))
    slots = [pages[b][p // page_size] * 2 * page_size + p % page_size for b, p in new]
    padding = [0] * (layout.prefix_rows - len(new))

    assert layout.real_candidates == sum(counts) and len(new) == sum(lengths) - sum(cached) > 0
    assert inputs.candidate_ids[: sum(counts)].tolist() == candidate_ids.tolist()
    assert inputs.candidate_positions.tolist() == [lengths[b] for b, _, c in rows[:tp] if c] + [0] * (tp - sum(counts))
    assert inputs.new_ids.tolist() == [tokens[starts[b] + p] for b, p in new] + padding
    assert inputs.new_positions.tolist() == [p for _, p in new] + padding
    assert list(zip(plan.row_user.tolist(), plan.row_keys.tolist(), plan.row_candidate.tolist())) == rows
    assert plan.write_slots.tolist() == slots + [trash] * len(padding)
    assert plan.value_slots.tolist() == [s + page_size for s in slots] + [trash + page_size] * len(padding)
    owned = [page for b in range(len(users)) for page in pages[b][: -(-lengths[b] // page_size)]]
    assert len(set(owned)) == len(owned)  # no page is two users'
    assert not any(page for b in range(len(users)) for page in pages[b][-(-lengths[b] // page_size) :])
    assert_rows_tiled_by_user(plan, layout, real_prefix=len(new))


def test_refusals_through_the_step_route_leave_the_next_request_exact(step_artifact, tiny_config, reference):
    config = tiny_config
    good = random_batch(config.model, seed=4, history_lengths=[20], num_candidates=[3], first_user_id=77)
    bad = good.to_dict()
    bad["item_ids"] = bad["item_ids"].clone()
    bad["item_ids"][0] = -1
    too_long = random_batch(
        config.model,
        seed=5,
        history_lengths=[config.model.max_history_length] * 2,
        num_candidates=[1, 1],
        first_user_id=900,
    )
    with kvexport.load(step_artifact) as package:
        with pytest.raises(RequestFailed) as refused:
            package.run(type(good)(**bad))
        assert refused.value.code == "invalid_request" and "item_ids has -1" in str(refused.value)
        with pytest.raises(RequestFailed) as full:
            package.run(too_long)
        assert full.value.code == "capacity_exceeded" and "device pages" in str(full.value)
        torch.testing.assert_close(package.score(good), reference(good), atol=ATOL, rtol=0)


def _eight_threads(package, config, first_user: int, reference) -> list[str]:
    """Eight threads score their own users through one package, five rounds each; the requests
    that differ from the full recompute."""
    sweeps = [
        SweepRequests(config, 30 + 5 * i, 1, first_user=first_user + i, new_events=2, candidates=3) for i in range(8)
    ]
    failures: list[str] = []

    def client(sweep):
        for r in range(5):
            batch = sweep.variant(r)
            if not torch.allclose(package.score(batch).cpu(), reference(batch), atol=ATOL, rtol=0):
                failures.append(f"user {sweep.users[0].user_id} round {r}")

    threads = [threading.Thread(target=client, args=(s,)) for s in sweeps]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failures


def test_eight_threads_score_their_own_users(step_artifact, tiny_config, reference):
    with kvexport.load(step_artifact) as package:
        assert _eight_threads(package, tiny_config, 2000, reference) == []


def test_the_harness_replays_the_trace_through_the_step_program(step_artifact, tiny_artifact, tmp_path):
    """The C++ harness plans each request itself and runs step.pt2 (two threads): every step as
    recorded; an artifact without step.pt2 is refused in one line."""
    report = tmp_path / "replay.json"
    result = subprocess.run(
        replay_command(step_artifact, report, threads=2, route="step"), capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(report.read_text())["passed"]
    plain = subprocess.run(replay_command(tiny_artifact, route="step"), capture_output=True, text=True, timeout=600)
    assert plain.returncode == 2
    assert plain.stderr == (
        "error: --route step needs an artifact with a step program (step.pt2): build it with --step-program\n"
    )


# -- on a GPU: the same route replayed as CUDA graphs --------------------------------------------


def on_gpu(test):
    """Marks a test as a GPU one (pytest -m cuda), skipped without a CUDA device."""
    for mark in (
        pytest.mark.cuda,
        pytest.mark.slow,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ):
        test = mark(test)
    return test


def _score_rounds(package, sweeps, rounds: int, reference) -> None:
    for r in range(rounds):
        for sweep in sweeps:
            batch = sweep.variant(r)
            torch.testing.assert_close(package.score(batch).cpu(), reference(batch), atol=ATOL, rtol=0)


@on_gpu
def test_graphs_replay_exactly_through_eviction(cuda_artifact, tiny_config, reference):
    sweeps = [
        SweepRequests(tiny_config, 60 + 9 * i, 1, first_user=3000 + i, new_events=3, candidates=4) for i in range(10)
    ]
    with kvexport.load(cuda_artifact) as package:
        _score_rounds(package, sweeps, 4, reference)
        assert package.cuda_graphs >= 1
        stats = package.stats()
    assert stats["offloads"] > 0 and stats["onboards"] > 0


@on_gpu
def test_graphs_kept_are_bounded_and_large_buckets_run_without_one(cuda_artifact, tiny_config, reference, monkeypatch):
    monkeypatch.setattr(step_runner, "MAX_GRAPHS", 2)
    monkeypatch.setattr(step_runner, "MAX_GRAPH_ROWS", 48)
    sweeps = [
        SweepRequests(tiny_config, 20 + 40 * i, 1, first_user=4000 + i, new_events=2 + 6 * i, candidates=3)
        for i in range(4)
    ]
    with kvexport.load(cuda_artifact) as package:
        _score_rounds(package, sweeps, 3, reference)
        assert 1 <= package.cuda_graphs <= 2


@on_gpu
def test_graphs_from_eight_threads(cuda_artifact, tiny_config, reference):
    with kvexport.load(cuda_artifact) as package:
        assert _eight_threads(package, tiny_config, 5000, reference) == []
        assert package.cuda_graphs >= 1


@on_gpu
def test_the_harness_replays_the_trace_through_cuda_graphs(cuda_artifact, tmp_path):
    report = tmp_path / "replay.json"
    result = subprocess.run(
        replay_command(cuda_artifact, report, threads=2, route="graphs"), capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(report.read_text())["passed"]
