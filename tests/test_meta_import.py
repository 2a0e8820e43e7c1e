"""`kvexport import-checkpoint --from meta` end to end: a DLRMv3 checkpoint in its trainer's layout
(tests/helpers/meta_fixture.py, sparse/ from 1 and 2 ranks) imported, then the eager model (full
recompute and cached), the built package (verify) and the C++ replay agree with the independent
DlrmHSTU reference (tests/helpers/meta_reference.py) under the per-user rules the import states."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from kvexport.artifact import TRACE_KEYS
from kvexport.cached import CachedRanker
from kvexport.commands.cli import main
from kvexport.config import FP8_PAGES, config_from_dict, load_config
from kvexport.importers import meta_dlrmv3 as meta
from kvexport.model import build_model
from kvexport.model.batch import SIGNATURE, Batch, random_batch
from kvexport.ops import wrappers as kv
from kvexport.ops.manager import KVCacheManager
from kvexport.options import MetaOptions
from kvexport.trace.ranking import measure_ranking
from kvexport.trace.record import FP8_MAX_RELATIVE_ERROR, unrounded_model
from kvexport.trace.workload import Workload, WorkloadSpec
from tests.helpers import ROOT
from tests.helpers.artifacts import assert_verifies_and_replays
from tests.helpers.meta_fixture import (
    BATCH,
    FEATURES,
    IMPORTABLE_SIZES,
    TABLE_ROWS,
    dense_state,
    tables,
    write_checkpoint,
)
from tests.helpers.meta_reference import Rules, dlrm_hstu_forward
from tests.helpers.network import free_port

SEED = 7
MAX_HISTORY, MAX_CANDIDATES = 12, 4
# The checkpoint does not hold contextual gates (a trainer config's contextual_feature_to_min_uih_length);
# kvexport imports none, so the reference runs without the fixture's.
UNGATED = dataclasses.replace(FEATURES, contextual_min_uih_lengths=())
# The per-user rules the import states: positions counted from the maximum history, history events at
# time row 0, the normaliser C + max history + max candidates.
RULES = Rules(
    positions="from_max", times="zero", normaliser="fixed", max_history=MAX_HISTORY, max_candidates=MAX_CANDIDATES
)
TOLERANCE = 2e-5


def import_args(source, output, *extra) -> list[str]:
    return [
        "import-checkpoint",
        "--from",
        "meta",
        str(source),
        "-o",
        str(output),
        "--num-heads",
        str(IMPORTABLE_SIZES.HEADS),
        "--max-history-length",
        str(MAX_HISTORY),
        "--max-candidates",
        str(MAX_CANDIDATES),
        "--contextual-features",
        ",".join(FEATURES.contextual_tables),
        *extra,
    ]


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def imported(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"meta-import-world{request.param}")
    write_checkpoint(out / "trainer", request.param, free_port(), seed=SEED, sizes=IMPORTABLE_SIZES)
    result = CliRunner().invoke(main, import_args(out / "trainer", out / "dlrm.pt"))
    assert result.exit_code == 0, result.output
    return out, result.output


def reference_with_missing_user(batch: Batch, config) -> torch.Tensor:
    """reference() with every user_id feature read as missing."""
    context = batch.context_ids.clone()
    context[:, 0] = TABLE_ROWS["user_id"]  # past the table: missing
    return reference(Batch(**{**batch.to_dict(), "context_ids": context}), config)


def reference(batch: Batch, config, rules: Rules = RULES) -> torch.Tensor:
    """DlrmHSTU's logits of a kvexport batch under `rules`; a context id past its table is a missing feature."""
    num_context = config.model.num_contextual_features
    users, event, candidate = [], 0, 0
    for b in range(batch.batch_size):
        h, t = int(batch.history_lengths[b]), int(batch.num_candidates[b])
        ids = batch.context_ids[b].tolist()
        users.append(
            {
                "contextual": [
                    c if c < TABLE_ROWS[table] else None
                    for c, table in zip(ids[:num_context], FEATURES.contextual_tables)
                ],
                "history": batch.item_ids[event : event + h].tolist(),
                "actions": batch.action_ids[event : event + h].tolist(),
                "timestamps": [0] * h,
                "candidates": batch.candidate_ids[candidate : candidate + t].tolist(),
                "query_time": ids[num_context],
            }
        )
        event, candidate = event + h, candidate + t
    return dlrm_hstu_forward(dense_state(SEED, sizes=IMPORTABLE_SIZES), tables(SEED), users, UNGATED, rules=rules)


