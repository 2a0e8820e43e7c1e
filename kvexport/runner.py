"""Scores requests through a built package (Python side): the runner of verify, run and soak."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from kvexport.artifact import LIB_DIR, Artifact, sha256_of
from kvexport.errors import RequestFailed, UserError
from kvexport.io import first_line, load_tensor_file
from kvexport.model.batch import Batch, check_batch
from kvexport.native import OPS_LIBRARY_NAME
from kvexport.ops import jagged, library
from kvexport.ops import wrappers as kv
from kvexport.trace.record import EXPECTED_CACHED, EXPECTED_FULL

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _loaded_library_digest(loaded: Path) -> str:
    return sha256_of(loaded)  # the loaded .so cannot change within a process


def _check_shipped_library(artifact: Artifact, loaded: Path) -> None:
    """Python runs the package with the op library loaded in this process; it must be the one
    the artifact ships (lib/), or verification would not test what is deployed."""
    shipped = artifact.root / LIB_DIR / OPS_LIBRARY_NAME
    if not shipped.is_file():
        raise UserError(f"artifact {artifact.root} is incomplete: {LIB_DIR}/{OPS_LIBRARY_NAME} is missing")
    if sha256_of(shipped) != _loaded_library_digest(loaded):
        raise UserError(f"{shipped} differs from the op library loaded here ({loaded}); rebuild the artifact "
                        "with this kvexport, or check it with `kvexport replay`, which uses the shipped one")


class PackageRunner:
    """One loaded model.pt2 and a fresh cache runtime for it.

    The runtime is shared with any other copy of the same package in this process (same name,
    config and weights); creating a runner empties it.
    """

    def __init__(self, artifact: Artifact):
        self.artifact = artifact
        self.config = artifact.config
        _check_shipped_library(artifact, library.load())
        if jagged.FBGEMM_LIBRARY in artifact.required_libraries and not jagged.HAVE_FBGEMM:
            raise UserError(f"{artifact.package} needs {jagged.FBGEMM_LIBRARY} but fbgemm_gpu is not importable")
        kv.drop_runtime(artifact.runtime_name)
        try:
            self.package = torch._inductor.aoti_load_package(str(artifact.package))
        except Exception as exc:  # noqa: BLE001 — any load failure means an unusable package
            raise UserError(f"cannot load {artifact.package}: {first_line(exc)}") from exc
        # The runtime config travels inside the package, like the C++ harness reads it.
        kv.create_runtime(artifact.runtime_name, self.package.get_metadata()["kvexport.runtime_config"])

    def score(self, batch: Batch | dict, index: int | None = None) -> torch.Tensor:
        """Validates one request and runs it; the cache carries over to the next call."""
        return self.run(check_batch(batch, self.config, index))

    def run(self, batch: Batch) -> torch.Tensor:
        """Runs a request through the package; the package checks it itself.

        A refused request raises RequestFailed with the runtime's code and message (never parsed
        from the exception, whose text depends on the torch version); the next request is served.
        """
        try:
            return self.package(*batch.tensors())
        except RuntimeError as exc:
            code, message = kv.last_error(self.artifact.runtime_name)
            if code == "ok":
                raise
            raise RequestFailed(code, message) from exc

    def stats(self) -> dict[str, int]:
        return kv.runtime_stats(self.artifact.runtime_name)


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
