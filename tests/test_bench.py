"""Smoke test of `kvexport bench` with minimal repeats (timings belong to benchmarks/, not here)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvexport.cli import main
from tests.conftest import ROOT

pytestmark = pytest.mark.slow
HEADLINES = ("cache_speedup", "package_speedup_vs_eager", "cpp_over_python_latency", "build_seconds_cold",
             "build_seconds_warm", "bytes_per_cached_token")


def test_bench_writes_every_figure(tmp_path):
    results_path, plot_path = tmp_path / "bench.json", tmp_path / "bench.png"
    result = CliRunner().invoke(main, ["bench", str(ROOT / "configs" / "hstu-bench.yaml"), "--lengths", "16,64",
                                       "--warmup", "0", "--repeats", "1", "--json", str(results_path),
                                       "--plot", str(plot_path)])
    assert result.exit_code == 0, result.output
    results = json.loads(results_path.read_text())
    for key in HEADLINES:
        assert isinstance(results[key], (int, float)) and results[key] > 0, key
    assert results["bytes_per_cached_token"] == 2 * 2 * 2 * 32 * 4  # layers * (k, v) * heads * head_dim * fp32
    assert {(r["cached_events"], r["batch_size"]) for r in results["cache_benefit"]} == {
        (16, 1), (64, 1), (16, 4), (64, 4)}
    assert results["cpp_vs_python"]["steps"] > 0
    assert results["cache_memory"]["device_occupancy"] > 0
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_rejects_lengths_beyond_the_config(tiny_artifact):
    result = CliRunner().invoke(main, ["bench", str(tiny_artifact), "--lengths", "4096", "--checkpoint", "x"])
    assert result.exit_code == 2
    assert "--lengths 4096 + 16 new events exceed model.max_history_length (512)" in result.output
