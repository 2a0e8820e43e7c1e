"""Server-side batching: concurrent one-user requests merged into jagged batches of the package.

Requests wait in one queue in the order they reach the server's model. One worker thread takes a
batch from it at a time: the oldest request of each user, in queue order, up to the package's
max_batch_size users. A later request of a user already in the batch stays queued, ahead of that
user's still later requests, so two requests of one user never share a batch and run in the order
they arrived: the second sees the cache the first left. A batch is scored with
`Package.score_users`; when the package refuses the merged batch (say, its users together exceed the
device tier of the KV cache) each of its users is scored alone, so a request fails only for a reason
of its own.

Requests are checked before they are queued (kvexport's own request check, the one every package
runs inside itself), so a bad request is refused alone and never reaches a batch.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
from typing import Callable, Mapping, Sequence, TypeVar

import numpy as np
import torch

from kvexport.errors import RequestError, RequestFailed, UserError
from kvexport.model.batch import Batch, UserRequest, check_batch
from kvexport.serving.signature import ACTION_IDS, CANDIDATE_IDS, CONTEXT_IDS, INPUT_NAMES, ITEM_IDS, USER_ID

log = logging.getLogger(__name__)

T = TypeVar("T")


def take_batch(queue: Sequence[T], max_users: int, user_of: Callable[[T], int]) -> tuple[list[T], list[T]]:
    """Splits a queue (oldest first) into (batch, rest): the oldest entry of each user, in queue
    order, up to max_users of them; every other entry stays in `rest`, in queue order."""
    batch: list[T] = []
    users: set[int] = set()
    rest: list[T] = []
    for entry in queue:
        user = user_of(entry)
        if len(batch) < max_users and user not in users:
            batch.append(entry)
            users.add(user)
        else:
            rest.append(entry)
    return batch, rest


def parse_request(inputs: Mapping[str, np.ndarray], config) -> UserRequest:
    """One user's request from the serving signature's arrays, checked against the package's limits
    and vocabularies; RequestError (one line) otherwise."""
    for name in INPUT_NAMES:
        if name not in inputs:
            raise RequestError(f"missing input {name}")
    arrays = {}
    for name in INPUT_NAMES:
        value = np.asarray(inputs[name])
        if value.dtype != np.int64:
            raise RequestError(f"{name} must be INT64, got {value.dtype}")
        if value.ndim != 1:
            raise RequestError(f"{name} must be 1-D, got shape {list(value.shape)}")
        arrays[name] = value
    if arrays[USER_ID].shape != (1,):
        raise RequestError(f"user_id must hold one id, got shape {list(arrays[USER_ID].shape)}")
    items, actions = len(arrays[ITEM_IDS]), len(arrays[ACTION_IDS])
    if items != actions:
        raise RequestError(f"item_ids has {items} events but action_ids has {actions}; "
                           "each event is one item and one action")
    user = UserRequest(int(arrays[USER_ID][0]),
                       *(torch.from_numpy(np.array(arrays[name], copy=True))
                         for name in (ITEM_IDS, ACTION_IDS, CONTEXT_IDS, CANDIDATE_IDS)))
    check_batch(Batch.concat([user]), config)  # limits and vocabularies: the package's own check
    return user


@dataclasses.dataclass(frozen=True)
class _Queued:
    user: UserRequest
    result: concurrent.futures.Future


@dataclasses.dataclass
class BatchCounters:
    """What the batcher did since it started (exported as kvexport_* metrics)."""

    batches: int = 0           # package calls that scored a batch
    batch_users: int = 0       # users scored in those calls (mean batch size = batch_users / batches)
    split_batches: int = 0     # merged batches the package refused, then scored one user at a time
    requests_ok: int = 0
    requests_refused: int = 0  # refused by the request check or by the package


class Batcher:
    """Merges queued one-user requests into batches of distinct users and scores them in order.

    submit() may be called from any thread; close() scores everything already queued, then stops.
    """

    def __init__(self, package):
        self._package = package
        self._max_users = package.max_batch_size
        self._queue: list[_Queued] = []
        self._state = threading.Condition()
        self._closing = False
        self._counters = BatchCounters()
        self._counters_lock = threading.Lock()
        self._worker = threading.Thread(target=self._run, name="kvexport-batcher", daemon=True)
        self._worker.start()

    def check(self, inputs: Mapping[str, np.ndarray]) -> UserRequest:
        """parse_request, counting a refusal."""
        try:
            return parse_request(inputs, self._package.config)
        except RequestFailed:
            self._count(requests_refused=1)
            raise

    def submit(self, user: UserRequest) -> concurrent.futures.Future:
        """Queues a checked request; the future holds its logits [T, num_tasks] or its refusal."""
        result: concurrent.futures.Future = concurrent.futures.Future()
        with self._state:
            if self._closing:
                raise UserError("the server is stopping")
            self._queue.append(_Queued(user, result))
            self._state.notify()
        return result

    def counters(self) -> BatchCounters:
        with self._counters_lock:
            return dataclasses.replace(self._counters)

    def close(self) -> None:
        """Scores what is queued, then stops the worker (idempotent)."""
        with self._state:
            self._closing = True
            self._state.notify_all()
        self._worker.join()

    def _run(self) -> None:
        while True:
            with self._state:
                self._state.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                batch, self._queue = take_batch(self._queue, self._max_users, lambda q: q.user.user_id)
            self._score(batch)

    def _score(self, batch: list[_Queued]) -> None:
        try:
            logits = self._package.score_users([q.user for q in batch])
        except RequestFailed as refused:
            if len(batch) > 1:
                log.debug("batch of %d users refused (%s); scoring them one at a time", len(batch), refused)
                self._count(split_batches=1)
                for queued in batch:
                    self._score([queued])
                return
            self._count(requests_refused=1)
            batch[0].result.set_exception(refused)
            return
        except Exception as exc:  # noqa: BLE001 — a bug fails its batch's requests, the server goes on
            log.exception("batch of %d users failed", len(batch))
            self._count(requests_refused=len(batch))
            for queued in batch:
                queued.result.set_exception(exc)
            return
        self._count(batches=1, batch_users=len(batch), requests_ok=len(batch))
        for queued, user_logits in zip(batch, logits):
            queued.result.set_result(user_logits)

    def _count(self, **increments: int) -> None:
        with self._counters_lock:
            for name, value in increments.items():
                setattr(self._counters, name, getattr(self._counters, name) + value)