def test_the_import_states_its_rules_and_writes_a_loadable_config(imported):
    out, output = imported
    assert "per-user rules" in output and f"attention normaliser {2 + MAX_HISTORY + MAX_CANDIDATES}" in output
    config = load_config(out / "dlrm.yaml")
    m = config.model
    assert (m.head, m.event_tokens, m.candidate_position, m.silu_on, m.layer_output) == (
        "item_tower",
        "combined",
        "shared_row",
        "u",
        "concat",
    )
    assert m.query_time_periods == ((3600, 24), (86400, 7)) and m.layer_norm_eps == 1e-6
    assert m.item_vocab_size == TABLE_ROWS["video_id"] and m.item_ids == "rows"


def test_eager_full_and_cached_match_the_reference(imported):
    out, _ = imported
    config = load_config(out / "dlrm.yaml")
    model = build_model(config, out / "dlrm.pt")
    spec = WorkloadSpec(
        num_users=6,
        min_history_length=1,
        max_history_length=MAX_HISTORY,
        max_new_events=3,
        num_candidates=MAX_CANDIDATES,
        rewrite_fraction=0.2,
    )
    workload = Workload(
        config.model, spec, seed=1, context_keys=[list(range(TABLE_ROWS[t])) for t in FEATURES.contextual_tables]
    )
    cache = KVCacheManager(config)
    cache.reset()
    try:
        with torch.no_grad():
            for step in range(12):
                batch = workload.next_batch(1 + step % 3)
                expected = reference(batch, config)
                torch.testing.assert_close(model(batch), expected, rtol=0, atol=TOLERANCE)
                torch.testing.assert_close(CachedRanker(model).run(batch), expected, rtol=0, atol=TOLERANCE)
        assert cache.stats()["hit_tokens"] > 0
    finally:
        cache.close()


def test_fp8_pages_of_the_imported_checkpoint_keep_the_invariant_within_the_bound(imported):
    """The imported checkpoint with kv_cache.dtype float8_e4m3: the cached path equals the full
    recompute (both over FP8-rounded prefix k/v), the rounding reaches the logits, and they stay
    within the build's FP8 bound of the trainer's own forward (unrounded)."""
    out, _ = imported
    raw = load_config(out / "dlrm.yaml").to_dict()
    config = config_from_dict({**raw, "kv_cache": {**raw["kv_cache"], "dtype": FP8_PAGES}})
    model = build_model(config, out / "dlrm.pt")
    spec = WorkloadSpec(4, min_history_length=4, max_history_length=MAX_HISTORY, max_new_events=3, num_candidates=4)
    context_keys = [list(range(TABLE_ROWS[t])) for t in FEATURES.contextual_tables]
    batch = Workload(config.model, spec, seed=2, context_keys=context_keys).next_batch(4)
    try:
        with torch.no_grad():
            full = model(batch)
            torch.testing.assert_close(CachedRanker(model, "meta-fp8").run(batch), full, rtol=0, atol=TOLERANCE)
            assert not torch.equal(full, unrounded_model(model)(batch))
    finally:
        kv.drop_runtime("meta-fp8")
    unrounded = reference(batch, config)
    assert float((full - unrounded).abs().max() / unrounded.abs().max()) < FP8_MAX_RELATIVE_ERROR
    # The build's ranking check on the trainer's checkpoint: FP8 pages keep its top 10 and AUC.
    measure_ranking(config, model, torch.device("cpu"), logging.getLogger(__name__)).check(config.name)


