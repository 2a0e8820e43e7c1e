"""Seeded request workloads: users arriving and returning, histories growing, some rewritten.

Shared by the recorded trace of `kvexport build`, the soak, the parity tests and benchmarks.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import torch

from kvexport.config import CONTEXT_FEATURE_SHIFT, ModelConfig
from kvexport.model.batch import QUERY_TIMES, Batch, UserRequest

REWRITES = ("edit", "delete", "context")
# With keys, the share of drawn ids that are keys (the rest: any id, mostly unknown ones).
KNOWN_KEY_SHARE = 0.9


@dataclasses.dataclass
class UserHistory:
    user_id: int
    context_ids: list[int]
    item_ids: list[int]
    action_ids: list[int]


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    num_users: int
    min_history_length: int
    max_history_length: int
    max_new_events: int
    num_candidates: int
    rewrite_fraction: float = 0.1

    @classmethod
    def from_trace_config(cls, trace, num_users: int, rewrite_fraction: float) -> WorkloadSpec:
        """History lengths and candidates as in a config's trace section."""
        return cls(
            num_users=num_users,
            min_history_length=trace.min_history_length,
            max_history_length=trace.max_trace_history_length,
            max_new_events=trace.max_new_events,
            num_candidates=trace.num_candidates,
            rewrite_fraction=rewrite_fraction,
        )


def _int64(ids: list[int]) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


def item_keys_of(model: torch.nn.Module) -> list[int] | None:
    """A keyed model's item keys (HSTURanker.item_keys) as a list, or None for a model of rows."""
    keys = getattr(model, "item_keys", None)
    return None if keys is None else keys.tolist()


def context_keys_of(model: torch.nn.Module) -> list[list[int]] | None:
    """A keyed model's keys of each contextual feature (HSTURanker.context_keys), or None."""
    keys = getattr(model, "context_keys", None)
    if keys is None:
        return None
    per_feature: list[list[int]] = [[] for _ in range(model.num_contextual_features)]
    for pair in keys.tolist():
        per_feature[pair >> CONTEXT_FEATURE_SHIFT].append(pair & ((1 << CONTEXT_FEATURE_SHIFT) - 1))
    return per_feature


class Workload:
    """Generates batches; every user carries its full (possibly rewritten) history."""

    def __init__(
        self,
        model: ModelConfig,
        spec: WorkloadSpec,
        seed: int,
        item_keys: list[int] | None = None,
        context_keys: list[list[int]] | None = None,
    ):
        """item_keys: a keyed model's item keys (model.item_ids: keys); context_keys: each contextual
        feature's keys (model.context_ids: keys). Requests then draw mostly known keys and some
        unknown ids; without them, ids are drawn as table rows."""
        self.model, self.spec, self.item_keys, self.context_keys = model, spec, item_keys, context_keys
        self.rng = random.Random(seed)
        self.users: dict[int, UserHistory] = {}
        self.events: Counter[str] = Counter()

    def _ids(self, vocab: int, n: int) -> list[int]:
        return [self.rng.randrange(vocab) for _ in range(n)]

    def _keyed(self, keys: list[int]) -> int:
        """Mostly one of `keys`, else any id up to one past the largest (mostly an unknown one)."""
        if keys and self.rng.random() < KNOWN_KEY_SHARE:
            return self.rng.choice(keys)
        return self.rng.randrange(max(keys, default=0) + 2)

    def _items(self, n: int) -> list[int]:
        if self.item_keys is None:
            return self._ids(self.model.item_vocab_size, n)
        return [self._keyed(self.item_keys) for _ in range(n)]

    def _contexts(self) -> list[int]:
        if self.context_keys is None:
            return self._ids(self.model.context_vocab_size, self.model.num_contextual_features)
        return [self._keyed(keys) for keys in self.context_keys]

    def new_user(self, user_id: int, num_events: int | None = None) -> UserHistory:
        """A first-time user with a random history (of `num_events` events, if given)."""
        n = (
            num_events
            if num_events is not None
            else self.rng.randint(self.spec.min_history_length, self.spec.max_history_length)
        )
        m = self.model
        user = UserHistory(user_id, self._contexts(), self._items(n), self._ids(m.action_vocab_size, n))
        self.users[user_id] = user
        self.events["new"] += 1
        return user

    def grow(self, user: UserHistory, num_events: int) -> None:
        """Appends events; past the maximum, the oldest events slide out of the window."""
        user.item_ids += self._items(num_events)
        user.action_ids += self._ids(self.model.action_vocab_size, num_events)
        overflow = len(user.item_ids) - self.spec.max_history_length
        if overflow > 0:
            del user.item_ids[:overflow], user.action_ids[:overflow]
            self.events["slide"] += 1
        self.events["grow" if num_events else "same"] += 1

    def rewrite(self, user: UserHistory, kind: str) -> None:
        """Changes the past: an edited event, deleted events, or a changed context feature."""
        n = len(user.item_ids)
        if kind == "edit" and n:
            i = self.rng.randrange(n)
            user.item_ids[i] = (user.item_ids[i] + 1) % self.model.item_id_limit
        elif kind == "delete" and n > 1:
            i = self.rng.randrange(n - 1)
            del user.item_ids[i : i + 2], user.action_ids[i : i + 2]
        elif kind == "context" and user.context_ids:
            j = self.rng.randrange(len(user.context_ids))
            user.context_ids[j] = (user.context_ids[j] + 1) % self.model.context_id_limit
        else:
            return
        self.events[kind] += 1

    def step_user(self, user_id: int) -> UserHistory:
        """Advances one user as a returning (or new) visitor."""
        user = self.users.get(user_id)
        if user is None:
            return self.new_user(user_id)
        if self.rng.random() < self.spec.rewrite_fraction:
            self.rewrite(user, self.rng.choice(REWRITES))
        self.grow(user, self.rng.randint(0, self.spec.max_new_events))
        return user

    def request(self, user: UserHistory, num_candidates: int | None = None) -> UserRequest:
        """The user's request now; a model whose head reads a query time gets a random one."""
        t = num_candidates or self.rng.randint(1, self.spec.num_candidates)
        query_time = [self.rng.randrange(*QUERY_TIMES)] if self.model.head == "item_tower" else []
        return UserRequest(
            user.user_id,
            _int64(user.item_ids),
            _int64(user.action_ids),
            _int64(user.context_ids + query_time),
            _int64(self._items(t)),
        )

    def next_batch(self, batch_size: int) -> Batch:
        """A batch of distinct users drawn from the population, each advanced one step."""
        user_ids = self.rng.sample(range(self.spec.num_users), batch_size)
        return Batch.concat([self.request(self.step_user(u)) for u in user_ids])
