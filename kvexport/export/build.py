"""`kvexport build`: config (+ checkpoint) -> OUT/{model.pt2, lib/, trace/, manifest.json}.

Everything is written into a temporary sibling directory that is renamed into place only when
every stage succeeded, so a failed or interrupted build leaves no OUT/.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from kvexport import __version__, artifact
from kvexport.cached import CachedRanker, StepProgram
from kvexport.config import Config, load_config
from kvexport.errors import UserError
from kvexport.export import selftest
from kvexport.export.compile import check_package_ops, compile_package, graph_custom_ops, required_libraries
from kvexport.export.wrap import export_cached, export_step
from kvexport.host import step_runner
from kvexport.host.package_file import check_shared_objects
from kvexport.io import cleaned_up_on_abrupt_exit, exclusive_lock, remove_stale_staging, rename_no_replace
from kvexport.model import SIGNATURE, build_model
from kvexport.native import isa, toolchain
from kvexport.native.build import build_native
from kvexport.native.paths import NATIVE_ISA, OPS_LIBRARY, OPS_LIBRARY_NAME
from kvexport.native.selftest import run_self_test
from kvexport.ops import library
from kvexport.trace.ranking import measure_ranking
from kvexport.trace.record import record_trace

log = logging.getLogger(__name__)

# How verify/replay's tolerance is derived from the build's own measurement (RecordedTrace.tolerance):
# atol = margin x the eager model's max abs error against its float32 copy over the trace.
# margin 4: the package runs other kernels (fusion, reduction order) in the same dtype, so its error
#   is of the eager one's order but not equal to it, while a 10% error in the logits (~0.1) still
#   lies several times above atol.
# atol_floor: keeps atol above 0 where the measurement is ~0 (a float32 model is its own reference):
#   about two units in the last place at |logit| ~0.1 for the 16-bit types, and for float32 room
#   for other CPUs' reduction orders (float32 rounding at |logit| ~0.1 is ~1e-8), still 10^4 below
#   a 10% error.
# rtol 0: a relative term would loosen large logits by an amount nobody measured.
# The smallest atol per dtype, so a measured error of 0 cannot make every comparison exact.
ATOL_FLOORS = {"float32": 1e-6, "bfloat16": 1e-3, "float16": 1e-4}


def _tolerance(config: Config, trace) -> dict[str, float | str]:
    """Derived from the trace's measured error (config.tolerance.margin); a config atol replaces it."""
    tol = config.tolerance
    derived = trace.tolerance(config.model.dtype, margin=tol.margin, atol_floor=ATOL_FLOORS, rtol=tol.rtol)
    if tol.atol:
        return {**derived, "atol": tol.atol, "atol_source": "config"}
    return {**derived, "atol_source": "measured"}


def versions() -> dict[str, str]:
    def installed(*names: str) -> str:
        for name in names:
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                return importlib.metadata.version(name)
        return "absent"

    return {
        "kvexport": __version__,
        "torch": torch.__version__,
        "fbgemm_gpu": installed("fbgemm-gpu-cpu", "fbgemm-gpu"),
    }


def signature(config: Config, device: str) -> dict:
    """Inputs and output with dtype, shape and device: a request is on the host whatever the
    package's device; the logits come back on the package's device."""
    m, b = config.model, "B"
    shapes = {
        "user_ids": [b],
        "history_lengths": [b],
        "item_ids": ["sum(history_lengths)"],
        "action_ids": ["sum(history_lengths)"],
        "context_ids": [b, m.context_width],
        "num_candidates": [b],
        "candidate_ids": ["sum(num_candidates)"],
    }
    return {
        "inputs": [{"name": n, "dtype": "int64", "shape": shapes[n], "device": "cpu"} for n in SIGNATURE],
        "output": {
            "name": "logits",
            "dtype": "float32",
            "shape": ["sum(num_candidates)", m.num_tasks],
            "device": torch.device(device).type,
        },
    }