def noise(t: torch.Tensor) -> torch.Tensor:
    """t plus noise, not a constant: a constant added before a LayerNorm cancels."""
    return t + 0.1 * torch.randn(t.shape, generator=torch.Generator().manual_seed(1)).to(t.dtype)


def read_rows(tables: dict[str, torch.Tensor], key: str, rows: torch.Tensor | None) -> torch.Tensor:
    """meta_dlrmv3.fold's table reader over tables held in memory: the whole table, or those rows."""
    return tables[key] if rows is None else tables[key][rows]


def test_every_upstream_tensor_moves_the_imported_logits(imported):
    """Each dense tensor and table changed alone and folded again (meta_dlrmv3.fold, the import
    without its reader): the logits move, so the import drops nothing."""
    out, _ = imported
    config = load_config(out / "dlrm.yaml")
    batch = random_batch(config.model, seed=2, history_lengths=[MAX_HISTORY, 3], num_candidates=[2, 3])
    context = batch.context_ids.clone()
    context[:, :2] = torch.tensor([[3, 1], [9, 4]])  # known ids of both features
    batch = Batch(**{**batch.to_dict(), "context_ids": context})
    with torch.no_grad():
        base = build_model(config, out / "dlrm.pt")(batch)
    dense, by_name = dense_state(SEED, sizes=IMPORTABLE_SIZES), tables(SEED)
    options = MetaOptions(
        num_heads=IMPORTABLE_SIZES.HEADS,
        max_history_length=MAX_HISTORY,
        max_num_candidates=MAX_CANDIDATES,
        contextual_features=FEATURES.contextual_tables,
    )
    checked, unmoved = 0, []
    for key in [*dense, *by_name]:
        if key.startswith(meta.ADDITIONAL_MLP) or dense.get(key, torch.zeros(1)).dtype == torch.int64:
            continue  # unread without extra features; the action bits, an integer buffer
        if key in (meta.PERIOD_UNITS, meta.UNITS_PER_PERIOD):
            continue  # whole periods, read into the config (test_the_import_states_its_rules...)
        changed_dense = {**dense, **({key: noise(dense[key])} if key in dense else {})}
        sparse = {meta.SPARSE_TABLE.format(n): noise(t) if n == key else t for n, t in by_name.items()}
        imported_state = meta.fold(
            changed_dense,
            {k: tuple(t.shape) for k, t in sparse.items()},
            functools.partial(read_rows, sparse),
            options,
            "x",
        )
        model = build_model(config)
        model.load_state_dict(imported_state.state_dict)
        with torch.no_grad():
            unmoved += [key] if (model(batch) - base).abs().max() < 1e-6 else []
        checked += 1
    assert not unmoved and checked > 40, "\n".join(unmoved)


@pytest.mark.slow
def test_package_verify_and_cpp_replay_agree_with_the_reference(imported, tmp_path):
    """Built from the import: the trace's expected outputs (what verify and the C++ replay check the
    package against) equal the reference's on every recorded request, and both pass."""
    out, _ = imported
    if "world2" in str(out):
        pytest.skip("one world size builds a package; the import is the same (above)")
    package = tmp_path / "package"
    built = CliRunner().invoke(
        main, ["build", str(out / "dlrm.yaml"), "--checkpoint", str(out / "dlrm.pt"), "-o", str(package)]
    )
    assert built.exit_code == 0, built.output
    assert check_trace_against_the_reference(package, load_config(out / "dlrm.yaml")) >= 10
    for command in (["verify", str(package)], ["replay", str(package)]):
        result = CliRunner().invoke(main, command)
        assert result.exit_code == 0, result.output


