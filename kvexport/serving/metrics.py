"""kvexport's metrics, published by the Triton model through the Python backend's custom metrics
API, so that Triton's own metrics port serves them beside its own:

    kvexport_cache_<counter>_total{model="NAME",instance="I"}   the cache runtime's counters (lookups, ...)
    kvexport_cache_<level>{model="NAME",instance="I"}           its occupancy (device_pages_used, ...)
    kvexport_batches_total / kvexport_batch_users_total    package calls and the users they scored
    kvexport_split_batches_total                           merged batches refused, then scored per user
    kvexport_requests_total{model="NAME",instance="I",result="ok|refused"}
"""

from __future__ import annotations

import dataclasses

# Cache stats that are levels rather than counts (kvexport::runtime_stats names: device_pages_used,
# device_users, host_pages_used, host_users, ...); every other stat is a count since the runtime began.
LEVEL_SUFFIXES = ("_used", "_users", "_max", "_connected")


@dataclasses.dataclass(frozen=True)
class Sample:
    """One value of one metric family: the family's name, kind ("counter" or "gauge") and help text."""

    name: str
    kind: str
    help: str
    labels: tuple[tuple[str, str], ...]
    value: int


def samples(model: str, cache: dict[str, int], batches, instance: str = "") -> list[Sample]:
    """kvexport's metrics (cache: Package.stats(); batches: BatchCounters), families in order;
    instance: the Triton model instance's name, a label beside the model's (each instance publishes
    its own levels: one label set for all would leave the last publisher's)."""
    label = (("model", model),) + ((("instance", instance),) if instance else ())
    out: list[Sample] = []
    for stat, value in cache.items():
        if stat.endswith(LEVEL_SUFFIXES):
            out.append(
                Sample(f"kvexport_cache_{stat}", "gauge", f"KV cache {stat.replace('_', ' ')} now", label, value)
            )
        else:
            out.append(
                Sample(f"kvexport_cache_{stat}_total", "counter", f"KV cache {stat.replace('_', ' ')}", label, value)
            )
    out += [
        Sample(
            "kvexport_batches_total", "counter", "Package calls that scored a batch of users", label, batches.batches
        ),
        Sample("kvexport_batch_users_total", "counter", "Users scored in those batches", label, batches.batch_users),
        Sample(
            "kvexport_split_batches_total",
            "counter",
            "Merged batches the package refused, then scored one user at a time",
            label,
            batches.split_batches,
        ),
        Sample(
            "kvexport_requests_total",
            "counter",
            "Inference requests by result",
            (*label, ("result", "ok")),
            batches.requests_ok,
        ),
        Sample(
            "kvexport_requests_total",
            "counter",
            "Inference requests by result",
            (*label, ("result", "refused")),
            batches.requests_refused,
        ),
    ]
    return out
