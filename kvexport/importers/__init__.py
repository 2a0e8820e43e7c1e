"""Reading checkpoints as other trainers write them (docs/checkpoint.md)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvexport.errors import UserError


class CheckpointImportError(UserError):
    """The trainer's checkpoint cannot be imported exactly; the message names what and why."""


@dataclasses.dataclass(frozen=True)
class Imported:
    """What `kvexport import-checkpoint` writes."""

    config: dict[str, Any]  # a kvexport config file's mapping
    state_dict: dict[str, torch.Tensor]
    notes: list[str]  # one line each: what was derived and from where


def deployment_sections(longest_prefix: int, max_history: int, max_candidates: int) -> dict[str, dict]:
    """An imported config's kv_cache, serving and trace sections, defaults to edit: pages of 32
    tokens, room for 8 users at their longest prefix on the device tier and 32 on the host tier,
    batches of 8 on the CPU, a trace of 8 users of up to 256 events."""
    pages = -(-longest_prefix // 32)
    return {
        "kv_cache": {"page_size": 32, "device_pages": 8 * pages, "host_pages": 32 * pages},
        "serving": {"max_batch_size": 8, "device": "cpu"},
        "trace": {
            "seed": 0,
            "num_users": 8,
            "min_history_length": min(16, max_history),
            "max_trace_history_length": min(256, max_history),
            "max_new_events": min(8, max_history),
            "num_candidates": min(16, max_candidates),
        },
    }