def check_trace_against_the_reference(package: Path, config) -> int:
    """Asserts the trace's expected outputs equal the reference's on every recorded request; the
    number of steps checked."""
    manifest = json.loads((package / "manifest.json").read_text())
    steps = 0
    for step in manifest["trace"][TRACE_KEYS["steps"]]:
        if TRACE_KEYS["expect_error"] in step:
            continue
        recorded = torch.load(package / step[TRACE_KEYS["file"]], weights_only=True)
        expected = reference(Batch(*(recorded[name] for name in SIGNATURE)), config)
        for key in ("expected_cached", "expected_full"):
            torch.testing.assert_close(recorded[TRACE_KEYS[key]], expected, rtol=0, atol=TOLERANCE)
        steps += 1
    return steps


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_imported_model_on_the_gpu(imported, tmp_path):
    """The import built for CUDA (its step program too): the trace, recorded on the GPU, equals the
    reference; verify passes, and the C++ replay through the model and through CUDA graphs."""
    from kvexport.export.build import build_artifact

    out, _ = imported
    if "world2" in str(out):
        pytest.skip("one world size builds a package")
    package = build_artifact(out / "dlrm.yaml", tmp_path / "gpu", checkpoint=out / "dlrm.pt", device="cuda")
    assert check_trace_against_the_reference(package, load_config(out / "dlrm.yaml")) >= 10
    assert_verifies_and_replays(package, tmp_path)


@pytest.mark.parametrize(
    ("flags", "rules", "said"),
    [
        (["--history-time", "none"], {"times": "none"}, "no history time row"),
        (["--history-positions", "from_start"], {"positions": "from_start"}, "positions counted from the oldest event"),
    ],
    ids=["time-none", "positions-from-start"],
)
def test_the_other_history_rules_match_the_reference_under_them(imported, tmp_path, flags, rules, said):
    """The import's other per-user rules, each against the reference under the same rule."""
    out, _ = imported
    result = CliRunner().invoke(main, import_args(out / "trainer", tmp_path / "none.pt", *flags))
    assert result.exit_code == 0 and said in result.output, result.output
    config = load_config(tmp_path / "none.yaml")
    model = build_model(config, tmp_path / "none.pt")
    batch = random_batch(config.model, seed=4, history_lengths=[MAX_HISTORY - 2, 5], num_candidates=[3, 2])
    context = batch.context_ids.clone()
    context[:, :2] = torch.tensor([[3, 1], [9, 4]])
    batch = Batch(**{**batch.to_dict(), "context_ids": context})
    with torch.no_grad():
        got = model(batch)
        torch.testing.assert_close(
            got, reference(batch, config, dataclasses.replace(RULES, **rules)), rtol=0, atol=TOLERANCE
        )
        assert (got - reference(batch, config)).abs().max() > 1e-3  # the default rules' logits differ


def test_served_item_ids_import_only_their_rows(imported, tmp_path):
    out, _ = imported
    served = [39, 2, 17, 5, 17]
    (tmp_path / "items.txt").write_text("\n".join(map(str, served)) + "\n")
    result = CliRunner().invoke(
        main, import_args(out / "trainer", tmp_path / "served.pt", "--items", str(tmp_path / "items.txt"))
    )
    assert result.exit_code == 0, result.output
    config = load_config(tmp_path / "served.yaml")
    assert config.model.item_ids == "keys" and config.model.item_vocab_size == 5  # 4 ids and the unknown row
    model = build_model(config, tmp_path / "served.pt")
    users = Batch(
        user_ids=torch.tensor([1, 2]),
        history_lengths=torch.tensor([3, 2]),
        item_ids=torch.tensor([5, 17, 39, 2, 2]),
        action_ids=torch.tensor([1, 0, 7, 3, 4]),
        context_ids=torch.tensor([[3, 1, 1_650_000_000], [7, 2, 1_650_003_600]]),
        num_candidates=torch.tensor([2, 1]),
        candidate_ids=torch.tensor([17, 39, 5]),
    )
    with torch.no_grad():
        torch.testing.assert_close(model(users), reference(users, config), rtol=0, atol=TOLERANCE)


