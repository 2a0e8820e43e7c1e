"""The tiny package built for CUDA, end to end on the GPU: verify (Python) and replay (C++) against the
recorded expectations, the plain-torch host's hostile corpus sequentially and from 8 threads, and a
soak with offloads and onboards against the float32 recompute. Skipped without a CUDA device."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from kvexport.trace.replay import replay_command
from tests.helpers.artifacts import edit_manifest
from tests.helpers.configs import TINY
from tests.helpers.hostile import good_request, run_plain_host

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_the_package_names_its_device(cuda_artifact):
    manifest = json.loads((cuda_artifact / "manifest.json").read_text())
    assert manifest["device"] == "cuda"
    assert {spec["device"] for spec in manifest["signature"]["inputs"]} == {"cpu"}
    assert manifest["signature"]["output"]["device"] == "cuda"


def test_verify_and_replay_pass_on_the_gpu(cuda_artifact, tmp_path):
    from kvexport.trace.verify import verify_artifact

    report = verify_artifact(cuda_artifact)
    assert report.passed, [s for s in report.steps if not s.passed]
    assert report.counters["offloads"] > 0 and report.counters["onboards"] > 0
    result = subprocess.run(
        replay_command(cuda_artifact, tmp_path / "replay.json"), capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]  # also: the harness exits cleanly
    assert json.loads((tmp_path / "replay.json").read_text())["passed"]


def test_plain_host_refuses_every_hostile_request_on_the_gpu(cuda_artifact, host_corpus):
    summary = run_plain_host(cuda_artifact, host_corpus, "sequential")
    assert summary["hostile"] >= 20 and summary["failures"] == []


def test_plain_host_eight_threads_on_the_gpu(cuda_artifact, host_corpus):
    assert run_plain_host(cuda_artifact, host_corpus, "threads")["failures"] == []


def test_soak_with_offloads_on_the_gpu(cuda_artifact, tiny_checkpoint, tmp_path):
    report = tmp_path / "soak.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvexport",
            "soak",
            str(cuda_artifact),
            "--requests",
            "200",
            "--checkpoint",
            str(tiny_checkpoint),
            "--json",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    soak = json.loads(report.read_text())
    assert soak["mismatches"] == 0 and soak["counters"]["onboards"] > 0


def test_inputs_on_two_devices_are_refused(cuda_artifact, tiny_config, tiny_checkpoint):
    """A request with one tensor on the GPU is refused by the request check, naming that tensor,
    and the next request is scored correctly."""
    import kvexport
    from kvexport.model import build_model
    from kvexport.model.batch import Batch

    names = ("user_ids", "history_lengths", "item_ids", "action_ids", "context_ids", "num_candidates", "candidate_ids")
    good = good_request(tiny_config, 900)
    mixed = dict(good, item_ids=good["item_ids"].to("cuda"))
    with kvexport.load(cuda_artifact) as package:
        with pytest.raises(RuntimeError):
            package._loaded.program(*(mixed[name] for name in names))
        code, message = torch.ops.kvexport.last_error(package.runtime_name)
        assert code == "invalid_request" and message.startswith("item_ids is on cuda:0: "), message
        logits = package.score(good).cpu()
    with torch.no_grad():
        expected = build_model(tiny_config, checkpoint=tiny_checkpoint)(Batch(**good))
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)


def test_the_harness_refuses_a_package_built_for_another_gpu(cuda_artifact, tmp_path):
    """The C++ host checks the recorded build GPU against this one (kvexport::gpu_info) before it loads
    the package, in the words the Python hosts use."""
    import shutil

    from kvexport.ops import wrappers as kv

    major, minor = torch.cuda.get_device_capability()
    assert kv.gpu_info(torch.device("cuda")) == (f"{major}.{minor}", torch.cuda.get_device_name())
    artifact = shutil.copytree(cuda_artifact, tmp_path / "other-gpu")
    edit_manifest(artifact, lambda m: m["isa"].update(gpu={"capability": "1.0", "name": "an older GPU"}))
    result = subprocess.run(
        replay_command(artifact, tmp_path / "replay.json"), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: the package's GPU code is compiled for compute capability 1.0 (an older GPU); cuda has "
        f"{major}.{minor} ({torch.cuda.get_device_name()}): build the package on a GPU of this architecture"
    ]


def test_a_request_on_the_gpu_is_refused_in_one_line(cuda_artifact):
    """A package takes its request on the host; a host that hands it GPU tensors gets one line and
    the invalid_request code from the first op (called directly, and through the package)."""
    from kvexport.config import load_config
    from kvexport.host.program import load_program
    from kvexport.model.batch import random_batch
    from kvexport.ops import wrappers as kv

    config = load_config(TINY)
    runtime = json.loads((cuda_artifact / "manifest.json").read_text())["runtime_name"]
    batch = random_batch(config.model, seed=1, history_lengths=[3, 5], num_candidates=[2, 3])
    on_gpu = [t.cuda() for t in batch.tensors()]
    expected = "user_ids is on cuda:0: a request's tensors must be on the host (cpu), whatever the package's device"
    with pytest.raises(ValueError, match=re.escape(expected)):
        kv.check_request(runtime, config.request_limits_json(), *on_gpu)
    assert kv.last_error(runtime) == ("invalid_request", expected)
    compiled = load_program(cuda_artifact / "model.pt2", 0)
    kv.create_runtime(runtime, compiled.get_metadata()["kvexport.runtime_config"], "cuda")
    with pytest.raises(RuntimeError):
        compiled(*on_gpu)
    assert kv.last_error(runtime) == ("invalid_request", expected)
    compiled(*batch.tensors())  # the same request on the host is served
    assert kv.last_error(runtime) == ("ok", "")


def test_no_request_op_calls_a_synchronising_torch_function(cuda_artifact):
    """The recorded trace (offloads, onboards and a capacity refusal among its steps) through the
    package under torch's sync debug mode "error": a torch function that waits for the device
    inside a request (a blocking copy, .item(), nonzero) would raise. The logits are read, and
    checked against the recorded expectations, only afterwards. Raw CUDA waits are not seen: the
    AOTInductor container's wait for its previous run, a copy from pageable memory."""
    import kvexport
    from kvexport.artifact import TRACE_KEYS
    from kvexport.model.batch import SIGNATURE
    from kvexport.ops import wrappers as kv
    from kvexport.trace.record import load_trace_step

    with kvexport.load(cuda_artifact) as package:
        steps = package.artifact.trace_steps
        runs = []
        torch.cuda.set_sync_debug_mode("error")
        try:
            for step in steps:
                request, expected, _ = load_trace_step(
                    cuda_artifact / step[TRACE_KEYS["file"]], expect_outputs=TRACE_KEYS["expect_error"] not in step
                )
                try:
                    runs.append((package._loaded.program(*(request[name] for name in SIGNATURE)), expected))
                except RuntimeError:
                    assert kv.last_error(package.runtime_name)[0] == step.get(TRACE_KEYS["expect_error"]), step
        finally:
            torch.cuda.set_sync_debug_mode("default")
        stats = package.stats()
    assert stats["offloads"] > 0 and stats["onboards"] > 0
    tolerance = json.loads((cuda_artifact / "manifest.json").read_text())["tolerance"]
    assert len(runs) == sum(TRACE_KEYS["expect_error"] not in step for step in steps)
    for logits, expected in runs:
        torch.testing.assert_close(logits.cpu(), expected, rtol=tolerance["rtol"], atol=tolerance["atol"])


