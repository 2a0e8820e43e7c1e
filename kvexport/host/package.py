"""The Python API of a built package: `kvexport.load(OUT)` returns a `Package`.

    with kvexport.load("artifacts/hstu-tiny") as pkg:
        logits = pkg.score(batch)                 # seven int64 tensors (docs/hosting.md, Requests)
        per_user = pkg.score_users([request, ...])  # one dict per user, merged into one batch
        counters = pkg.stats()                  # named cache counters

The CLI's verify, run and soak score through the same class. Loading (checks, the op library,
the programs, the cache runtime) is kvexport.host.loading's; a Package scores what it loaded.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvexport.artifact import Artifact, open_artifact
from kvexport.config import Config
from kvexport.errors import RequestError, RequestFailed, UserError
from kvexport.host.loading import attach_remote, load_package
from kvexport.host.requests import check_structure, check_user_request, where
from kvexport.model.batch import Batch, UserRequest
from kvexport.ops import wrappers as kv
from kvexport.remote import DEFAULT_WRITE_POLICY, FLUSH_TIMEOUT_MS, check_write_policy

log = logging.getLogger(__name__)


class Package:
    """A loaded model.pt2 with its cache runtime: the object `kvexport.load` returns.

    Thread-safe: any number of threads may call score / score_users / stats at once; requests are
    serialised inside the cache runtime (docs/hosting.md, *Threads*). close() waits for requests in
    flight, then drops the runtime.

    The runtime is named after the package's name, config and weights and is shared by every copy
    of the same package in this process: loading one empties it, closing one drops it (a copy still
    open keeps scoring correctly and starts from an empty cache).
    """

    def __init__(
        self,
        artifact: Artifact,
        device: torch.device | str | None = None,
        *,
        check_files: bool = False,
        remote: str | None = None,
        remote_write: str = DEFAULT_WRITE_POLICY,
        step_program: bool = True,
        cuda_graphs: bool = True,
    ):
        self._loaded = load_package(
            artifact,
            device,
            check_files=check_files,
            remote=remote,
            remote_write=remote_write,
            step_program=step_program,
            cuda_graphs=cuda_graphs,
        )
        self.artifact = artifact
        self._state = threading.Condition()
        self._in_flight = 0
        self._closed = False

    # -- what the package is ------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The model's name (the config's `name`)."""
        return self.artifact.manifest.name

    @property
    def runtime_name(self) -> str:
        """The cache runtime's name: the argument of kvexport::last_error and the management ops."""
        return self.artifact.runtime_name

    @property
    def config(self) -> Config:
        """The build config (frozen)."""
        return self.artifact.config

    @property
    def max_batch_size(self) -> int:
        """Most users per request (serving.max_batch_size)."""
        return self.config.serving.max_batch_size

    @property
    def num_tasks(self) -> int:
        """Columns of the logits."""
        return self.config.model.num_tasks

    @property
    def signature(self) -> dict[str, Any]:
        """{"inputs": [{"name", "dtype", "shape"}, ...], "output": {...}} from the manifest (a copy)."""
        return copy.deepcopy(self.artifact.manifest.signature)

    @property
    def device(self) -> torch.device:
        """Where the package runs: the device it was built for."""
        return self._loaded.device

    @property
    def path(self) -> Path:
        """The artifact directory."""
        return self.artifact.root

    @property
    def cuda_graphs(self) -> int:
        """CUDA graphs of the step program captured and kept (0 without a step program or a GPU)."""
        step = self._loaded.step
        return step.num_graphs if step is not None else 0

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def remote(self) -> str | None:
        """The remote tier's URL while it is attached, its credentials as ***; None without one (or
        when its server did not answer at load time)."""
        return self._loaded.remote

    def attach_remote(self, url: str, write_policy: str = DEFAULT_WRITE_POLICY) -> str | None:
        """Attaches a shared remote KV tier to a loaded package, as kvexport.load(remote=...) does at
        load time: for a host that warms the package up first, so that its synthetic users never
        reach the tier other hosts share. Returns the URL (credentials as ***), or None when the
        server did not answer. A bad URL or policy, a server that refuses the connection, a tier
        attached already: UserError (a bad URL or a refusal also drops the runtime: load the
        package again)."""
        check_write_policy(write_policy)
        if self._loaded.remote is not None:
            raise UserError(f"a remote tier is attached already: {self._loaded.remote}")
        self._loaded.remote = attach_remote(self.runtime_name, url, write_policy)
        return self._loaded.remote

    # -- scoring -----------------------------------------------------------------------------

    def score(self, batch: Batch | dict[str, torch.Tensor], index: int | None = None) -> torch.Tensor:
        """Scores one request: a Batch or a dict of the seven int64 tensors of docs/hosting.md,
        *Requests*. Returns float32 logits [sum(num_candidates), num_tasks], candidates in
        input order. The cache carries over to the next call.

        A refused request raises RequestFailed with the runtime's code: RequestError ("invalid_request",
        found by the package's own check before the request runs) or "capacity_exceeded" /
        "internal" from the package. The cache is left as it was and the next request is served.
        `index`, when given, prefixes error messages with `batch {index}: `.
        """
        with self._request():
            return self._score(batch, index)

    def score_users(self, requests: Sequence[dict[str, Any] | UserRequest]) -> list[torch.Tensor]:
        """Scores several users in one request; returns each user's logits [T, num_tasks], in input order.

        Each request is a dict: user_id (int, or a one-element integer tensor), item_ids [h],
        action_ids [h], context_ids [num_contextual_features, then the query time with an item_tower
        head], candidate_ids [T] (int64 tensors; a
        UserRequest also does). Users must be distinct, 1 to max_batch_size of them, or RequestError.
        The returned tensors are views of the batch's logits.
        """
        with self._request():
            if not isinstance(requests, (list, tuple)):
                raise RequestError(f"score_users takes a list of requests, got {type(requests).__name__}")
            if not requests:
                raise RequestError("score_users got no requests")
            if len(requests) > self.max_batch_size:
                raise RequestError(
                    f"score_users got {len(requests)} requests; the package takes at most "
                    f"{self.max_batch_size} users per request (max_batch_size)"
                )
            users = [check_user_request(raw, self.config, i) for i, raw in enumerate(requests)]
            first: dict[int, int] = {}
            for i, user in enumerate(users):
                if user.user_id in first:
                    raise RequestError(
                        f"requests {first[user.user_id]} and {i} are both user {user.user_id}; "
                        "each user may appear once per request"
                    )
                first[user.user_id] = i
            logits = self._run(Batch.concat(users))
            return list(logits.split([len(u.candidate_ids) for u in users]))

    def run(self, batch: Batch, index: int | None = None) -> torch.Tensor:
        """Scores a Batch whose structure is checked (kvexport.host.requests.check_structure or
        check_batch): the low-level call of score, whose refusals it raises too. The package checks
        the values itself."""
        with self._request():
            return self._run(batch, index)

    def stats(self) -> dict[str, int]:
        """The cache runtime's named counters and occupancy (kvexport::runtime_stats, names as stat_names)."""
        with self._request():
            return kv.runtime_stats(self.runtime_name)

    def reset(self) -> None:
        """Empties the cache runtime (device and host tiers; the remote tier is shared and left as it
        is) and zeroes its counters: for a host that warms the package up before real traffic."""
        with self._request():
            kv.reset_runtime(self.runtime_name)

    # -- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Waits for requests in flight, then for the remote tier's queued writes (at most
        kvexport.remote.FLUSH_TIMEOUT_MS; what is left is dropped, with a warning), then drops the
        cache runtime and the loaded package.

        Idempotent; afterwards score, score_users, run and stats raise UserError("package closed").
        """
        with self._state:
            if self._closed:
                return
            self._closed = True
            self._state.wait_for(lambda: self._in_flight == 0)
        remote = self._loaded.remote
        if remote is not None and not kv.flush_remote(self.runtime_name, FLUSH_TIMEOUT_MS):
            log.warning("remote tier %s: writes still queued after %d ms were dropped", remote, FLUSH_TIMEOUT_MS)
        kv.drop_runtime(self.runtime_name)
        self._loaded.program = self._loaded.step = None

    def __enter__(self) -> Package:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<kvexport.Package {self.name} at {self.path} on {self._loaded.device} ({state})>"

    # -- internals ---------------------------------------------------------------------------

    def _request(self):
        return _InFlight(self)

    def _score(self, batch: Batch | dict[str, torch.Tensor], index: int | None = None) -> torch.Tensor:
        return self._run(check_structure(batch, index), index)

    def _run(self, batch: Batch, index: int | None = None) -> torch.Tensor:
        """The request's one value check is the package's own (model.pt2's check_request, or the
        step runner's before it plans); a refusal's code and message come from the runtime."""
        try:
            step = self._loaded.step
            if step is not None:
                return step.run(batch)
            return self._loaded.program(*batch.tensors())
        except (RuntimeError, ValueError) as exc:  # ValueError: the step path's host ops refused it
            # Why comes from the runtime, never from the exception's text (it differs between torch versions).
            code, message = kv.last_error(self.runtime_name)
            if code == "ok":
                raise
            if code == "invalid_request":
                raise RequestError(f"{where(index)}{message}") from exc
            raise RequestFailed(code, message) from exc


class _InFlight:
    """Counts a call in flight, so close() waits for it; refuses calls on a closed package."""

    __slots__ = ("package",)

    def __init__(self, package: Package):
        self.package = package

    def __enter__(self) -> None:
        p = self.package
        with p._state:
            if p._closed:
                raise UserError(f"package closed: {p.path} (load it again to score)")
            p._in_flight += 1

    def __exit__(self, *exc_info) -> None:
        p = self.package
        with p._state:
            p._in_flight -= 1
            if p._in_flight == 0:
                p._state.notify_all()


def load(
    out: str | Path | Artifact,
    device: torch.device | str | None = None,
    *,
    check_files: bool = True,
    remote: str | None = None,
    remote_write: str = DEFAULT_WRITE_POLICY,
    step_program: bool = True,
    cuda_graphs: bool = True,
) -> Package:
    """Loads a built artifact directory (`kvexport build -o OUT`) into this process.

    device: None runs the package on the device it was built for (the manifest's, e.g. "cuda");
    "cuda:1" picks a GPU for a CUDA package; a device of another type raises UserError.
    check_files: first check every file against the manifest's sha256 and the manifest against the
    package's metadata, as `kvexport verify` does (UserError / VerificationError naming the file).
    Always checked: the op library the artifact ships is the one loaded in this process.

    remote: a shared remote KV tier behind the host tier, a Redis/Valkey server at
    "redis://[[user]:password@]host[:port][/db]" (with a password, every connection authenticates;
    user: a Redis 6 ACL user; '@', ':' and '/' in them percent-encoded), shared by every process
    that loads a package of the same runtime name; remote_write: "on_evict" (users the host tier
    lets go) or "after_batch" (also every user of every committed batch). A bad URL or policy, a
    server that refuses the connection (a wrong or missing password), or an op library built
    without the remote tier: UserError, its message showing the URL's credentials as ***. A
    server that does not answer at load time: one warning, and the package runs without the tier
    (`Package.remote` is None). Read budget and entry expiry are the config's
    kv_cache.remote_read_budget_us and remote_ttl_s.

    step_program: score through the artifact's step.pt2 when it has one (CUDA packages by default;
    docs/design.md 3.9): the host plans each request and runs the device part on its own, on a GPU
    as a CUDA graph captured per bucket of sizes when cuda_graphs (at most
    kvexport.host.step_runner.MAX_GRAPHS kept). False: model.pt2 runs the whole request, as plain hosts do.

    Loading empties the cache runtime of any other copy of the same package in this process.
    """
    artifact = out if isinstance(out, Artifact) else open_artifact(out)
    return Package(
        artifact,
        device,
        check_files=check_files,
        remote=remote,
        remote_write=remote_write,
        step_program=step_program,
        cuda_graphs=cuda_graphs,
    )