def test_served_context_ids_import_only_their_rows(imported, tmp_path):
    """--context-ids user_id=FILE reads only those users' rows; any other user id is a missing
    feature, as DlrmHSTU embeds one (the reference with that feature None)."""
    out, _ = imported
    (tmp_path / "users.txt").write_text("7\n3\n9\n")
    result = CliRunner().invoke(
        main, import_args(out / "trainer", tmp_path / "users.pt", "--context-ids", f"user_id={tmp_path / 'users.txt'}")
    )
    assert result.exit_code == 0 and "contextual feature user_id: 3 served ids read" in result.output, result.output
    config = load_config(tmp_path / "users.yaml")
    assert config.model.context_vocab_size == 3 + TABLE_ROWS["user_active_degree"] + 1
    model = build_model(config, tmp_path / "users.pt")
    batch = random_batch(config.model, seed=6, history_lengths=[4, 7], num_candidates=[2, 3])
    context = batch.context_ids.clone()
    context[:, :2] = torch.tensor([[3, 1], [5, 4]])  # user 5 was not imported
    batch = Batch(**{**batch.to_dict(), "context_ids": context})
    expected = reference(batch, config)  # user 5 reads as a missing feature only in the second user's row
    expected_missing = reference_with_missing_user(batch, config)
    with torch.no_grad():
        got = model(batch)
    torch.testing.assert_close(got[:2], expected[:2], rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(got[2:], expected_missing[2:], rtol=0, atol=TOLERANCE)
    assert (expected[2:] - expected_missing[2:]).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--contextual-features", "user_id"], "maps 2 contextual features; 1 named"),
        (["--item-table", "nope"], "sparse/ holds sparse_dict._embedding_collection.embeddings.video_id.weight"),
        (["--batch", "5"], "has no batch 5"),
        (
            ["--context-ids", "user_region=ids.txt"],
            "--context-ids names user_region, not one of the contextual features",
        ),
        (["--num-heads", "3"], "not a multiple of 3 heads"),
    ],
)
def test_unusable_imports_are_refused_by_name_and_write_nothing(imported, tmp_path, extra, message):
    out, _ = imported
    args = import_args(out / "trainer", tmp_path / "x.pt")
    for flag, value in zip(extra[::2], extra[1::2]):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert not list(tmp_path.iterdir())


def test_a_missing_dense_key_is_refused_before_any_table_is_read(imported, tmp_path, monkeypatch, caplog):
    out, _ = imported
    trainer = tmp_path / "trainer"
    shutil.copytree(out / "trainer", trainer)
    checkpoint = trainer / str(BATCH) / "non_sparse.ckpt"
    saved = torch.load(checkpoint, weights_only=False)
    missing = meta.COMBINER + "bias"
    del saved["dense_dict"][missing]
    torch.save(saved, checkpoint)
    tables_read = []
    monkeypatch.setattr(meta.dcp, "read_rows", lambda directory, key, rows: tables_read.append(key))
    monkeypatch.setattr(meta.dcp, "read_tensors", lambda directory, keys: tables_read.extend(keys))
    with caplog.at_level(logging.INFO):
        result = CliRunner().invoke(main, import_args(trainer, tmp_path / "x.pt"))
    assert result.exit_code == 2 and result.output.splitlines() == [f"error: checkpoint lacks {missing}"], result.output
    assert tables_read == [] and [r.getMessage() for r in caplog.records if r.getMessage().startswith("read ")] == []
    assert not (tmp_path / "x.pt").exists()


def test_dqk_unequal_to_dv_is_refused(tmp_path):
    write_checkpoint(tmp_path / "trainer", 1, free_port(), seed=SEED)  # DEFAULT_SIZES: dqk 3, dv 4
    result = CliRunner().invoke(main, import_args(tmp_path / "trainer", tmp_path / "x.pt"))
    assert result.exit_code == 2 and "q/k heads of another width than u/v's" in result.output, result.output
    assert not (tmp_path / "x.pt").exists()


