"""The serving signature: one Triton inference request is one user, each tensor a batch of one.

The Triton model is named after the artifact (its config's `name`) and declares the package's
max_batch_size, so every tensor carries Triton's batch dimension first, and it is 1: one request is
one user. Triton's dynamic batcher merges concurrent requests into one jagged batch (the history and
candidate dimensions may differ between requests), which kvexport.serving.batcher scores.
"""

from __future__ import annotations

import re

# (name, Triton datatype, shape): "h" events, "T" candidates; the context width and the number of
# tasks are the package's.
USER_ID, ITEM_IDS, ACTION_IDS, CONTEXT_IDS, CANDIDATE_IDS = (
    "user_id",
    "item_ids",
    "action_ids",
    "context_ids",
    "candidate_ids",
)
LOGITS = "logits"
INPUT_NAMES = (USER_ID, ITEM_IDS, ACTION_IDS, CONTEXT_IDS, CANDIDATE_IDS)


def serving_signature(name: str, context_width: int, num_tasks: int) -> dict:
    """{"model", "inputs": [{"name", "datatype", "shape"}], "output": {...}} of `kvexport serve`."""
    shapes = {
        USER_ID: [1, 1],
        ITEM_IDS: [1, "h"],
        ACTION_IDS: [1, "h"],
        CONTEXT_IDS: [1, context_width],
        CANDIDATE_IDS: [1, "T"],
    }
    return {
        "model": name,
        "inputs": [{"name": n, "datatype": "INT64", "shape": shapes[n]} for n in INPUT_NAMES],
        "output": {"name": LOGITS, "datatype": "FP32", "shape": [1, "T", num_tasks]},
    }


def from_package_signature(name: str, signature: dict) -> dict | None:
    """The serving signature of a package, from its own (manifest or metadata) signature; None when
    that signature is not the one kvexport writes (say, an edited manifest)."""
    try:
        shapes = {spec["name"]: spec["shape"] for spec in signature["inputs"]}
        return serving_signature(name, int(shapes["context_ids"][1]), int(signature["output"]["shape"][1]))
    except (KeyError, IndexError, TypeError, ValueError):
        return None


# The package's refusals name its batch format's lengths (docs/hosting.md, Requests); a Triton client
# sends each user's tensors instead, whose lengths those are.
_BATCH_LENGTHS = (
    (re.compile(r"history_lengths has (-?\d+), outside events (\[-?\d+, -?\d+\])"), ITEM_IDS, "events"),
    (re.compile(r"num_candidates has (-?\d+), outside candidates (\[-?\d+, -?\d+\])"), CANDIDATE_IDS, "candidates"),
)


def client_message(message: str) -> str:
    """A refusal's message in the names of the tensors a Triton client sent."""
    for pattern, tensor, what in _BATCH_LENGTHS:
        message = pattern.sub(rf"{tensor} has \1 {what}, outside \2", message)
    return message
