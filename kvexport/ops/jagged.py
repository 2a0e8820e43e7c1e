"""Jagged-tensor helpers: fbgemm's ops where fbgemm_gpu is importable, plain aten otherwise.

A package whose graph calls fbgemm ops needs `fbgemm_library_path()` loaded before it
(the exporter records that by name; see kvexport/export/compile.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

try:
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

    HAVE_FBGEMM = hasattr(torch.ops.fbgemm, "asynchronous_complete_cumsum")
except (ImportError, OSError) as exc:
    log.debug("fbgemm_gpu not usable (%s); jagged helpers use aten", exc)
    HAVE_FBGEMM = False

FBGEMM_LIBRARY = "fbgemm_gpu_py"


def fbgemm_library_path() -> Path | None:
    """fbgemm's op library (it pulls its siblings through $ORIGIN), or None without fbgemm."""
    if not HAVE_FBGEMM:
        return None
    return Path(fbgemm_gpu.__file__).parent / f"{FBGEMM_LIBRARY}.so"


def lengths_to_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """[B] lengths -> [B + 1] offsets starting at 0.

    Plain aten, never fbgemm: this runs inside exported packages, and a package that called
    fbgemm for a cumsum of B values would make every host ship fbgemm for no measurable gain.
    """
    return torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0))


def jagged_to_padded(values: torch.Tensor, offsets: torch.Tensor, max_length: int) -> torch.Tensor:
    """[N, D] jagged rows with [B + 1] offsets -> [B, max_length, D], zero padded."""
    if HAVE_FBGEMM:
        return torch.ops.fbgemm.jagged_to_padded_dense(values, [offsets], [max_length], 0.0)
    lengths = offsets[1:] - offsets[:-1]
    index, valid = _padded_index(offsets, lengths, max_length)
    return values[index] * valid.unsqueeze(-1).to(values.dtype)


def padded_to_jagged(padded: torch.Tensor, offsets: torch.Tensor, total_length: int) -> torch.Tensor:
    """[B, L, D] padded -> [N, D] jagged rows with [B + 1] offsets."""
    if HAVE_FBGEMM:
        return torch.ops.fbgemm.dense_to_jagged(padded, [offsets], total_length)[0]
    lengths = offsets[1:] - offsets[:-1]
    _, valid = _padded_index(offsets, lengths, padded.shape[1])
    return padded[valid]


def _padded_index(offsets: torch.Tensor, lengths: torch.Tensor, max_length: int):
    steps = torch.arange(max_length, device=offsets.device)
    valid = steps.unsqueeze(0) < lengths.unsqueeze(1)  # [B, L]
    index = torch.where(valid, offsets[:-1].unsqueeze(1) + steps, 0)
    return index, valid