@pytest.mark.parametrize("line", ["12x", "\u00b2", str(1 << 63), "-3"])
def test_an_item_id_file_line_that_is_no_id_is_refused_by_line(imported, tmp_path, line):
    out, _ = imported
    (tmp_path / "items.txt").write_text(f"4\n{line}\n")
    result = CliRunner().invoke(
        main, import_args(out / "trainer", tmp_path / "x.pt", "--items", str(tmp_path / "items.txt"))
    )
    assert result.exit_code == 2 and "items.txt line 2:" in result.output and "[0, 2^63)" in result.output, (
        result.output
    )
    assert not (tmp_path / "x.pt").exists()


def test_options_of_the_other_trainer_are_refused(tmp_path):
    for flag, value in (("--iteration", "3"), ("--action-table", "actions")):
        result = CliRunner().invoke(main, import_args(tmp_path, tmp_path / "x.pt", flag, value))
        assert result.exit_code == 2 and f"{flag} does not apply to --from meta" in result.output
    result = CliRunner().invoke(
        main, ["import-checkpoint", "--from", "meta", str(tmp_path), "-o", str(tmp_path / "x.pt")]
    )
    assert result.exit_code == 2 and "--from meta needs --num-heads" in result.output


README_BLOCK = re.compile(r"<!-- example: tests/test_meta_import\.py[^>]*-->\n```sh\n(.*?)```", re.S)


@pytest.mark.slow
def test_the_readme_example_runs(tmp_path):
    """docs/checkpoint.md's import-and-build block, run as written with its paths moved to tmp_path."""
    blocks = README_BLOCK.findall((ROOT / "docs" / "checkpoint.md").read_text())
    assert len(blocks) == 1, "docs/checkpoint.md has no (or several) Meta import example blocks"
    script = (
        blocks[0]
        .replace("/tmp/meta-sample", str(tmp_path / "sample"))
        .replace(".venv/bin/", str(Path(sys.executable).parent) + "/")
    )
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "per-user rules" in done.stdout and (tmp_path / "sample" / "artifact" / "model.pt2").is_file()
    artifact = tmp_path / "sample" / "artifact"
    verified = CliRunner().invoke(main, ["verify", str(artifact)])
    assert verified.exit_code == 0, verified.output
    # What a serving team sees: the query time is context_ids' third column, and Triton's scorer
    # answers a user's request with what the package computes.
    inspected = CliRunner().invoke(main, ["inspect", str(artifact)])
    assert "context_ids      INT64    [1, 3]" in inspected.output, inspected.output
    import kvexport
    from kvexport.serving.batcher import BatchScorer

    user = {
        "user_id": np.array([[7]]),
        "item_ids": np.array([[4, 10, 22]]),
        "action_ids": np.array([[1, 0, 5]]),
        "context_ids": np.array([[3, 1, 1_650_000_000]]),
        "candidate_ids": np.array([[6, 8]]),
    }
    with kvexport.load(artifact) as package:
        served = BatchScorer(package).score([user])[0]
    config = load_config(tmp_path / "sample" / "model.yaml")
    model = build_model(config, tmp_path / "sample" / "model.pt")
    batch = Batch(
        user_ids=torch.tensor([7]),
        history_lengths=torch.tensor([3]),
        item_ids=torch.tensor([4, 10, 22]),
        action_ids=torch.tensor([1, 0, 5]),
        context_ids=torch.tensor([[3, 1, 1_650_000_000]]),
        num_candidates=torch.tensor([2]),
        candidate_ids=torch.tensor([6, 8]),
    )
    with torch.no_grad():
        torch.testing.assert_close(served.cpu(), model(batch), rtol=0, atol=1e-5)
