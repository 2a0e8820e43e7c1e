"""FP8 pages (docs/design.md §2.7): the config, the rounding, the CPU kernel, the runtime's tiers and
the invariant cached == full recompute, each against a plain-PyTorch reference written here."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from kvexport.artifact import open_artifact
from kvexport.cached import CachedRanker
from kvexport.commands.cli import main
from kvexport.config import FP8_CUDA_REFUSAL, ConfigError
from kvexport.errors import UserError
from kvexport.model import build_model
from kvexport.ops import wrappers as kv
from kvexport.ops.manager import KVCacheManager
from kvexport.trace.record import FP8_MAX_RELATIVE_ERROR, Fp8Distance
from kvexport.trace.replay import replay_command
from kvexport.trace.verify import verify_artifact
from kvexport.trace.workload import Workload, WorkloadSpec
from tests.helpers.attention import ALPHA, INV_S, reference_paged_attention
from tests.helpers.configs import tiny_config, tiny_raw, write_config
from tests.helpers.hostile import run_plain_host, write_host_corpus
from tests.helpers.runtime import scratch_runtime

E4M3_MAX = 448.0


# ---- the plain-PyTorch reference of the stored format -----------------------------------------------


def reference_scale_exponents(x: torch.Tensor) -> torch.Tensor:
    """[N, H] the smallest integer E with max |x[n, h]| <= 448 * 2^E (0 for an all-zero head),
    found by search over float64 powers of two rather than by the kernel's frexp rule."""
    amax = x.double().abs().amax(dim=-1)  # [N, H]
    exponents = torch.full_like(amax, -200.0)
    for e in range(-140, 140):  # ascending: the first E that holds is the smallest
        fits = (amax <= E4M3_MAX * 2.0**e) & (exponents == -200.0)
        exponents[fits] = e
    exponents[amax == 0] = 0
    return exponents.long().clamp(-126, 127)


def reference_round(x: torch.Tensor) -> torch.Tensor:
    """x [N, H, dh] through torch's own float8_e4m3fn cast with the reference's scales, in float32."""
    scale = torch.pow(2.0, reference_scale_exponents(x).double()).unsqueeze(-1)  # [N, H, 1]
    return ((x.double() / scale).float().to(torch.float8_e4m3fn).double() * scale).float()


def reference_pages(kv_pages: torch.Tensor) -> torch.Tensor:
    """Float k/v pages [P, 2, ps, H, dh] as FP8 byte pages [P, page_bytes], laid out as documented:
    [2, ps, H, dh] e4m3 bytes, then [2, ps, H] scale bytes (E + 127)."""
    num_pages, _, page_size, heads, dim = kv_pages.shape
    rows = kv_pages.reshape(-1, heads, dim)
    exponents = reference_scale_exponents(rows)  # [rows, H]
    scaled = rows.double() / torch.pow(2.0, exponents.double()).unsqueeze(-1)
    data = scaled.float().to(torch.float8_e4m3fn).view(torch.uint8).reshape(num_pages, -1)
    scales = (exponents + 127).to(torch.uint8).reshape(num_pages, -1)
    return torch.cat([data, scales], dim=1)


def test_fp8_round_matches_torch_cast_with_power_of_two_scales():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 40, generator=g) * torch.logspace(-6, 4, 64).view(-1, 1, 1)
    x[0] = 0.0  # an all-zero row
    x[1, 0, :] = 448.0  # amax exactly 448 * 2^0
    x[1, 1, :] = -448.0 * 2.0**-7
    x[2, :, 0] = 1e-30  # a head whose values are all far below its largest
    got = kv.fp8_round(x)
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got, reference_round(x), rtol=0, atol=0)
    # What rounding costs: e4m3's 3 mantissa bits, relative error at most 2^-4 where not subnormal.
    normal = x.abs() >= x.abs().amax(dim=-1, keepdim=True) * 2.0**-8
    assert ((got - x).abs() <= x.abs() * 2.0**-4)[normal].all()


def test_fp8_round_of_bfloat16_rows_is_exact_in_bfloat16():
    x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got = kv.fp8_round(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference_round(x.float()), rtol=0, atol=0)


# ---- the CPU kernel reads FP8 pages ----------------------------------------------------------------


