"""kvexport import-checkpoint --from nvidia: a recsys-examples ranking checkpoint in the trainer's own
layout (tests/helpers/nvidia_fixture.py, world sizes 1 and 2) against recsys-examples' forward written
independently (tests/helpers/nvidia_reference.py): the imported eager model (full recompute and cached),
the built package and the C++ replay."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import kvexport
from kvexport.cached import CachedRanker
from kvexport.commands.cli import main
from kvexport.config import FP8_PAGES, config_from_dict, load_config
from kvexport.importers import nvidia_ranking
from kvexport.importers.nvidia import read_gin
from kvexport.importers.nvidia_ranking import import_nvidia
from kvexport.model import build_model
from kvexport.model.batch import Batch, UserRequest
from kvexport.ops import wrappers as kv
from kvexport.ops.manager import KVCacheManager
from kvexport.options import NvidiaOptions
from kvexport.trace.ranking import measure_ranking
from kvexport.trace.record import FP8_MAX_RELATIVE_ERROR, unrounded_model
from tests.helpers import nvidia_fixture as fx
from tests.helpers.nvidia_reference import nvidia_ranking_forward

TABLE_ROWS = ["--table-rows", f"action_weights={fx.ACTION_ROWS}"]
# Users of the requests below: known item keys and unknown ids (11, 4), histories long enough that
# positions clamp to the last bucket (2 * 6 > 9).
USERS = [
    (1, [3, 10, 11, 1000, 42, 123456789012], [0, 1, 2, 3, 0, 1], [57, 4, 99]),
    (2, [99], [2], [3]),
    (3, [57, 57, 4, 10], [3, 3, 1, 0], [123456789012, 42]),
]
# The contextual features in token order, and each user's ids: a known and an unknown user_id.
FEATURES = ("user_id", "user_active_degree", "register_days_range")
CONTEXTS = {1: (700, 2, 1), 2: (5, 0, 0), 3: (6000, 1, 1)}


def write_source(tmp_path: Path, world: int, contextual: bool = False, state=None, tables=None, **gin) -> tuple:
    state = fx.dense_state() if state is None else state
    tables = fx.tables(contextual=contextual) if tables is None else tables
    save = tmp_path / f"save-w{world}"
    fx.write_checkpoint(save, world, state, tables)
    gin_file = tmp_path / f"ranking-w{world}.gin"
    gin_file.write_text(fx.gin_text(**gin))
    return save, gin_file, state, tables


def run_import(save: Path, gin_file: Path, out: Path, *extra: str):
    return CliRunner().invoke(
        main,
        [
            "import-checkpoint",
            "--from",
            "nvidia",
            str(save),
            "-o",
            str(out / "model.pt"),
            "--config-out",
            str(out / "model.yaml"),
            "--trainer-config",
            str(gin_file),
            *TABLE_ROWS,
            *extra,
        ],
    )


def batch_of(users, features=()) -> Batch:
    return Batch.concat(
        [
            UserRequest(
                u,
                torch.tensor(i),
                torch.tensor(a),
                torch.tensor(CONTEXTS[u][: len(features)], dtype=torch.int64),
                torch.tensor(c),
            )
            for u, i, a, c in users
        ]
    )


def reference(state, tables, gin_file, users, features=()) -> torch.Tensor:
    gin = {"NetworkArgs.num_position_buckets": 8192, **read_gin(gin_file)}
    return torch.cat(
        [nvidia_ranking_forward(state, tables, gin, i, a, c, dict(zip(features, CONTEXTS[u]))) for u, i, a, c in users]
    )


@pytest.fixture(scope="module", params=[(1, ()), (2, FEATURES)], ids=["world1", "world2-contextual"])
def imported(request, tmp_path_factory):
    """World 1 without contextual features; world 2 with them (a dynamic user_id table among them)."""
    world, features = request.param
    tmp = tmp_path_factory.mktemp(f"nvidia-w{world}")
    save, gin_file, state, tables = write_source(tmp, world, contextual=bool(features))
    out = tmp / "imported"
    out.mkdir()
    rows = [f"--table-rows={name}={n}" for name, n in fx.CONTEXT_TABLES.items()] if features else []
    result = run_import(
        save, gin_file, out, *rows, *(["--contextual-features", ",".join(features)] if features else [])
    )
    assert result.exit_code == 0, result.output
    return out, gin_file, state, tables, features


def test_the_imported_model_is_recsys_examples_forward(imported):
    """Full recompute and the cached path (a first request, then the same users grown by an
    event) against the independent reference, on known and unknown item ids."""
    out, gin_file, state, tables, features = imported
    config = load_config(out / "model.yaml")
    assert config.model.item_ids == "keys" and config.model.head_activation == "relu"
    assert config.model.context_ids == ("keys" if features else "rows")
    assert config.model.scaling_seqlen == 2 * (fx.MAX_HISTORY + fx.MAX_CANDIDATES) + len(features)
    model = build_model(config, out / "model.pt")
    grown = [(u, i + [10], a + [2], c) for u, i, a, c in USERS[1:]]
    cache = KVCacheManager(config)
    try:
        with torch.no_grad():
            for users in (USERS, grown):
                expected = reference(state, tables, gin_file, users, features)
                batch = batch_of(users, features)
                torch.testing.assert_close(model(batch), expected, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(CachedRanker(model).run(batch), expected, rtol=1e-5, atol=1e-5)
        assert cache.stats()["hit_tokens"] > 0
    finally:
        cache.close()


def test_fp8_pages_of_the_imported_checkpoint_keep_the_invariant_within_the_bound(imported):
    """The imported checkpoint with kv_cache.dtype float8_e4m3: the cached path equals the full
    recompute (both over FP8-rounded prefix k/v), the rounding reaches the logits, and they stay
    within the build's FP8 bound of recsys-examples' own forward (unrounded)."""
    out, gin_file, state, tables, features = imported
    raw = load_config(out / "model.yaml").to_dict()
    config = config_from_dict({**raw, "kv_cache": {**raw["kv_cache"], "dtype": FP8_PAGES}})
    model = build_model(config, out / "model.pt")
    batch = batch_of(USERS, features)
    try:
        with torch.no_grad():
            full = model(batch)
            torch.testing.assert_close(CachedRanker(model, "nvidia-fp8").run(batch), full, rtol=1e-5, atol=1e-5)
            assert not torch.equal(full, unrounded_model(model)(batch))
    finally:
        kv.drop_runtime("nvidia-fp8")
    unrounded = reference(state, tables, gin_file, USERS, features)
    assert float((full - unrounded).abs().max() / unrounded.abs().max()) < FP8_MAX_RELATIVE_ERROR
    # The build's ranking check on the trainer's checkpoint: FP8 pages keep its top 10 and AUC.
    measure_ranking(config, model, torch.device("cpu"), logging.getLogger(__name__)).check(config.name)


@pytest.mark.slow
def test_the_package_and_the_cpp_replay_agree_with_the_reference(imported, tmp_path):
    """build, then verify (Python) and replay (the C++ harness) of the trace, whose expectations
    the reference reproduces; and the reference's own requests scored by the package."""
    out, gin_file, state, tables, features = imported
    artifact = tmp_path / "artifact"
    built = CliRunner().invoke(
        main, ["build", str(out / "model.yaml"), "-o", str(artifact), "--checkpoint", str(out / "model.pt")]
    )
    assert built.exit_code == 0, built.output
    for command in ("verify", "replay"):
        result = CliRunner().invoke(main, [command, str(artifact)])
        assert result.exit_code == 0, result.output
    first = torch.load(artifact / "trace" / "step_0000.pt", weights_only=True)
    offsets = [0, *torch.cumsum(first["history_lengths"], 0).tolist()]
    candidate_offsets = [0, *torch.cumsum(first["num_candidates"], 0).tolist()]
    expected = []
    gin = {"NetworkArgs.num_position_buckets": 8192, **read_gin(gin_file)}
    for b in range(len(first["user_ids"])):
        items = first["item_ids"][offsets[b] : offsets[b + 1]].tolist()
        actions = first["action_ids"][offsets[b] : offsets[b + 1]].tolist()
        candidates = first["candidate_ids"][candidate_offsets[b] : candidate_offsets[b + 1]].tolist()
        contexts = dict(zip(features, first["context_ids"][b].tolist()))
        expected.append(nvidia_ranking_forward(state, tables, gin, items, actions, candidates, contexts))
    torch.testing.assert_close(first["expected_full"].float(), torch.cat(expected), rtol=1e-5, atol=1e-5)
    with kvexport.load(artifact) as package:
        torch.testing.assert_close(
            package.run(batch_of(USERS, features)).cpu(),
            reference(state, tables, gin_file, USERS, features),
            rtol=1e-5,
            atol=1e-5,
        )