def test_upload_puts_host_tensors_on_the_gpu_without_waiting():
    """kvexport::upload: the same values and shapes on the GPU, contiguous, each output its own
    storage (op outputs must not alias); uploads queued behind a busy stream keep their values although each
    pinned staging buffer is released at once; an empty tensor and a transposed one too."""
    from kvexport.ops import wrappers as kv

    placement = torch.empty(0, device="cuda")

    def host(seed: int) -> list[torch.Tensor]:
        return [torch.arange(5) + seed, torch.empty(0, dtype=torch.int64), (torch.arange(8).view(4, 2) + seed).t()]

    moved = kv.upload("no-runtime", host(0), placement)
    assert len({t.untyped_storage().data_ptr() for t in moved}) == 3
    for before, after in zip(host(0), moved):
        assert after.is_cuda and after.is_contiguous() and after.shape == before.shape
        assert torch.equal(after.cpu(), before)
    torch.cuda._sleep(100_000_000)  # the uploads below wait behind this on the stream
    uploads = [kv.upload("no-runtime", host(seed), placement) for seed in range(200)]
    assert not torch.cuda.current_stream().query()  # queued, not waited for: the sleep still runs
    for seed, upload in enumerate(uploads):
        for before, after in zip(host(seed), upload):
            assert torch.equal(after.cpu(), before), seed


def test_a_batch_goes_to_the_gpu_in_one_aligned_copy():
    """Batch.to: the same values and shapes on the GPU (a user without history: empty item and
    action ids; a transposed context), each tensor a view of one upload starting on a 128-byte
    boundary; uploads queued behind a busy stream keep their values although each staging buffer
    is freed at once; a batch that is not all int64 moves tensor by tensor."""
    from kvexport.model.batch import Batch

    def batch(seed: int) -> Batch:
        return Batch(
            torch.tensor([seed, seed + 1]),
            torch.tensor([0, 3]),
            torch.arange(3) + seed,
            torch.arange(3) % 4,
            (torch.arange(8).view(4, 2) + seed).t(),
            torch.tensor([1, 2]),
            torch.arange(3) + 9 * seed,
        )

    moved = batch(0).to("cuda")
    assert len({t.untyped_storage().data_ptr() for t in moved.tensors()}) == 1
    for before, after in zip(batch(0).tensors(), moved.tensors()):
        assert after.is_cuda and after.shape == before.shape and torch.equal(after.cpu(), before)
        assert after.data_ptr() % 128 == 0
    torch.cuda._sleep(100_000_000)  # the uploads below wait behind this on the stream
    uploads = [batch(seed).to("cuda") for seed in range(200)]
    for seed, upload in enumerate(uploads):
        for before, after in zip(batch(seed).tensors(), upload.tensors()):
            assert torch.equal(after.cpu(), before), seed
    mixed = Batch(*(t.float() if i == 2 else t for i, t in enumerate(batch(1).tensors()))).to("cuda")
    assert len({t.untyped_storage().data_ptr() for t in mixed.tensors()}) == 7
