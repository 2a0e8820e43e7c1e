"""The recorded trace of `kvexport build`: a scripted request sequence and its expected outputs.

Each step stores the request and two independent expectations: the eager model's cached path
(a runtime of its own) and the eager full recompute. Beside it, the full recompute of a float32
copy of the model is the reference both are measured against; that measurement sets the build's
tolerance. With FP8 pages every one of these attends over FP8-rounded keys and values, and a third
reference, the float32 model with unrounded ones, measures what the rounding costs (the manifest's
fp8_distance; a build past FP8_MAX_RELATIVE_ERROR is refused). The script exercises cold users,
appended events, zero new events, a rewritten history, a changed context, a user evicted to the
host tier and onboarded back, and batch sizes 1 and max_batch_size.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path

import torch

from kvexport.artifact import TRACE_KEYS
from kvexport.cached import CachedRanker
from kvexport.config import Config
from kvexport.errors import UserError
from kvexport.io import load_tensor_file
from kvexport.model import Batch
from kvexport.model.hstu import HSTURanker
from kvexport.ops import wrappers as kv
from kvexport.ops.manager import KVCacheManager
from kvexport.progress import Progress
from kvexport.trace.workload import Workload, WorkloadSpec, context_keys_of, item_keys_of

log = logging.getLogger(__name__)

# Tensor and step keys of the trace files, as kvexport/contract.json names them (the harness too).
EXPECTED_CACHED = TRACE_KEYS["expected_cached"]
EXPECTED_FULL = TRACE_KEYS["expected_full"]
EXPECTED_REFERENCE = TRACE_KEYS["expected_reference"]
# With FP8 pages: the float32 model with unrounded keys and values, the third reference (the FP8
# pages' accuracy cost is the distance from it; docs/design.md §2.7).
EXPECTED_UNROUNDED = TRACE_KEYS["expected_unrounded"]
# A model with FP8 pages is refused when its logits lie further than this from the unrounded model's
# on the trace: max |fp8 - unrounded| / max |unrounded| over a step's logits (docs/design.md §2.7).
FP8_MAX_RELATIVE_ERROR = 0.05


CAPACITY_ERROR = "capacity_exceeded"  # the runtime's error code (kvexport::last_error) the step must give


@dataclasses.dataclass(frozen=True)
class TraceStep:
    description: str
    batch: Batch
    expect_error: str = ""


def _trace_workload(config: Config, model: HSTURanker) -> Workload:
    t = config.trace
    spec = WorkloadSpec.from_trace_config(t, t.num_users, rewrite_fraction=0.0)
    return Workload(config.model, spec, seed=t.seed, item_keys=item_keys_of(model), context_keys=context_keys_of(model))


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


class _Script:
    """Builds the step list while running the eager cached path, so eviction can be observed.
    Requests and outputs are kept on the CPU, where the cached path takes its request whatever the
    model's device."""

    def __init__(self, config: Config, model: HSTURanker, cache: KVCacheManager):
        self.config, self.model, self.cache = config, model, cache
        self.cached = CachedRanker(model, cache.name)
        self.workload = _trace_workload(config, model)
        self.steps: list[tuple[TraceStep, torch.Tensor | None]] = []
        self.next_user = 0
        self.progress = Progress("trace (eager cached path)", None, log)

    def run(self, description: str, users: list[int], new_events: int | None = None) -> None:
        requests = []
        for user_id in users:
            user = self.workload.users.get(user_id)
            if user is None:
                user = self.workload.new_user(user_id)
            elif new_events is not None:
                self.workload.grow(user, new_events)
            requests.append(self.workload.request(user, self.config.trace.num_candidates))
        batch = Batch.concat(requests)
        with torch.no_grad():
            cached = self.cached.run(batch).cpu()
        self.steps.append((TraceStep(description, batch), cached))
        self.progress.step()

    def run_expecting_error(self, description: str, users: list[int], error: str) -> None:
        """A request that must fail (and leave the cache untouched); recorded without outputs."""
        m = self.config.model
        requests = []
        for user_id in users:
            user = self.workload.new_user(user_id, num_events=m.max_history_length)
            requests.append(self.workload.request(user, 1))
        batch = Batch.concat(requests)
        before = self.cache.stats()
        try:
            with torch.no_grad():
                self.cached.run(batch)
        except ValueError:
            if kv.last_error(self.cache.name)[0] != error:
                raise
        else:
            raise RuntimeError(f"kvexport bug: trace step '{description}' did not fail")
        if self.cache.stats() != before:
            raise RuntimeError("kvexport bug: a failed batch changed the cache runtime's state")
        for user_id in users:
            del self.workload.users[user_id]
        self.steps.append((TraceStep(description, batch, error), None))
        self.progress.step()

    def fresh_users(self, count: int) -> list[int]:
        users = list(range(self.next_user, self.next_user + count))
        self.next_user += count
        return users