def dims(config: Config) -> dict[str, int | str]:
    """The limits a request must keep, as the manifest and `kvexport inspect` show them; item_ids and
    context_ids say whether those ids are table rows or the trainer's keys (docs/design.md §1.2)."""
    m = config.model
    return {
        "max_batch_size": config.serving.max_batch_size,
        "max_history_length": m.max_history_length,
        "max_num_candidates": m.max_num_candidates,
        "num_contextual_features": m.num_contextual_features,
        "context_vocab_size": m.context_vocab_size,
        "context_ids": m.context_ids,
        "item_vocab_size": m.item_vocab_size,
        "item_ids": m.item_ids,
        "action_vocab_size": m.action_vocab_size,
        "num_tasks": m.num_tasks,
        **(
            {"head": m.head, "query_time_periods": [list(p) for p in m.query_time_periods]}
            if m.head == "item_tower"
            else {}
        ),
    }


class _Stages:
    """Logs `[i/n] name ... seconds` around each stage and keeps the timings."""

    def __init__(self, total: int):
        self.total, self.index, self.seconds = total, 0, {}

    @contextlib.contextmanager
    def stage(self, name: str, what: str):
        self.index += 1
        log.info("[%d/%d] %s: %s", self.index, self.total, name, what)
        started = time.perf_counter()
        yield
        self.seconds[name] = round(time.perf_counter() - started, 2)
        log.info("      %s done in %.1f s", name, self.seconds[name])


