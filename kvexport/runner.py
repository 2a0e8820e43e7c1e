"""Scoring through a built package from Python: `PackageRunner` is `kvexport.Package` under its old
name (the runner of verify, run, soak and bench), plus reading recorded trace steps."""

from __future__ import annotations

import logging
from pathlib import Path

from kvexport.errors import UserError
from kvexport.io import load_tensor_file
from kvexport.package_api import Package
from kvexport.trace.record import EXPECTED_CACHED, EXPECTED_FULL

log = logging.getLogger(__name__)

# PackageRunner(artifact) loads without the sha256 check (check_files=False), as it always did.
PackageRunner = Package


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
