"""`kvexport soak`: a seeded random workload through the package, every output checked against
the float32 full recompute of the eager model, under constant eviction, offloading and history rewrites."""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from pathlib import Path

import torch

from kvexport.artifact import Artifact, open_artifact, sha256_of
from kvexport.errors import UserError
from kvexport.model import build_model
from kvexport.model.hstu import HSTURanker
from kvexport.options import SoakOptions
from kvexport.remote import DEFAULT_WRITE_POLICY
from kvexport.trace.record import reference_model
from kvexport.trace.verify import check_integrity, compare
from kvexport.trace.workload import Workload, WorkloadSpec, context_keys_of, item_keys_of

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SoakReport:
    requests: int
    users: int
    seed: int
    mismatches: int
    first_mismatch: int | None
    worst_abs: float
    counters: dict[str, int]
    workload: dict[str, int]
    seconds: float
    route: str = "0/1"  # this process's share of the stream: process I of N

    @property
    def passed(self) -> bool:
        return self.mismatches == 0

    @property
    def remote_hit_ratio(self) -> float | None:
        return remote_hit_ratio(self.counters)

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "passed": self.passed, "remote_hit_ratio": self.remote_hit_ratio}


def remote_hit_ratio(counters: dict[str, int]) -> float | None:
    """Of the users read from the remote tier, the share served from it (None: none was read).

    Every remote read of a user ends as a hit, a miss (absent, or the server failed) or a rejection
    (a bad, foreign or unrelated entry).
    """
    looked_up = counters["remote_hits"] + counters["remote_misses"] + counters["remote_rejected"]
    return counters["remote_hits"] / looked_up if looked_up else None


def eager_model_for(artifact: Artifact, checkpoint: Path | None) -> HSTURanker:
    """The eager model with the weights the package was built from (checked by sha256)."""
    weights = artifact.manifest.weights
    config = artifact.config
    if weights["source"] == "checkpoint":
        if checkpoint is None:
            raise UserError(f"{artifact.root} was built from a checkpoint; pass the same file with --checkpoint")
        if not Path(checkpoint).is_file():
            raise UserError(f"checkpoint {checkpoint} does not exist")
        if sha256_of(checkpoint) != weights["sha256"]:
            raise UserError(f"checkpoint {checkpoint} is not the one {artifact.root} was built from (sha256 differs)")
        return build_model(config, checkpoint)
    if checkpoint is not None:
        raise UserError(f"{artifact.root} was built from seeded weights, not a checkpoint; drop --checkpoint")
    return build_model(config, seed=weights["seed"])


def _largest_safe_batch(artifact: Artifact, max_history: int) -> int:
    """Most users per batch that always fit the device tier at the workload's longest history."""
    m, c = artifact.config.model, artifact.config.kv_cache
    pages = c.pages_for(m.prefix_length(max_history))
    return max(1, min(artifact.config.serving.max_batch_size, c.device_pages // pages))


def soak(
    out: Path,
    options: SoakOptions,
    checkpoint: Path | None = None,
    *,
    remote: str | None = None,
    remote_write: str = DEFAULT_WRITE_POLICY,
) -> SoakReport:
    """Scores the seeded stream of options.num_requests requests, each checked against the float32
    full recompute.

    remote, remote_write: a shared remote KV tier, as kvexport.load takes them. options.route (I, N):
    score only the requests a seeded router sends to process I of N; N processes with the same seed
    and remote tier together score the whole stream, each user's requests landing on any of them.
    """
    from kvexport.host.package import load

    num_requests, num_users, seed, route = options.num_requests, options.num_users, options.seed, options.route
    if num_requests < 1 or num_users < 1:
        raise UserError("--requests and --users must be >= 1")
    if not 0 <= route[0] < route[1]:
        raise UserError(f"--route {route[0]}/{route[1]}: expected I/N with 0 <= I < N")
    artifact = open_artifact(out)
    check_integrity(artifact)
    model = eager_model_for(artifact, checkpoint)
    with load(
        artifact,
        check_files=False,
        remote=remote,  # files checked just above
        remote_write=remote_write,
    ) as runner:
        return _soak(artifact, runner, model, num_requests, num_users, seed, route)


def _soak(
    artifact: Artifact, runner, model, num_requests: int, num_users: int, seed: int, route: tuple[int, int]
) -> SoakReport:
    t = artifact.config.trace
    spec = WorkloadSpec.from_trace_config(t, num_users, rewrite_fraction=0.1)
    workload = Workload(
        artifact.config.model, spec, seed, item_keys=item_keys_of(model), context_keys=context_keys_of(model)
    )
    sizes = random.Random(seed + 1)
    router = random.Random(seed + 2)  # drawn for every request, so all N processes agree
    max_batch = min(_largest_safe_batch(artifact, spec.max_history_length), num_users)
    tol = artifact.tolerance
    # The float32 recompute on the package's device: what the tolerance was measured against.
    reference = reference_model(model).to(runner.device)
    mismatches, first, worst, scored = 0, None, 0.0, 0
    started = time.perf_counter()
    for index in range(num_requests):
        batch = workload.next_batch(sizes.randint(1, max_batch))
        if router.randrange(route[1]) == route[0]:
            scored += 1
            output = runner.score(batch).cpu()
            with torch.no_grad():
                expected = reference(batch.to(runner.device)).cpu()
            result = compare(output, expected, tol["atol"], tol["rtol"])
            worst = max(worst, result.max_abs)
            if not result.passed:
                mismatches += 1
                first = index if first is None else first
                log.error("request %d: max abs error %.3g outside tolerance", index, result.max_abs)
        if (index + 1) % max(1, num_requests // 10) == 0:
            log.info(
                "soak: %d/%d requests, worst abs error %.2e, %d mismatches", index + 1, num_requests, worst, mismatches
            )
    return SoakReport(
        scored,
        num_users,
        seed,
        mismatches,
        first,
        worst,
        runner.stats(),
        dict(workload.events),
        round(time.perf_counter() - started, 2),
        f"{route[0]}/{route[1]}",
    )