def _perturbations():
    yield from fx.dense_state()
    yield from (f"table:{name}" for name in fx.tables(contextual=True))


@pytest.mark.parametrize("perturbed", list(_perturbations()))
def test_changing_any_one_upstream_tensor_changes_the_output(tmp_path, perturbed):
    """Every dense tensor and every table, the contextual features' included (imported with them)."""
    state, tables = fx.dense_state(), fx.tables(contextual=True)
    baseline = _imported_output(tmp_path / "a", state, tables)
    state, tables = copy.deepcopy(state), copy.deepcopy(tables)
    target = tables[perturbed[6:]]["rows"] if perturbed.startswith("table:") else state[perturbed]
    # Random, not constant: a uniform shift of an embedding is invisible behind the layer norms.
    target += 0.5 * torch.randn(target.shape, generator=torch.Generator().manual_seed(7))
    assert (_imported_output(tmp_path / "b", state, tables) - baseline).abs().max() > 1e-4


def _imported_output(tmp_path: Path, state, tables) -> torch.Tensor:
    save, gin_file, _, _ = write_source(tmp_path, 1, state=state, tables=tables)
    options = NvidiaOptions(
        table_rows={"action_weights": fx.ACTION_ROWS, **fx.CONTEXT_TABLES}, contextual_features=FEATURES
    )
    result = import_nvidia(save, gin_file, options, "perturbed")
    model = build_model(config_from_dict(result.config))
    model.load_state_dict(result.state_dict)
    with torch.no_grad():
        return model(batch_of(USERS, FEATURES))