def script_steps(
    config: Config, model: HSTURanker, cache: KVCacheManager
) -> list[tuple[TraceStep, torch.Tensor | None]]:
    """The scripted sequence, with the eager cached output of each step."""
    s = _Script(config, model, cache)
    max_batch = config.serving.max_batch_size
    first = s.fresh_users(max_batch)
    s.run(f"cold users, batch {max_batch}", first)
    s.run("warm user, appended events", first[:1], new_events=config.trace.max_new_events)
    s.run("warm user, zero new events", first[:1], new_events=0)
    s.run("warm user, a single new event", first[1:2], new_events=1)
    if len(first) > 2:
        s.workload.rewrite(s.workload.users[first[2]], "edit")
        s.run("rewritten history (an edited event)", first[2:3], new_events=0)
    s.workload.rewrite(s.workload.users[first[-1]], "context")
    s.run("changed context", first[-1:], new_events=1)
    watched = first[0]
    for _ in range(64):  # cold users push the watched user out to the host tier
        if watched not in s.cache.device_users_lru():
            break
        s.run(f"cold users, batch {max_batch} (cache pressure)", s.fresh_users(max_batch))
    if watched in s.cache.device_users_lru():
        log.warning(
            "trace: the device tier (%d pages) never evicted user %d; onboarding is not exercised",
            config.kv_cache.device_pages,
            watched,
        )
    evicted = watched not in s.cache.device_users_lru()
    s.run(
        "evicted user returns (onboard from host tier)" if evicted else "returning user (never evicted)",
        [watched],
        new_events=2,
    )
    mixed = [watched, *first[1 : max_batch - 1], *s.fresh_users(1)][:max_batch]
    s.run(f"mixed warm and cold users, batch {len(mixed)}", mixed, new_events=1)
    s.run("batch 1, zero new events", [watched], new_events=0)
    over_capacity = _over_capacity_users(config)
    if over_capacity:
        s.run_expecting_error(
            f"{over_capacity} users at max history exceed device tier (must fail)",
            s.fresh_users(over_capacity),
            CAPACITY_ERROR,
        )
        s.run("after the capacity error, a warm user", [watched], new_events=1)
    else:
        log.info("trace: every valid batch fits the device tier; no capacity-error step")
    return s.steps


def _over_capacity_users(config: Config) -> int:
    """Fewest users at max history whose pages exceed the device tier, if a valid batch can."""
    m, c = config.model, config.kv_cache
    pages_per_user = c.pages_for(m.max_prefix_length)
    needed = c.device_pages // pages_per_user + 1
    return needed if needed <= config.serving.max_batch_size else 0


@dataclasses.dataclass(frozen=True)
class RecordedTrace:
    """What record_trace wrote: the manifest's step list, and the eager model's own error."""

    steps: list[dict]
    eager_error: float  # max |eager output - float32 reference| over the trace, cached and full path
    # FP8 pages only: the eager outputs' distance from the unrounded float32 model (fp8_distance).
    unrounded_distance: dict | None = None

    def tolerance(self, dtype: str, margin: float, atol_floor: dict[str, float], rtol: float) -> dict[str, float]:
        """The verify/replay tolerance: atol = margin * eager_error, never below the dtype's floor;
        recorded with the measurement it came from."""
        return {
            "atol": max(margin * self.eager_error, atol_floor[dtype]),
            "rtol": rtol,
            "measured_max_abs_error": self.eager_error,
            "margin": margin,
            "atol_floor": atol_floor[dtype],
        }


def reference_model(model: HSTURanker) -> HSTURanker:
    """A float32 copy of the model: the reference every output is measured against."""
    return copy.deepcopy(model).float()


def unrounded_model(model: HSTURanker) -> HSTURanker:
    """A float32 copy of the model that attends over unrounded keys and values (FP8 pages' yardstick)."""
    unrounded = reference_model(model)
    unrounded.round_kv = None
    return unrounded


