"""Smoke test of `kvexport bench` with minimal repeats (timings belong to benchmarks/, not here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from kvexport.bench.contention import available_cpus, busy_processes
from kvexport.bench.kernel import KernelShape, attention_inputs
from kvexport.commands.cli import main
from kvexport.ops import wrappers as kv
from tests.helpers import ROOT

pytestmark = pytest.mark.slow
HEADLINES = (
    "cache_speedup",
    "package_speedup_vs_eager",
    "cpp_over_python_latency",
    "build_seconds_cold",
    "build_seconds_warm",
    "bytes_per_cached_token",
    "contention_cached_slowdown",
    "contention_full_slowdown",
    "portable_kernel_over_native",
    "portable_kernel_no_fmv_over_native",
)


def test_bench_writes_every_figure(tmp_path):
    results_path, plot_path = tmp_path / "bench.json", tmp_path / "bench.png"
    result = CliRunner().invoke(
        main,
        [
            "bench",
            str(ROOT / "configs" / "hstu-bench.yaml"),
            "--lengths",
            "16,64",
            "--warmup",
            "0",
            "--repeats",
            "1",
            "--json",
            str(results_path),
            "--plot",
            str(plot_path),
        ],
    )
    assert result.exit_code == 0, result.output
    results = json.loads(results_path.read_text())
    for key in HEADLINES:
        assert isinstance(results[key], (int, float)) and results[key] > 0, key
    assert results["bytes_per_cached_token"] == 2 * 2 * 2 * 32 * 4  # layers * (k, v) * heads * head_dim * fp32
    assert {(r["cached_events"], r["batch_size"]) for r in results["cache_benefit"]} == {
        (16, 1),
        (64, 1),
        (16, 4),
        (64, 4),
    }
    assert results["cpp_vs_python"]["steps"] > 0
    assert results["cache_memory"]["device_occupancy"] > 0
    contention = results["contention"]
    assert [row["busy_in_own_sessions"] for row in contention.values()] == [True, False]
    assert all(row["cached_events"] == 64 and row["busy_processes"] == available_cpus() for row in contention.values())
    builds = results["kernel_builds"]["builds"]
    assert [b["march"] for b in builds.values()] == ["native", "x86-64-v3", "x86-64-v3"]
    assert [bool(b["multiversion"]) for b in builds.values()] == [False, True, False]
    assert results["machine"]["op_library_march"] == "native"
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_rejects_lengths_beyond_the_config(tiny_artifact):
    result = CliRunner().invoke(main, ["bench", str(tiny_artifact), "--lengths", "4096", "--checkpoint", "x"])
    assert result.exit_code == 2
    assert "--lengths 4096 + 16 new events exceed model.max_history_length (512)" in result.output


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"  # an unreaped zombie has ended


def _wait_until_gone(pids: list[int], seconds: float = 10.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [pid for pid in pids if _alive(pid)]


@pytest.mark.parametrize("own_sessions", [True, False])
def test_busy_processes_run_in_the_block_only(own_sessions):
    with busy_processes(2, own_sessions) as processes:
        assert all(p.poll() is None for p in processes)
        sessions = {os.getsid(p.pid) for p in processes}
        assert sessions == ({p.pid for p in processes} if own_sessions else {os.getsid(0)})
    assert all(p.returncode is not None for p in processes)


def test_on_a_busy_host_requests_take_fewer_threads_and_answer_the_same(tiny_artifact):
    """With a busy process per CPU, the package runs requests on fewer threads than the caller's
    (counted as busy_host_requests), and the trace still matches its eager expectations."""
    from kvexport.trace.verify import verify_artifact

    if torch.get_num_threads() < 2:
        pytest.skip("one intra-op thread: nothing to take away")
    with busy_processes(available_cpus()):
        report = verify_artifact(tiny_artifact)
    assert report.passed, [s for s in report.steps if not s.passed]
    assert report.counters["busy_host_requests"] > 0


def test_busy_processes_end_when_the_bench_is_killed(tmp_path):
    """A bench killed mid-measurement (no finally runs) leaves no busy process behind."""
    pids_file = tmp_path / "pids"
    script = (
        "import sys, time\nfrom kvexport.bench.contention import busy_processes\n"
        "with busy_processes(2) as ps:\n"
        f"    open({str(pids_file)!r}, 'w').write(' '.join(str(p.pid) for p in ps))\n"
        "    time.sleep(60)\n"
    )
    bench = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 60
        while not pids_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [int(pid) for pid in pids_file.read_text().split()]
        assert all(_alive(pid) for pid in pids)
    finally:
        bench.kill()
        bench.wait()
    assert _wait_until_gone(pids) == []


def _dense_attention(q, k, v, cache, page_table, row_user, row_keys, row_candidate, alpha, inv_s):
    """One user's attention with every key gathered in position order, masked per row."""
    page_size = cache.shape[2]
    positions = torch.arange(int(row_keys.max()))
    pages = page_table[0, positions // page_size]
    keys, values = cache[pages, 0, positions % page_size], cache[pages, 1, positions % page_size]  # [n, H, dh]
    weights = nn.functional.silu(alpha * torch.einsum("rhd,nhd->rhn", q, keys)) * inv_s
    weights = weights * (positions[None, None, :] < row_keys[:, None, None])
    out = torch.einsum("rhn,nhd->rhd", weights, values)
    self_weight = nn.functional.silu(alpha * (q * k).sum(-1, keepdim=True)) * inv_s * row_candidate[:, None, None]
    return out + self_weight * v


@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_bench_inputs_are_a_request_the_kernel_computes(threads):
    """The kernel timed by the bench, on its own inputs (several key blocks and row tiles), is right."""
    shape = KernelShape(heads=2, head_dim=32, page_size=16, contextual=3, cached_events=300, scaling_seqlen=8192)
    inputs = attention_inputs(shape)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kv.hstu_paged_attention(*inputs, 0.25, 1 / 8192)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, _dense_attention(*inputs, 0.25, 1 / 8192), rtol=1e-5, atol=1e-6)