@pytest.mark.parametrize(("threads", "num_rows", "pages"), [(1, 150, 40), (2, 400, 64)])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 24])
def test_kernel_over_fp8_pages_equals_reference_over_dequantised_pages(head_dim, threads, num_rows, pages):
    g = torch.Generator().manual_seed(6)
    page_size, heads = 16, 2
    kv_pages = torch.randn(pages + 8, 2, page_size, heads, head_dim, generator=g)
    kv_pages *= torch.rand(pages + 8, 2, page_size, heads, 1, generator=g) + 0.25  # scales differ by row and head
    byte_pages = reference_pages(kv_pages)
    dequantised = reference_round(kv_pages.reshape(-1, heads, head_dim)).view_as(kv_pages)
    page_table = torch.randperm(pages + 8, generator=g)[:pages].view(1, pages)
    row_user = torch.zeros(num_rows, dtype=torch.int64)
    row_keys = torch.randint(0, pages * page_size + 1, (num_rows,), generator=g)
    row_candidate = torch.rand(num_rows, generator=g) < 0.4
    q, k, v = (torch.randn(num_rows, heads, head_dim, generator=g) for _ in range(3))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kv.hstu_paged_attention(q, k, v, byte_pages, page_table, row_user, row_keys, row_candidate, ALPHA, INV_S)
    finally:
        torch.set_num_threads(before)
    expected = reference_paged_attention(q, k, v, dequantised, page_table, row_user, row_keys, row_candidate)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [128, 24])
def test_kernel_over_fp8_pages_at_the_ends_of_the_scale_range(head_dim):
    """Key rows up to 3e38 (scale 2^120, past what the kernel's fast decode multiplies by: its
    other loop decodes them) and value rows near 1e-30 (scale 2^-108), every value exact."""
    g = torch.Generator().manual_seed(7)
    pages, page_size, heads, num_rows = 12, 16, 2, 40
    kv_pages = torch.randn(pages, 2, page_size, heads, head_dim, generator=g)
    keys = kv_pages[:, 0]
    keys *= 3.0e38 / keys.abs().amax(dim=-1, keepdim=True)  # [P, ps, H, dh], each row's largest 3e38
    values = kv_pages[:, 1]
    values *= 1e-30 / values.abs().amax(dim=-1, keepdim=True)
    byte_pages = reference_pages(kv_pages)
    assert byte_pages[:, -2 * page_size * heads :].unique().tolist() == [127 - 108, 127 + 120]  # [P, 2 * ps * H]
    dequantised = reference_round(kv_pages.reshape(-1, heads, head_dim)).view_as(kv_pages)
    page_table = torch.randperm(pages, generator=g).view(1, pages)
    row_keys = torch.randint(0, pages * page_size + 1, (num_rows,), generator=g)
    row_candidate = torch.zeros(num_rows, dtype=torch.bool)
    q = torch.randn(num_rows, heads, head_dim, generator=g) * 2.0**-126
    args = (q, q, q, byte_pages, page_table, torch.zeros(num_rows, dtype=torch.int64), row_keys, row_candidate)
    got = kv.hstu_paged_attention(*args, ALPHA, INV_S)
    expected = reference_paged_attention(*args[:3], dequantised, *args[4:])
    assert expected.abs().max() > 0 and torch.isfinite(expected).all()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_kernel_refuses_fp8_pages_of_another_shape():
    q = torch.randn(2, 2, 8)
    with pytest.raises(RuntimeError, match="FP8 pages"):
        kv.hstu_paged_attention(
            q,
            q,
            q,
            torch.zeros(3, 2 * 2 * 9 * 4 + 1, dtype=torch.uint8),
            torch.zeros(1, 1, dtype=torch.int64),
            torch.zeros(2, dtype=torch.int64),
            torch.zeros(2, dtype=torch.int64),
            torch.zeros(2, dtype=torch.bool),
            ALPHA,
            INV_S,
        )


# ---- the runtime: pages, tiers, remote entries ------------------------------------------------------

FP8_RUNTIME = {
    "num_layers": 2,
    "num_heads": 2,
    "head_dim": 8,
    "page_size": 4,
    "device_pages": 6,
    "host_pages": 0,
    "dtype": "float32",
    "kv_dtype": "float8_e4m3",
    "remote_read_budget_us": 200_000,
}


def run_batch(runtime: str, config: str, users: dict[int, list[int]], rows_of) -> None:
    """One batch through the runtime ops, one candidate a user; rows_of(tokens, layer) are the new
    tokens' k (and v) rows [n, H, dh]."""
    user_ids = torch.tensor(list(users))
    tokens = torch.tensor([t for ts in users.values() for t in ts])
    lengths = torch.tensor([len(ts) for ts in users.values()])
    new = kv.begin_batch(
        runtime, config, user_ids, tokens, lengths, torch.ones(len(users), dtype=torch.int64), torch.empty(0)
    )
    new_tokens = tokens[new.index].tolist()
    for layer in range(2):
        rows = torch.cat([torch.zeros(len(users), 2, 8), rows_of(new_tokens, layer)])
        kv.paged_attention(runtime, layer, rows, rows, rows, 1.0, 1.0)
    kv.end_batch(runtime, user_ids, rows)


