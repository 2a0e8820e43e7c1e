"""kvexport's metrics beside Triton's: one Prometheus endpoint serves both.

Triton's own metrics server listens on a private port of 127.0.0.1; the metrics port of
`kvexport serve` answers `GET /metrics` with Triton's text followed by kvexport's:

    kvexport_cache_<counter>_total{model="NAME"}   the cache runtime's counters (lookups, hit_tokens, ...)
    kvexport_cache_<level>{model="NAME"}           its occupancy (device_pages_used, device_users, ...)
    kvexport_batches_total / kvexport_batch_users_total    package calls and the users they scored
    kvexport_split_batches_total                           merged batches refused, then scored per user
    kvexport_requests_total{model="NAME",result="ok|refused"}
"""

from __future__ import annotations

import dataclasses
import http.server
import logging
import threading
import urllib.error
import urllib.request
from typing import Callable

log = logging.getLogger(__name__)

# Cache stats that are levels rather than counts (kvexport::runtime_stats names: device_pages_used,
# device_users, host_pages_used, host_users, ...); every other stat is a count since the runtime began.
LEVEL_SUFFIXES = ("_used", "_users", "_max", "_connected")
TRITON_TIMEOUT_S = 5.0


@dataclasses.dataclass(frozen=True)
class Sample:
    """One value of one metric family: the family's name, kind ("counter" or "gauge") and help text."""

    name: str
    kind: str
    help: str
    labels: tuple[tuple[str, str], ...]
    value: int


def samples(model: str, cache: dict[str, int], batches) -> list[Sample]:
    """kvexport's metrics (cache: Package.stats(); batches: BatchCounters), families in order."""
    label = (("model", model),)
    out: list[Sample] = []
    for stat, value in cache.items():
        if stat.endswith(LEVEL_SUFFIXES):
            out.append(Sample(f"kvexport_cache_{stat}", "gauge", f"KV cache {stat.replace('_', ' ')} now", label,
                              value))
        else:
            out.append(Sample(f"kvexport_cache_{stat}_total", "counter", f"KV cache {stat.replace('_', ' ')}",
                              label, value))
    out += [
        Sample("kvexport_batches_total", "counter", "Package calls that scored a batch of users", label,
               batches.batches),
        Sample("kvexport_batch_users_total", "counter", "Users scored in those batches", label, batches.batch_users),
        Sample("kvexport_split_batches_total", "counter",
               "Merged batches the package refused, then scored one user at a time", label, batches.split_batches),
        Sample("kvexport_requests_total", "counter", "Inference requests by result", (*label, ("result", "ok")),
               batches.requests_ok),
        Sample("kvexport_requests_total", "counter", "Inference requests by result",
               (*label, ("result", "refused")), batches.requests_refused),
    ]
    return out


def render(model: str, cache: dict[str, int], batches) -> str:
    """kvexport's metrics in the Prometheus text format (cache: Package.stats(); batches: BatchCounters)."""
    lines: list[str] = []
    described: set[str] = set()
    for sample in samples(model, cache, batches):
        if sample.name not in described:
            described.add(sample.name)
            lines += [f"# HELP {sample.name} {sample.help}", f"# TYPE {sample.name} {sample.kind}"]
        labels = ",".join(f'{key}="{value}"' for key, value in sample.labels)
        lines.append(f"{sample.name}{{{labels}}} {sample.value}")
    return "\n".join(lines) + "\n"


class MetricsServer:
    """Serves GET /metrics on (address, port): Triton's metrics (from triton_url) then kvexport's."""

    def __init__(self, address: str, port: int, triton_url: str, kvexport_metrics: Callable[[], str]):
        triton_metrics = f"{triton_url}/metrics"

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 — http.server's name
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics is served here")
                    return
                try:
                    with urllib.request.urlopen(triton_metrics, timeout=TRITON_TIMEOUT_S) as response:
                        triton = response.read().decode()
                except (OSError, urllib.error.URLError) as exc:
                    log.debug("Triton's metrics are unavailable: %s", exc)
                    triton = ""
                if triton and not triton.endswith("\n"):
                    triton += "\n"
                body = (triton + kvexport_metrics()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args) -> None:  # noqa: A002 — http.server's signature
                log.debug("metrics: " + format, *args)

        self._server = http.server.ThreadingHTTPServer((address, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvexport-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()