def _request_bench(artifact, checkpoint, out):
    """benchmarks/gpu/request_bench.py on a CPU artifact, small: returns its rows."""
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu" / "request_bench.py"),
            str(artifact),
            "--length",
            "32",
            "--new-events",
            "4",
            "--candidates",
            "8",
            "--batch",
            "1,2",
            "--warmup",
            "1",
            "--repeats",
            "3",
            "--full-repeats",
            "2",
            "--json",
            str(out),
            "--checkpoint",
            str(checkpoint),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(out.read_text())["rows"]


def test_request_bench_runs_on_a_cpu_package(tiny_artifact, tiny_checkpoint, tmp_path):
    """benchmarks/gpu/request_bench.py (the GPU workload's bench) on the CPU package: every row measured."""
    rows = _request_bench(tiny_artifact, tiny_checkpoint, tmp_path / "request.json")
    assert [row["batch_size"] for row in rows] == [1, 2]
    for row in rows:
        assert row["cached_ms"]["n"] == 3 and row["full_ms"]["n"] == 2 and row["eager_cached_ms"]["n"] == 3
        assert 0 < row["cached_ms"]["median"] <= row["cached_ms"]["p99"] <= row["cached_ms"]["max"]
        assert row["cache_speedup"] > 0 and row["package_speedup_vs_eager"] > 0


def test_request_bench_times_each_route_side_by_side(step_artifact, tiny_checkpoint, tmp_path):
    """On an artifact with a step program: the step route and model.pt2's, each row measured, the
    eager model timed beside the first."""
    rows = _request_bench(step_artifact, tiny_checkpoint, tmp_path / "request.json")
    assert [(row["route"], row["batch_size"]) for row in rows] == [("step", 1), ("step", 2), ("model", 1), ("model", 2)]
    assert all(row["cached_ms"]["n"] == 3 for row in rows)
    assert ["eager_cached_ms" in row for row in rows] == [True, True, False, False]


@pytest.mark.parametrize(
    "config, problem",
    [
        ("hstu-tiny.yaml", "was built with a checkpoint; this script compares the seeded weights"),
        ("hstu-bench.yaml", "was built from another config than hstu-bench's"),
    ],
)
def test_weights_bench_refuses_a_package_it_cannot_compare(tiny_artifact, config, problem):
    """benchmarks/gpu/weights_bench.py --package: the built package must hold the weights the script
    exports (the seeded ones of the same config), else the bitwise comparison means nothing."""
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu" / "weights_bench.py"),
            str(ROOT / "configs" / config),
            "--package",
            str(tiny_artifact),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert (result.returncode, result.stderr) == (2, f"error: {tiny_artifact} {problem}\n")
