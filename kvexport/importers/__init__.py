"""Reading checkpoints as other trainers write them (docs/importers.md)."""

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

    config: dict[str, Any]           # a kvexport config file's mapping
    state_dict: dict[str, torch.Tensor]
    notes: list[str]                 # one line each: what was derived and from where


def kv_cache_section(longest_prefix: int) -> dict[str, int]:
    """An imported config's cache: pages of 32 tokens, room for 8 users at their longest prefix on
    the device tier and 32 on the host tier."""
    pages = -(-longest_prefix // 32)
    return {"page_size": 32, "device_pages": 8 * pages, "host_pages": 32 * pages}