def test_contextual_tables_are_refused_unless_named_or_left_out(tmp_path):
    save, gin_file, state, tables = write_source(tmp_path, 2, contextual=True)
    out = tmp_path / "out"
    out.mkdir()
    rows = [
        f"user_active_degree={fx.CONTEXT_TABLES['user_active_degree']}",
        f"register_days_range={fx.CONTEXT_TABLES['register_days_range']}",
    ]
    extra = [arg for r in rows for arg in ("--table-rows", r)]
    refused = run_import(save, gin_file, out, *extra)
    assert refused.exit_code == 2
    assert refused.output.strip().splitlines() == [
        "error: table user_active_degree is neither the item nor the action table nor a contextual feature given: "
        "name the contextual features in token order (--contextual-features a,b,...), or import without them as "
        "recsys-examples' inference runs with disable_contextual_features (--no-contextual-features)"
    ]
    assert list(out.iterdir()) == []
    result = run_import(save, gin_file, out, *extra, "--no-contextual-features")
    assert result.exit_code == 0, result.output
    assert "left out (no contextual features): tables user_active_degree, register_days_range, user_id" in result.output
    model = build_model(load_config(out / "model.yaml"), out / "model.pt")
    with torch.no_grad():
        torch.testing.assert_close(
            model(batch_of(USERS)), reference(state, tables, gin_file, USERS), rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"extra_key": "_hstu_block._attention_layers.0._linear_qkv_extra"},
            "checkpoint tensor _hstu_block._attention_layers.0._linear_qkv_extra has no counterpart in "
            "kvexport's model (unknown key)",
        ),
        ({"drop_key": "_mlp._mlp.2.bias"}, "checkpoint lacks _mlp._mlp.2.bias"),
        ({"gin": {"NetworkArgs.num_layers": 1}}, "checkpoint has a layer 1 but NetworkArgs.num_layers is 1"),
        (
            {"gin": {"NetworkArgs.num_layers": 3}},
            "checkpoint lacks _hstu_block._attention_layers.2._linear_uvqk_weight",
        ),
        (
            {"gin": {"NetworkArgs.kv_channels": 8, "NetworkArgs.hidden_size": 16}},
            "_hstu_block._attention_layers.0._linear_uvqk_weight has shape [8, 32], "
            "the trainer config implies [16, 64]",
        ),
        (
            {"gin": {"RankingArgs.num_tasks": None}},
            "does not bind RankingArgs.num_tasks, which the checkpoint does not hold",
        ),
        ({"gin": {"NetworkArgs.num_layers": "'2'"}}, "NetworkArgs.num_layers = '2' is not a positive integer"),
        (
            {"gin": {"NetworkArgs.scaling_seqlen": 0}},
            "NetworkArgs.scaling_seqlen = 0 is neither -1 nor a positive integer",
        ),
        (
            {"gin": {"NetworkArgs.hidden_size": 6}},
            "NetworkArgs.hidden_size (6) is not num_attention_heads (2) * kv_channels (4): "
            "kvexport's layers need them equal",
        ),
        (
            {"rows": []},
            "the rows of data-parallel table action_weights are not in the checkpoint; give them "
            "(--table-rows action_weights=N, as the trainer's embedding config says)",
        ),
        (
            {"rows": ["--table-rows", "action_weights=5"]},
            "4 rows, but the tables' rows given sum to 5 (action_weights=5)",
        ),
        (
            {"rows": [*TABLE_ROWS, "--item-table", "item_id"]},
            "item table item_id: neither a data-parallel table nor dumped under",
        ),
        ({"item_keys": [-3, 4, 9]}, "item table video_id holds a negative key (-3); kvexport takes keys >= 0"),
    ],
)
def test_what_cannot_be_mapped_is_refused_in_one_line_and_nothing_is_written(tmp_path, change, message):
    state = fx.dense_state()
    if "extra_key" in change:
        state[change["extra_key"]] = torch.zeros(2)
    if "drop_key" in change:
        del state[change["drop_key"]]
    tables = fx.tables()
    if "item_keys" in change:
        tables["video_id"] = {"kind": "dynamic", "keys": change["item_keys"], "rows": torch.ones(3, fx.HIDDEN)}
    save, gin_file, _, _ = write_source(tmp_path, 1, state=state, tables=tables, **change.get("gin", {}))
    out = tmp_path / "out"
    out.mkdir()
    args = [
        "import-checkpoint",
        "--from",
        "nvidia",
        str(save),
        "-o",
        str(out / "model.pt"),
        "--trainer-config",
        str(gin_file),
        *change.get("rows", TABLE_ROWS),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert list(out.iterdir()) == []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("drop", "checkpoint lacks _hstu_block._attention_layers.1._linear_proj_weight"),
        ("extra", "checkpoint tensor _mlp._mlp.1.weight has no counterpart in kvexport's model (unknown key)"),
    ],
)
def test_a_missing_or_unknown_key_is_refused_before_any_table_is_read(tmp_path, monkeypatch, change, message):
    state = fx.dense_state()
    if change == "drop":
        del state["_hstu_block._attention_layers.1._linear_proj_weight"]
    else:
        state["_mlp._mlp.1.weight"] = torch.ones(fx.HIDDEN)
    save, gin_file, _, _ = write_source(tmp_path, 1, state=state)
    tables_read = []
    monkeypatch.setattr(
        nvidia_ranking, "read_dynamic_table", lambda directory, table, *args, **kwargs: tables_read.append(table)
    )
    out = tmp_path / "out"
    out.mkdir()
    result = run_import(save, gin_file, out)
    assert result.exit_code == 2 and result.output.splitlines() == [f"error: {message}"], result.output
    assert tables_read == [] and list(out.iterdir()) == []


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--contextual-features", "user_id,age"],
            "contextual feature age: no data-parallel or dynamic table of that name (tables: user_active_degree, "
            "register_days_range, user_id)",
        ),
        (
            ["--contextual-features", "user_id", "--no-contextual-features"],
            "contextual features given and left out at once: choose --contextual-features or --no-contextual-features",
        ),
    ],
)
def test_contextual_features_that_do_not_fit_are_refused(tmp_path, extra, message):
    save, gin_file, _, _ = write_source(tmp_path, 1, contextual=True)
    out = tmp_path / "out"
    out.mkdir()
    rows = [f"--table-rows={name}={n}" for name, n in fx.CONTEXT_TABLES.items()]
    result = run_import(save, gin_file, out, *rows, *extra)
    assert result.exit_code == 2 and result.output.strip().splitlines() == [f"error: {message}"], result.output
    assert list(out.iterdir()) == []