@contextlib.contextmanager
def _prepare_output(output: Path, force: bool):
    """Yields an empty staging directory beside output while holding output's build lock.

    One build of an output at a time: a second one fails at once naming the conflict. Staging
    directories left by builds that were killed (their process is gone) are removed first. On
    exit, however it happens, the staging directory and the lock file are gone.
    """
    if output.exists() and not force:
        raise UserError(f"{output} already exists (use --force to replace it)")
    parent = output.resolve().parent
    if not parent.is_dir():
        raise UserError(f"cannot write {output}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise UserError(f"cannot write {output}: directory {parent} is not writable")
    prefix = f".{output.name}.partial-"
    with exclusive_lock(parent / f".{output.name}.lock", f"another kvexport build is writing {output}"):
        if output.exists() and not force:  # a build that held the lock until just now finished it
            raise UserError(f"{output} already exists (use --force to replace it)")
        for stale in remove_stale_staging(parent, prefix, suffixes=("", ".old")):
            log.info("removed %s, left by a build that was killed", stale)
        staging = parent / f"{prefix}{os.getpid()}"
        try:
            staging.mkdir()
            with cleaned_up_on_abrupt_exit(lambda: shutil.rmtree(staging, ignore_errors=True)):
                yield staging
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _check_device(device: str, source: str) -> None:
    """Refuses devices this host cannot build for, naming where the device came from."""
    if device == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device cuda (from {source}): no CUDA device is visible to torch")
        if not library.has_kernels_for("cuda"):
            raise UserError(
                f"device cuda (from {source}): the op library was built without CUDA kernels "
                f"(its torch {torch.__version__} has no CUDA, or nvcc was missing); rebuild it with "
                "`python -m kvexport.native` where both are present"
            )


def _weights(checkpoint: Path | None) -> dict[str, str | int]:
    """Where the weights came from, so a later eager recompute (soak) can use the same ones."""
    if checkpoint is None:
        return {"source": "seed", "seed": 0}
    return {"source": "checkpoint", "sha256": artifact.sha256_of(checkpoint)}


def runtime_name_for(config: Config, model: torch.nn.Module) -> str:
    """The package's cache runtime name: the config's name plus a digest of its runtime config, its
    model config (scaling_seqlen and the semantics switches change the k/v too) and its weights, so
    two packages share a runtime in one process only when they compute the same k/v."""
    digest = hashlib.sha256(config.runtime_json().encode())
    digest.update(json.dumps(dataclasses.asdict(config.model), sort_keys=True).encode())
    for key, tensor in model.state_dict().items():
        digest.update(key.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return f"{config.name}-{digest.hexdigest()[:12]}"


def _compile_step_program(
    model: torch.nn.Module,
    config: Config,
    runtime_name: str,
    device: str,
    staging: Path,
    inductor_configs: dict[str, object],
) -> dict[str, object]:
    """Exports and compiles the step program (docs/design.md 3.9) to staging/step.pt2; returns
    its manifest entry."""
    program = export_step(StepProgram(model, runtime_name), config, device)
    ops = graph_custom_ops(program)
    # What a host needs to plan requests for it (kvexport/host/step_runner.py, the C++ harness).
    metadata = {
        "kvexport.version": __version__,
        "kvexport.program": "step",
        "kvexport.runtime_name": runtime_name,
        "kvexport.device": device,
        "kvexport.runtime_config": config.runtime_json(),
        "kvexport.request_limits": config.request_limits_json(),
        "kvexport.max_prefix_length": str(config.model.max_prefix_length),
        "kvexport.max_graph_rows": str(step_runner.MAX_GRAPH_ROWS),
        "kvexport.max_graphs": str(step_runner.MAX_GRAPHS),
    }
    package = compile_package(program, staging / artifact.STEP_PACKAGE, metadata, inductor_configs)
    package_ops = check_package_ops(package, ops)
    check_shared_objects(package)
    return {"package": artifact.STEP_PACKAGE, "package_ops": dict(sorted(package_ops.items()))}


def _write_artifact(config: Config, staging: Path, checkpoint: Path | None, device: str, step_program: bool) -> None:
    cpu_isa = config.serving.cpu_isa
    package_configs = isa.inductor_configs(cpu_isa)  # refuses a baseline this torch cannot honour
    stages = _Stages(total=(6 if cpu_isa == NATIVE_ISA else 7) + step_program)
    shipped_library = OPS_LIBRARY
    if cpu_isa != NATIVE_ISA:
        with stages.stage("op library", f"the op library for {cpu_isa} (serving.cpu_isa; minutes the first time)"):
            shipped_library = build_native(("kvexport_ops",), isa=cpu_isa)
    with stages.stage("model", f"{config.name} ({'checkpoint ' + str(checkpoint) if checkpoint else 'seeded init'})"):
        model = build_model(config, checkpoint)
        runtime_name = runtime_name_for(config, model)
        model = model.to(device)
        library.load()
    with stages.stage("export", f"torch.export of the KV-cached module on {device}"):
        program = export_cached(CachedRanker(model, runtime_name), config)
        ops = graph_custom_ops(program)
    with stages.stage("trace", "recording requests with eager cached, full-recompute and float32 reference outputs"):
        trace = record_trace(config, model, staging / artifact.TRACE_DIR)
        ranking = measure_ranking(config, model, torch.device(device), log) if config.kv_cache.fp8_pages else None
        if ranking is not None:
            log.info(
                "  FP8 ranking check, %d users: top-10 order kept %.4f (own dtype %.4f); drop %.4f "
                "(95%% lower end %.4f); worst task's ROC-AUC drop %.4f (%.4f)",
                ranking.users,
                ranking.top10_kept["fp8"],
                ranking.top10_kept["own"],
                ranking.top10_drop.estimate,
                ranking.top10_drop.lower,
                ranking.auc_drop.estimate,
                ranking.auc_drop.lower,
            )
            ranking.check(config.name)
        steps = trace.steps
        trace_files = artifact.hash_files(staging)
    libraries = required_libraries(ops)
    tolerance = _tolerance(config, trace)
    weights = _weights(checkpoint)
    cpu = isa.artifact_isa(cpu_isa, shipped_library)
    if torch.device(device).type == "cuda":
        cpu["gpu"] = isa.gpu_isa(device)
    metadata = {
        "kvexport.version": __version__,
        "kvexport.runtime_name": runtime_name,
        "kvexport.device": device,
        "kvexport.runtime_config": config.runtime_json(),
        "kvexport.config": json.dumps(config.to_dict(), sort_keys=True),
        "kvexport.signature": json.dumps(list(SIGNATURE)),
        "kvexport.required_libraries": json.dumps(libraries),
        "kvexport.tolerance": json.dumps(tolerance),
        "kvexport.weights": json.dumps(weights),
        "kvexport.trace_digest": artifact.trace_digest(steps, trace_files),
        "kvexport.torch_version": torch.__version__,
        "kvexport.isa": json.dumps(cpu),
    }
    with stages.stage("compile", f"AOTInductor compile and package (CPU code for {cpu_isa})"):
        package = compile_package(program, staging / artifact.PACKAGE, metadata, package_configs)
        package_ops = check_package_ops(package, ops)
        check_shared_objects(package)
    step = None
    if step_program:
        with stages.stage(
            "step program",
            "torch.export and AOTInductor compile of the request's device part (step.pt2, replayed as CUDA graphs)",
        ):
            step = _compile_step_program(model, config, runtime_name, device, staging, package_configs)
    with stages.stage("manifest", "op library copy, sha256 of every file"):
        (staging / artifact.LIB_DIR).mkdir()
        shutil.copy2(shipped_library, staging / artifact.LIB_DIR / OPS_LIBRARY_NAME)
        manifest = {
            "format_version": artifact.FORMAT_VERSION,
            "name": config.name,
            "runtime_name": runtime_name,
            "device": device,
            "isa": cpu,
            "config": config.to_dict(),
            "runtime_config": json.loads(config.runtime_json()),
            "weights": weights,
            "signature": signature(config, device),
            "dims": dims(config),
            "tolerance": tolerance,
            "versions": versions(),
            "required_libraries": libraries,
            "package_ops": dict(sorted(package_ops.items())),
            **({"step_program": step} if step else {}),
            "trace": {"steps": steps},
            **({"fp8_distance": trace.unrounded_distance} if trace.unrounded_distance else {}),
            **({"fp8_ranking": ranking.fields()} if ranking else {}),
            "files": artifact.hash_files(staging),
        }
    with stages.stage("self-test", "a refused request through the package in a fresh process"):
        (staging / artifact.MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        run_self_test(selftest.__name__, staging, toolchain.select_compiler().path)
    manifest["timings_seconds"] = stages.seconds
    (staging / artifact.MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _replace_directory(staging: Path, output: Path, force: bool) -> None:
    """Puts staging at output, never over an output that appeared during the build.

    With force an existing output is kept aside until the swap succeeded.
    """
    backup = staging.with_name(staging.name + ".old")
    if force and output.exists():
        output.rename(backup)
    try:
        rename_no_replace(staging, output)
    except BaseException as exc:
        if backup.exists():
            rename_no_replace(backup, output)
        if isinstance(exc, FileExistsError):
            raise UserError(
                f"{output} appeared during the build and was left as it is (use --force to replace it)"
            ) from exc
        raise
    shutil.rmtree(backup, ignore_errors=True)


def build_artifact(
    config_path: Path,
    output: Path,
    checkpoint: Path | None = None,
    device: str | None = None,
    force: bool = False,
    step_program: bool | None = None,
) -> Path:
    """Runs every stage into a staging directory and renames it to `output` on success.

    device defaults to the config's serving.device; step_program (step.pt2) to whether it is cuda.
    """
    config = load_config(config_path)
    source = "the --device flag" if device else f"serving.device in {config_path}"
    device = device or config.serving.device
    _check_device(device, source)
    toolchain.select_compiler()  # refuses a compiler whose packages would crash hosts, before any work
    started = time.perf_counter()
    try:
        with _prepare_output(output, force) as staging:
            _write_artifact(
                config,
                staging,
                checkpoint,
                device,
                torch.device(device).type == "cuda" if step_program is None else step_program,
            )
            _replace_directory(staging, output, force)
    except OSError as exc:  # disk full, permissions: the user's environment
        raise UserError(f"cannot write {output}: {exc.strerror or exc}") from exc
    log.info("built %s in %.1f s", output, time.perf_counter() - started)
    return output