def token_rows(tokens: list[int], layer: int) -> torch.Tensor:
    """Deterministic rows [n, 2, 8] of every magnitude, from the token ids and layer."""
    t = torch.tensor(tokens, dtype=torch.float64).view(-1, 1, 1)
    d = torch.arange(16, dtype=torch.float64).view(1, 2, 8)
    return (torch.sin(t * 1.7 + d * 0.31 + layer) * torch.pow(10.0, (t % 7) - 3)).float()


def test_runtime_stores_fp8_rows_and_reads_them_back_dequantised():
    config = json.dumps({**FP8_RUNTIME, "host_pages": 4})
    tokens = list(range(100, 110))
    with scratch_runtime(config) as name:
        run_batch(name, config, {1: tokens}, token_rows)
        stored = kv.read_user_kv(name, 1)  # [layers, 2, 10, H, dh]
        for layer in range(2):
            expected = reference_round(token_rows(tokens, layer))
            assert torch.equal(stored[layer, 0], expected) and torch.equal(stored[layer, 1], expected)
        # Offloaded to the host tier and onboarded back: the same bytes and scales.
        assert kv.evict_user(name, 1)
        run_batch(name, config, {1: tokens + [110]}, token_rows)
        back = kv.read_user_kv(name, 1)
        assert kv.runtime_stats(name)["onboards"] == 1
        assert torch.equal(back[:, :, :10], stored)


def test_fp8_remote_entry_round_trip_carries_bytes_and_scales(redis_server):
    """An FP8 user evicted to the remote tier comes back bit exact (scales included), in about half the
    bytes a float32 runtime's entry of the same shape takes at twice the head size."""
    config = json.dumps(FP8_RUNTIME)
    tokens = list(range(200, 211))
    with scratch_runtime(config) as name:
        kv.attach_remote(name, redis_server.url, "on_evict")
        run_batch(name, config, {1: tokens}, token_rows)
        before = kv.read_user_kv(name, 1)
        assert kv.evict_user(name, 1)
        assert kv.flush_remote(name, 5000)
        run_batch(name, config, {1: tokens + [211]}, token_rows)
        stats = kv.runtime_stats(name)
        assert (stats["remote_hits"], stats["remote_hit_tokens"]) == (1, 11)
        assert torch.equal(kv.read_user_kv(name, 1)[:, :, :11], before)
        fp8_bytes = stats["remote_bytes_out"]
    # 2 layers x 3 pages x (2 x 4 x 2 x 8 e4m3 bytes + 2 x 4 x 2 scale bytes) = 864 bytes of pages.
    assert 864 < fp8_bytes < 864 + 400


def test_fp8_remote_entry_with_a_changed_scale_is_a_checksum_miss(redis_server, redis):
    config = json.dumps(FP8_RUNTIME)
    with scratch_runtime(config) as name:
        kv.attach_remote(name, redis_server.url, "on_evict")
        run_batch(name, config, {1: list(range(11))}, token_rows)
        assert kv.evict_user(name, 1)
        assert kv.flush_remote(name, 5000)
        key = f"kvexport:{name}:1".encode()
        entry = bytearray(redis.command("GET", key))
        entry[-8 - 1] ^= 0x01  # the last page's last scale byte, just before the checksum
        redis.command("SET", key, bytes(entry))
        run_batch(name, config, {1: list(range(12))}, token_rows)
        stats = kv.runtime_stats(name)
        assert (stats["remote_hits"], stats["remote_rejected_checksum"]) == (0, 1)


def test_runtime_refuses_fp8_pages_on_cuda():
    with pytest.raises(Exception, match="FP8 pages need the Hopper kernel's FP8 path"):
        kv.create_runtime("fp8-on-cuda", json.dumps(FP8_RUNTIME), "cuda")


# ---- the invariant: cached == full recompute, under eviction ----------------------------------------


def fp8_config(**model):
    # A small S: attention moves the logits enough that FP8's rounding shows (asserted below).
    return tiny_config(
        name="parity-fp8",
        model={**model, "max_history_length": 48, "scaling_seqlen": 4},
        kv_cache={"device_pages": 21, "host_pages": 42, "dtype": "float8_e4m3"},
        trace={"max_trace_history_length": 48},
    )