class Fp8Distance:
    """The eager outputs' distance from the unrounded float32 model over a trace."""

    def __init__(self):
        self.max_abs = self.max_relative = 0.0

    def add(self, unrounded: torch.Tensor, *outputs: torch.Tensor) -> None:
        if unrounded.numel() == 0:
            return
        scale = float(unrounded.abs().max())
        error = max_abs_error(unrounded, *outputs)
        self.max_abs = max(self.max_abs, error)
        self.max_relative = max(self.max_relative, error / scale if scale > 0 else 0.0)

    def report(self) -> dict:
        return {
            "max_abs": self.max_abs,
            "max_relative": self.max_relative,
            "bound_max_relative": FP8_MAX_RELATIVE_ERROR,
        }

    def check(self, name: str) -> None:
        """Refuses FP8 pages whose error passes the documented bound (the user's choice to change)."""
        if self.max_relative > FP8_MAX_RELATIVE_ERROR:
            raise UserError(
                f"{name}: FP8 pages move the logits {self.max_relative:.3g} (relative) from the "
                f"unrounded model, past the bound {FP8_MAX_RELATIVE_ERROR}; use kv_cache.dtype "
                "of the model's dtype"
            )


def max_abs_error(reference: torch.Tensor, *outputs: torch.Tensor) -> float:
    """Largest |output - reference| of one step over the given outputs (0 for an empty step)."""
    if reference.numel() == 0:
        return 0.0
    return max(float((out.float() - reference.float()).abs().max()) for out in outputs)


def record_trace(config: Config, model: HSTURanker, trace_dir: Path) -> RecordedTrace:
    """Runs the script, writes trace_dir/step_NNNN.pt and step_NNNN.reference.pt, returns the
    manifest's step list and the eager model's error against its float32 copy."""
    device = model_device(model)
    cache = KVCacheManager(config, runtime_name=f"{config.name}@trace", device=device)
    cache.reset()
    try:
        steps = script_steps(config, model, cache)
        stats = cache.stats()
    finally:
        cache.close()
    trace_dir.mkdir(parents=True, exist_ok=True)
    reference = reference_model(model)
    unrounded = unrounded_model(model) if model.round_kv is not None else None
    distance = Fp8Distance()
    entries, worst = [], 0.0
    progress = Progress("trace (full recompute, float32 reference)", len(steps), log)
    for i, (step, cached) in enumerate(steps):
        name = f"step_{i:04d}"
        entry = {
            TRACE_KEYS["file"]: f"{trace_dir.name}/{name}.pt",
            TRACE_KEYS["description"]: step.description,
            "batch_size": step.batch.batch_size,
            "num_candidates": int(step.batch.num_candidates.sum()),
        }
        tensors = step.batch.to_dict()
        if step.expect_error:
            entry[TRACE_KEYS["expect_error"]] = step.expect_error
        else:
            with torch.no_grad():
                request = step.batch.to(device)
                full, expected = model(request).cpu(), reference(request).cpu()
            worst = max(worst, max_abs_error(expected, cached, full))
            tensors.update({EXPECTED_CACHED: cached.contiguous(), EXPECTED_FULL: full.contiguous()})
            references = {EXPECTED_REFERENCE: expected.contiguous()}
            if unrounded is not None:
                with torch.no_grad():
                    references[EXPECTED_UNROUNDED] = unrounded(request).cpu().contiguous()
                distance.add(references[EXPECTED_UNROUNDED], cached, full)
            # A file of its own: the step file's other keys are the request (load_trace_step reads them so).
            entry[TRACE_KEYS["reference_file"]] = f"{trace_dir.name}/{name}.reference.pt"
            torch.save(references, trace_dir / f"{name}.reference.pt")
        torch.save(tensors, trace_dir / f"{name}.pt")
        entries.append(entry)
        progress.step()
    progress.finish()
    log.info(
        "  trace: %d steps; eager cache counters %s; eager vs float32 reference: max abs error %.3g",
        len(entries),
        {
            k: v
            for k, v in stats.items()
            if k in ("hit_tokens", "device_evictions", "offloads", "onboards", "prefix_truncations")
        },
        worst,
    )
    if unrounded is None:
        return RecordedTrace(entries, worst)
    log.info(
        "  trace: FP8 pages vs the unrounded float32 model: max abs %.3g, max relative %.3g",
        distance.max_abs,
        distance.max_relative,
    )
    distance.check(config.name)
    return RecordedTrace(entries, worst, distance.report())


def load_trace_step(path: Path, expect_outputs: bool = True):
    """A recorded step: request tensors, expected cached output, expected full-recompute output.

    Steps that must fail (expect_outputs=False) carry the request only; both expectations are None.
    """
    data = load_tensor_file(path, "trace file")
    if not isinstance(data, dict):
        raise UserError(f"trace file {path} must hold a dict of tensors")
    if expect_outputs and (EXPECTED_CACHED not in data or EXPECTED_FULL not in data):
        raise UserError(f"trace file {path} lacks its expected outputs")
    request = {k: v for k, v in data.items() if k not in (EXPECTED_CACHED, EXPECTED_FULL)}
    return request, data.get(EXPECTED_CACHED), data.get(EXPECTED_FULL)