def test_bfloat16_dense_weights_import_as_the_trainer_saves_them(tmp_path):
    """The trainer's Float16Module saves the dense weights in bfloat16 and its gin default runs
    bfloat16: the config says bfloat16, the weights arrive unchanged (bfloat16 -> float32 is exact),
    and the model agrees with the reference on those weights to bfloat16's tolerance."""
    state = {k: v.to(torch.bfloat16) for k, v in fx.dense_state().items()}
    save, gin_file, _, tables = write_source(tmp_path, 2, state=state, **{"NetworkArgs.dtype_str": None})
    out = tmp_path / "out"
    out.mkdir()
    result = run_import(save, gin_file, out)
    assert result.exit_code == 0, result.output
    config = load_config(out / "model.yaml")
    assert config.model.dtype == "bfloat16"
    imported = torch.load(out / "model.pt", weights_only=True)
    weight = state["_hstu_block._attention_layers.0._linear_uvqk_weight"]
    assert torch.equal(imported["layers.0.uvqk.weight"], weight.float().t())
    model = build_model(config, out / "model.pt")
    with torch.no_grad():
        got = model(batch_of(USERS))
    torch.testing.assert_close(got, reference(state, tables, gin_file, USERS), rtol=0, atol=1e-2)  # bfloat16 rounding