def test_cached_equals_recompute_with_fp8_pages_under_eviction():
    """Both routes attend over FP8-rounded prefix k/v: they agree to float rounding (1e-6, the
    float32 model), while the unrounded model lies over 100 times further away."""
    config = fp8_config()
    model = build_model(config, seed=1)
    with torch.no_grad():  # a larger attention share, so that the rounding moves the logits
        for layer in model.layers:
            layer.uvqk.weight.mul_(4)
    unrounded = copy.deepcopy(model)
    unrounded.round_kv = None
    atol = 1e-6
    cache = KVCacheManager(config)
    cache.reset()
    spec = WorkloadSpec(
        num_users=12,
        min_history_length=8,
        max_history_length=48,
        max_new_events=6,
        num_candidates=6,
        rewrite_fraction=0.15,
    )
    workload = Workload(config.model, spec, seed=2)
    moved = 0.0
    try:
        for step in range(50):
            batch = workload.next_batch(batch_size=1 + step % 3)
            with torch.no_grad():
                cached, full = CachedRanker(model).run(batch), model(batch)
                moved = max(moved, float((unrounded(batch) - full).abs().max()))
            assert torch.allclose(cached, full, rtol=0, atol=atol), f"request {step}: cached != recompute"
        stats = cache.stats()
    finally:
        cache.close()
    assert moved > 100 * atol, moved
    assert stats["device_evictions"] > 0 and stats["offloads"] > 0 and stats["onboards"] > 0
    assert stats["prefix_truncations"] > 0 and stats["hit_tokens"] > 0


@pytest.fixture(scope="module")
def fp8_artifact(tmp_path_factory, tiny_checkpoint) -> Path:
    """hstu-tiny with FP8 pages, built from the session's checkpoint."""
    from kvexport.export.build import build_artifact

    workdir = tmp_path_factory.mktemp("fp8")
    raw = tiny_raw(name="hstu-tiny-fp8", kv_cache={"dtype": "float8_e4m3"})
    return build_artifact(write_config(raw, workdir / "hstu-tiny-fp8.yaml"), workdir / "hstu-tiny-fp8", tiny_checkpoint)


@pytest.mark.slow
def test_soak_of_an_fp8_package_has_no_mismatch_under_eviction(fp8_artifact, tiny_checkpoint, tmp_path):
    """The package against the float32 full recompute over FP8-rounded k/v, every tier exercised; the
    package's tolerance is tighter than the distance to the unrounded model, so the soak tells them apart."""
    report_path = tmp_path / "soak.json"
    arguments = ["--requests", "250", "--users", "40", "--seed", "3", "--checkpoint", str(tiny_checkpoint)]
    result = CliRunner().invoke(main, ["soak", str(fp8_artifact), *arguments, "--json", str(report_path)])
    assert result.exit_code == 0, result.output
    assert "verdict: PASS" in result.output
    report = json.loads(report_path.read_text())
    assert report["mismatches"] == 0 and report["requests"] == 250
    for name in ("hit_tokens", "device_evictions", "offloads", "onboards", "host_evictions", "prefix_truncations"):
        assert report["counters"][name] > 10, name
    manifest = open_artifact(fp8_artifact).manifest
    assert manifest.tolerance["atol"] < manifest.fp8_distance["max_abs"], manifest.fp8_distance
    ranking = manifest.fields["fp8_ranking"]  # the build's ranking check ran, and passed
    assert ranking["users"] == 64 and ranking["top10_drop"]["lower"] <= ranking["bound"], ranking


@pytest.mark.slow
def test_soak_of_a_bfloat16_fp8_package_has_no_mismatch_under_eviction(tmp_path):
    """bfloat16 with FP8 pages: the package against the eager recompute under eviction, the tolerance
    the build derived from the model's own rounding; FP8's rounding steps stay inside it."""
    from kvexport.export.build import build_artifact

    raw = tiny_raw(name="hstu-tiny-bf16-fp8", model={"dtype": "bfloat16"}, kv_cache={"dtype": "float8_e4m3"})
    artifact = build_artifact(write_config(raw, tmp_path / "bf16-fp8.yaml"), tmp_path / "bf16-fp8")
    report_path = tmp_path / "soak.json"
    arguments = ["--requests", "200", "--users", "40", "--seed", "1", "--json", str(report_path)]
    result = CliRunner().invoke(main, ["soak", str(artifact), *arguments])
    assert result.exit_code == 0, result.output
    report = json.loads(report_path.read_text())
    assert report["mismatches"] == 0 and report["requests"] == 200
    for name in ("device_evictions", "onboards", "prefix_truncations"):
        assert report["counters"][name] > 10, name
    manifest = open_artifact(artifact).manifest
    assert manifest.fp8_distance["max_abs"] > 0 and manifest.fields["fp8_ranking"]["users"] == 64


