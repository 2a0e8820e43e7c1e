"""Scoring a user's request file in order (`kvexport run`): every batch checked first, one entry
per batch written, a refused batch recorded and the rest still scored."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from kvexport.artifact import open_artifact
from kvexport.errors import RequestError, UserError
from kvexport.host.requests import check_batch
from kvexport.io import first_line, load_tensor_file, write_atomically
from kvexport.model.batch import Batch
from kvexport.remote import DEFAULT_WRITE_POLICY

log = logging.getLogger(__name__)

OK = "ok"  # status of a batch that was scored; any other status is the error that refused it


def load_requests(path: Path, config) -> list:
    """Reads and validates every batch before any runs (a bad file leaves no output and no cache change)."""
    raw = load_tensor_file(path, "request file")
    if not isinstance(raw, (list, tuple)):
        raise RequestError(f"request file {path} must hold a list of batches, got {type(raw).__name__}")
    if not raw:
        raise RequestError(f"request file {path} holds no batches")
    return [check_batch(batch, config, index) for index, batch in enumerate(raw)]


def _score_batch(package, batch: Batch, index: int) -> dict:
    """One batch's entry of the output file; a refused batch (UserError) is recorded, not raised,
    so the batches before and after it keep their outputs (a refused batch leaves the cache as it was)."""
    rows = batch.user_ids.repeat_interleave(batch.num_candidates)
    try:
        logits = package.run(batch, index).contiguous()
    except UserError as exc:
        log.debug("batch %d refused", index, exc_info=True)
        return {"status": first_line(exc), "logits": None, "user_ids": rows}
    return {"status": OK, "logits": logits, "user_ids": rows}


def score_request_file(
    out: Path,
    requests_path: Path,
    output_path: Path,
    *,
    remote: str | None = None,
    remote_write: str = DEFAULT_WRITE_POLICY,
) -> list[dict]:
    """Scores every batch in order and writes one entry per batch to output_path (see `kvexport run --help`).

    Every batch is validated before any runs; a batch the package refuses gets its error as status
    and no logits, and the following batches still run. Returns the entries written. remote,
    remote_write: a shared remote KV tier, as kvexport.load takes them.
    """
    from kvexport.host.package import load

    artifact = open_artifact(out)
    if not output_path.resolve().parent.is_dir():
        raise UserError(f"cannot write output {output_path}: its directory does not exist")
    # Files are not hashed here (`kvexport verify` does); the shipped op library is still checked.
    # Loaded before the requests are checked: the check is that library's (a portable build's own).
    with load(artifact, check_files=False, remote=remote, remote_write=remote_write) as package:
        batches = load_requests(requests_path, artifact.config)
        results = [_score_batch(package, batch, index) for index, batch in enumerate(batches)]
    write_atomically(output_path, lambda tmp: torch.save(results, tmp), "output")
    return results
