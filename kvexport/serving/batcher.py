"""Scoring the batches Triton's dynamic batcher forms: one request is one user.

Triton queues the requests of the model in the order they reach it and, whenever the model's one
instance is free, hands it the oldest ones, up to a few package calls' worth
(kvexport.serving.repository.triton_batch_size; a jagged batch: each user's history has its own
length). Each request's arrays are checked here (names, dtypes, shapes); the requests are scored in
package calls of at most the package's max_batch_size distinct users (take_batch): when a user sent two requests
that landed in one batch, the second is scored after the first, in a later package call, and sees
the cache the first left. One instance, batches scored one after the other: a user's requests run in
the order they reached the server. A request's values (limits, vocabularies) are checked once, by the
package itself as the merged call runs. A request fails only for a reason of its own: when the
package refuses a merged call as an invalid request, each of its users is checked alone (the op
library's check, nothing runs), the bad ones are refused and the others scored together again; when
it refuses it for another reason (say, its users together exceed the device tier of the KV cache),
each of its users is scored alone.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import numpy as np
import torch

from kvexport.errors import RequestError, RequestFailed
from kvexport.host.requests import check_batch
from kvexport.model.batch import Batch, UserRequest
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


def request_arrays(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One user's arrays from the serving signature's (each with a leading dimension of 1), their
    names, dtypes and shapes checked: RequestError (one line) otherwise."""
    for name in INPUT_NAMES:
        if name not in inputs:
            raise RequestError(f"missing input {name}")
    arrays = {}
    for name in INPUT_NAMES:
        value = np.asarray(inputs[name])
        if value.dtype != np.int64:
            raise RequestError(f"{name} must be INT64, got {value.dtype}")
        if value.ndim != 2 or value.shape[0] != 1:
            raise RequestError(f"{name} must have shape [1, n] (one request is one user), got {list(value.shape)}")
        arrays[name] = value[0]
    if arrays[USER_ID].shape != (1,):
        raise RequestError(f"user_id must hold one id, got shape [1, {len(arrays[USER_ID])}]")
    items, actions = len(arrays[ITEM_IDS]), len(arrays[ACTION_IDS])
    if items != actions:
        raise RequestError(
            f"item_ids has {items} events but action_ids has {actions}; each event is one item and one action"
        )
    return arrays


def parse_request(inputs: Mapping[str, np.ndarray]) -> UserRequest:
    """One user's request from the serving signature's arrays, checked as request_arrays checks
    them. Limits and vocabularies are the package's own check, once, when the batch it joins runs
    (a batch it refuses is scored again one user at a time, so a bad request fails alone)."""
    arrays = request_arrays(inputs)
    user = UserRequest(
        int(arrays[USER_ID][0]),
        *(
            torch.from_numpy(np.array(arrays[name], copy=True))
            for name in (ITEM_IDS, ACTION_IDS, CONTEXT_IDS, CANDIDATE_IDS)
        ),
    )
    return user


@dataclasses.dataclass
class BatchCounters:
    """What the scorer did since it started (exported as kvexport_* metrics)."""

    batches: int = 0  # package calls that scored a batch
    batch_users: int = 0  # users scored in those calls (mean batch size = batch_users / batches)
    split_batches: int = 0  # merged batches the package refused, then scored one user at a time
    requests_ok: int = 0
    requests_refused: int = 0  # refused by the request check or by the package


class BatchScorer:
    """Scores the requests of one Triton batch (oldest first), each answered with its logits
    [T, num_tasks] or its own refusal. Called by one thread at a time (the model's one instance);
    counters() may be read from any thread."""

    def __init__(self, package, max_users: int | None = None):
        self._package = package
        self._max_users = max_users or package.max_batch_size
        self._counters = BatchCounters()
        self._counters_lock = threading.Lock()

    def score(self, requests: Sequence[Mapping[str, np.ndarray]]) -> list[torch.Tensor | RequestFailed]:
        results: list[torch.Tensor | RequestFailed | None] = [None] * len(requests)
        pending: list[tuple[int, UserRequest]] = []
        for index, inputs in enumerate(requests):
            try:
                pending.append((index, parse_request(inputs)))
            except RequestFailed as refused:
                self._count(requests_refused=1)
                results[index] = refused
        while pending:
            batch, pending = take_batch(pending, self._max_users, lambda entry: entry[1].user_id)
            self._score(batch, results)
        return results

    def counters(self) -> BatchCounters:
        with self._counters_lock:
            return dataclasses.replace(self._counters)

    def _score(self, batch: list[tuple[int, UserRequest]], results: list) -> None:
        try:
            logits = self._package.score_users([user for _, user in batch])
        except RequestFailed as refused:
            if len(batch) > 1 and refused.code == "invalid_request":
                self._refuse_invalid(batch, results)
                return
            if len(batch) > 1:
                log.debug("batch of %d users refused (%s); scoring them one at a time", len(batch), refused)
                self._count(split_batches=1)
                for entry in batch:
                    self._score([entry], results)
                return
            self._count(requests_refused=1)
            results[batch[0][0]] = refused
            return
        self._count(batches=1, batch_users=len(batch), requests_ok=len(batch))
        for (index, _), user_logits in zip(batch, logits):
            results[index] = user_logits

    def _refuse_invalid(self, batch: list[tuple[int, UserRequest]], results: list) -> None:
        """A merged call refused as invalid: each user checked alone (nothing runs), the bad ones
        refused, the others scored together again."""
        valid = []
        for index, user in batch:
            try:
                check_batch(Batch.concat([user]), self._package.config)
            except RequestFailed as refused:
                self._count(requests_refused=1)
                results[index] = refused
            else:
                valid.append((index, user))
        if len(valid) == len(batch):  # each user is valid alone: score them alone
            for entry in batch:
                self._score([entry], results)
        elif valid:
            self._score(valid, results)

    def count_refused(self) -> None:
        """A request refused before it reached the scorer (a routing header naming another user)."""
        self._count(requests_refused=1)

    def _count(self, **increments: int) -> None:
        with self._counters_lock:
            for name, value in increments.items():
                setattr(self._counters, name, getattr(self._counters, name) + value)