@pytest.fixture(scope="module")
def fp8_corpus(fp8_artifact, tiny_checkpoint, tmp_path_factory) -> Path:
    """Hostile requests, and valid ones with the FP8 model's eager full recompute (no cache)."""
    config = open_artifact(fp8_artifact).manifest.config
    model = build_model(config, checkpoint=tiny_checkpoint)
    return write_host_corpus(config, model, tmp_path_factory.mktemp("fp8-corpus") / "corpus.pt")


@pytest.mark.slow
def test_plain_torch_host_on_eight_threads_scores_an_fp8_package_exactly(fp8_artifact, fp8_corpus):
    """A host of plain torch and the op library (no kvexport): valid requests equal the eager FP8
    recompute, hostile ones are refused, on eight threads at once."""
    assert run_plain_host(fp8_artifact, fp8_corpus, "threads")["failures"] == []


@pytest.mark.slow
def test_fp8_package_verifies_in_python_and_replays_in_the_cpp_harness(fp8_artifact, tmp_path):
    python = verify_artifact(fp8_artifact).to_json()
    report_path = tmp_path / "replay.json"
    result = subprocess.run(replay_command(fp8_artifact, report_path), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    cpp = json.loads(report_path.read_text())
    assert python["passed"] and cpp["passed"]
    assert [c["description"] for c in cpp["steps"]] == [p["description"] for p in python["steps"]]
    for c, p in zip(cpp["steps"], python["steps"]):
        assert c["vs_full"]["max_abs"] == pytest.approx(p["vs_full"]["max_abs"], abs=1e-7), c["description"]


# ---- config and refusals ----------------------------------------------------------------------------


def test_kv_cache_dtype_defaults_to_the_model_dtype():
    assert tiny_config().kv_cache.dtype == "float32"
    assert tiny_config(model={"dtype": "bfloat16"}).kv_cache.dtype == "bfloat16"
    assert "kv_dtype" not in json.loads(tiny_config().runtime_json())
    fp8 = tiny_config(kv_cache={"dtype": "float8_e4m3"})
    assert fp8.kv_cache.fp8_pages and json.loads(fp8.runtime_json())["kv_dtype"] == "float8_e4m3"


@pytest.mark.parametrize(
    ("kv_cache", "serving", "message"),
    [
        (
            {"dtype": "float8_e5m2"},
            {},
            "kv_cache.dtype must be float8_e4m3 or model.dtype (float32), got 'float8_e5m2'",
        ),
        ({"dtype": "bfloat16"}, {}, "kv_cache.dtype must be float8_e4m3 or model.dtype (float32), got 'bfloat16'"),
        ({"dtype": 8}, {}, "kv_cache.dtype must be str, got 8"),
        (
            {"dtype": "float8_e4m3"},
            {"device": "cuda"},
            f"kv_cache.dtype float8_e4m3 with serving.device cuda: {FP8_CUDA_REFUSAL}",
        ),
    ],
)
def test_bad_kv_cache_dtype_is_one_line(kv_cache, serving, message):
    with pytest.raises(ConfigError) as error:
        tiny_config(kv_cache=kv_cache, serving=serving)
    assert str(error.value) == message


def test_build_of_a_cuda_package_with_fp8_pages_exits_2_in_one_line(tmp_path):
    path = write_config(tiny_raw(kv_cache={"dtype": "float8_e4m3"}, serving={"device": "cuda"}), tmp_path / "c.yaml")
    result = CliRunner().invoke(main, ["build", str(path), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert FP8_CUDA_REFUSAL in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_fp8_error_past_the_bound_is_refused_in_one_line():
    distance = Fp8Distance()
    distance.add(torch.tensor([[1.0, -2.0]]), torch.tensor([[1.0, -2.0 + 2 * FP8_MAX_RELATIVE_ERROR * 1.01]]))
    with pytest.raises(UserError) as error:
        distance.check("m")
    assert str(error.value).startswith("m: FP8 pages move the logits 0.0505 (relative)")
    within = Fp8Distance()
    within.add(torch.tensor([[1.0, -2.0]]), torch.tensor([[1.0, -2.0 + 0.01]]))
    within.check("m")
    assert within.report()["max_relative"] == pytest.approx(0.005)
