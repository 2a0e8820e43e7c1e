"""Runs a package's step program (docs/design.md 3.9): the host checks and plans a request
(check_request, begin_step), uploads begin_step's buffer in one copy, runs the step program on it
and commits the batch (end_batch).

On a GPU the step program of each bucket runs as a CUDA graph: the first request of a bucket runs
it directly (which also loads its kernels) and captures it, later ones replay the capture, so the
host launches one graph instead of every kernel. A graph reads its inputs from one device buffer of
its own; each replay's request is copied into it first, and its logits copied out before the next.
"""

from __future__ import annotations

import collections
import logging
from pathlib import Path

import torch

from kvexport.host.program import load_program
from kvexport.model.batch import Batch
from kvexport.ops import wrappers as kv

log = logging.getLogger(__name__)

# Buckets of more rows than this run without a graph: a graph keeps its largest intermediates
# allocated, and a request this large spends its time in kernels, not in launching them.
MAX_GRAPH_ROWS = 16384
# Graphs kept per package (least recently used dropped first): bounds the memory they hold.
MAX_GRAPHS = 16
# Both go into step.pt2's metadata at build time, for C++ hosts (the harness's --route graphs).


class _Bucket:
    """A captured step program: its input buffer, graph and output."""

    __slots__ = ("buffer", "graph", "logits")

    def __init__(self, buffer: torch.Tensor, graph: torch.cuda.CUDAGraph, logits: torch.Tensor):
        self.buffer, self.graph, self.logits = buffer, graph, logits


class StepRunner:
    """A loaded step.pt2 and the graphs captured from it. Requests must not overlap: each runs
    between begin_step and end_batch, which the cache runtime serialises."""

    def __init__(self, package: Path, device: torch.device, *, cuda_graphs: bool):
        # Single-threaded, so that a CUDA graph can capture a run.
        index = device.index if device.index is not None else -1
        self._program = load_program(package, index, single_threaded=True)
        # What planning needs travels in the step program, as every host reads it.
        metadata = self._program.get_metadata()
        self.runtime_name = metadata["kvexport.runtime_name"]
        self._runtime_config = metadata["kvexport.runtime_config"]
        self._limits = metadata["kvexport.request_limits"]
        self._max_prefix_length = int(metadata["kvexport.max_prefix_length"])
        self._device = device
        self._placement = torch.empty(0, device=device)  # where begin_step's runtime lives
        self._graphs_on = cuda_graphs and device.type == "cuda"
        self._buckets: collections.OrderedDict[tuple[int, int, int], _Bucket] = collections.OrderedDict()
        if self._graphs_on:
            self._stream = torch.cuda.Stream(device)
            self._pool = torch.cuda.graph_pool_handle()

    @property
    def num_graphs(self) -> int:
        """CUDA graphs captured and kept."""
        return len(self._buckets)

    def run(self, batch: Batch) -> torch.Tensor:
        """Scores a checked batch: float32 logits [sum(num_candidates), num_tasks] on the device."""
        user_ids, token_lengths, token_ids, num_candidates, candidate_ids = kv.check_request(
            self.runtime_name, self._limits, *batch.tensors()
        )
        staged, layout = kv.begin_step(
            self.runtime_name,
            self._runtime_config,
            user_ids,
            token_ids,
            token_lengths,
            num_candidates,
            candidate_ids,
            self._placement,
            self._max_prefix_length,
        )
        try:
            if self._graphs_on:
                logits = self._run_on_stream(staged, layout)
            else:
                inputs, plan = layout.split(staged.to(self._device, non_blocking=True))
                logits = self._program(*inputs, *plan)[: layout.real_candidates]
            kv.end_batch(self.runtime_name, user_ids, logits)
        except BaseException:
            kv.abort_batch(self.runtime_name)  # a failure between our ops: nothing is committed
            raise
        return logits

    def _run_on_stream(self, staged: torch.Tensor, layout: kv.StepLayout) -> torch.Tensor:
        """The step on this runner's stream (every request's, so a replay never overlaps the next
        request's copy into its buffer); the caller's stream waits for the logits."""
        caller = torch.cuda.current_stream(self._device)
        self._stream.wait_stream(caller)
        with torch.cuda.stream(self._stream):
            bucket = self._buckets.get(layout.bucket)
            if bucket is not None:
                self._buckets.move_to_end(layout.bucket)
                bucket.buffer.copy_(staged, non_blocking=True)
                bucket.graph.replay()
                logits = bucket.logits[: layout.real_candidates].clone()
            else:
                logits = self._run_and_capture(staged, layout)
        caller.wait_stream(self._stream)
        logits.record_stream(caller)
        return logits

    def _run_and_capture(self, staged: torch.Tensor, layout: kv.StepLayout) -> torch.Tensor:
        buffer = staged.to(self._device, non_blocking=True)
        inputs, plan = layout.split(buffer)
        logits = self._program(*inputs, *plan)[: layout.real_candidates]
        if layout.candidate_rows + layout.prefix_rows <= MAX_GRAPH_ROWS:
            self._capture(buffer, layout)
        return logits

    def _capture(self, buffer: torch.Tensor, layout: kv.StepLayout) -> None:
        """Records the step's launches on `buffer` (nothing runs until a replay). Only this thread's
        calls can spoil a capture (thread_local); a capture that fails turns graphs off, logged once."""
        inputs, plan = layout.split(buffer)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
                captured = self._program(*inputs, *plan)
        except RuntimeError as exc:
            self._graphs_on = False
            log.warning(
                "%s: capturing a CUDA graph failed (%s); the step program runs without graphs",
                self.runtime_name,
                str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
            )
            return
        if len(self._buckets) == MAX_GRAPHS:
            self._buckets.popitem(last=False)
        self._buckets[layout.bucket] = _Bucket(buffer, graph, captured)
        log.debug("captured a CUDA graph for bucket %s (%d kept)", layout.bucket, len(self._buckets))
