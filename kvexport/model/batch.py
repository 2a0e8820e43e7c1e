"""The request batch: jagged int64 tensors, the signature shared by the model, the package and the trace."""

from __future__ import annotations

import dataclasses

import torch

from kvexport.config import Config
from kvexport.options import SampleOptions

# Input order of the exported module and of every recorded request.
SIGNATURE = (
    "user_ids",  # [B]
    "history_lengths",  # [B] events per user
    "item_ids",  # [sum(history_lengths)]
    "action_ids",  # [sum(history_lengths)]
    "context_ids",  # [B, num_contextual_features], then (model.head: item_tower) the query time
    "num_candidates",  # [B]
    "candidate_ids",  # [sum(num_candidates)]
)

# Query times (seconds since the epoch) of random requests to a model whose head reads one: 2020-09
# to 2023-11, so that every hour of the day and day of the week occurs.
QUERY_TIMES = (1_600_000_000, 1_700_000_000)

# Elements per alignment unit of Batch.to's single upload: 16 int64 = 128 bytes.
_ALIGN = 16


@dataclasses.dataclass(frozen=True)
class Batch:
    """One request batch. Each user carries its full history; the cache decides what to recompute."""

    user_ids: torch.Tensor
    history_lengths: torch.Tensor
    item_ids: torch.Tensor
    action_ids: torch.Tensor
    context_ids: torch.Tensor
    num_candidates: torch.Tensor
    candidate_ids: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in SIGNATURE)

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in SIGNATURE}

    def to(self, device: torch.device | str) -> Batch:
        """The batch on `device`. Seven int64 host tensors go to a GPU in one copy through pinned
        memory, not seven blocking ones: the copy is asynchronous on the device's current stream
        (work queued later on that stream sees the data), and each tensor is a view of the one
        uploaded buffer, starting on a 128-byte boundary. Anything else moves tensor by tensor."""
        device = torch.device(device)
        tensors = self.tensors()
        if (
            device.type != "cuda"
            or not torch.cuda.is_available()
            or any(t.device.type != "cpu" or t.dtype != torch.int64 for t in tensors)
        ):
            return Batch(*(t.to(device) for t in tensors))
        starts = [0]
        for t in tensors:
            starts.append(starts[-1] + -(-t.numel() // _ALIGN) * _ALIGN)
        staged = torch.empty(starts[-1], dtype=torch.int64, pin_memory=True)
        for t, start in zip(tensors, starts):
            staged[start : start + t.numel()].copy_(t.reshape(-1))
        uploaded = staged.to(device, non_blocking=True)
        return Batch(*(uploaded[start : start + t.numel()].view(t.shape) for t, start in zip(tensors, starts)))

    @property
    def batch_size(self) -> int:
        return self.user_ids.shape[0]

    @staticmethod
    def concat(users: list[UserRequest]) -> Batch:
        """Builds a batch from per-user requests, in order."""
        return Batch(
            user_ids=torch.tensor([u.user_id for u in users], dtype=torch.int64),
            history_lengths=torch.tensor([len(u.item_ids) for u in users], dtype=torch.int64),
            item_ids=torch.cat([u.item_ids for u in users]),
            action_ids=torch.cat([u.action_ids for u in users]),
            context_ids=torch.stack([u.context_ids for u in users]),
            num_candidates=torch.tensor([len(u.candidate_ids) for u in users], dtype=torch.int64),
            candidate_ids=torch.cat([u.candidate_ids for u in users]),
        )

    def users(self) -> list[UserRequest]:
        """The inverse of concat: each user's request, in order."""
        lengths, counts = self.history_lengths.tolist(), self.num_candidates.tolist()
        return [
            UserRequest(int(u), items, actions, context, candidates)
            for u, items, actions, context, candidates in zip(
                self.user_ids,
                self.item_ids.split(lengths),
                self.action_ids.split(lengths),
                self.context_ids,
                self.candidate_ids.split(counts),
            )
        ]


@dataclasses.dataclass(frozen=True)
class UserRequest:
    """One user's part of a batch (1-D int64 tensors)."""

    user_id: int
    item_ids: torch.Tensor
    action_ids: torch.Tensor
    context_ids: torch.Tensor
    candidate_ids: torch.Tensor


def random_context(model_config, generator: torch.Generator) -> torch.Tensor:
    """A user's random context ids [context_width]: one per contextual feature, then (a head that
    reads one) a query time."""
    m = model_config
    context_ids = torch.randint(0, m.context_vocab_size, (m.num_contextual_features,), generator=generator)
    if m.head == "item_tower":
        context_ids = torch.cat([context_ids, torch.randint(*QUERY_TIMES, (1,), generator=generator)])
    return context_ids


def random_user(
    model_config, generator: torch.Generator, user_id: int, num_events: int, num_candidates: int
) -> UserRequest:
    """A user with random ids inside the config's vocabularies."""
    m = model_config

    def ids(high: int, n: int) -> torch.Tensor:
        return torch.randint(0, high, (n,), generator=generator, dtype=torch.int64)

    return UserRequest(
        user_id=user_id,
        item_ids=ids(m.item_vocab_size, num_events),
        action_ids=ids(m.action_vocab_size, num_events),
        context_ids=random_context(m, generator),
        candidate_ids=ids(m.item_vocab_size, num_candidates),
    )


def random_batch(
    model_config, seed: int, history_lengths: list[int], num_candidates: list[int], first_user_id: int = 0
) -> Batch:
    """A seeded random batch with the given per-user history and candidate counts."""
    generator = torch.Generator().manual_seed(seed)
    users = [
        random_user(model_config, generator, first_user_id + i, h, t)
        for i, (h, t) in enumerate(zip(history_lengths, num_candidates))
    ]
    return Batch.concat(users)


def sample_batch(config: Config, options: SampleOptions) -> Batch:
    """options.num_users seeded random users sized by the config's trace: user i with 8 (i + 1)
    history events (at most trace.max_trace_history_length) and trace.num_candidates candidates."""
    t = config.trace
    histories = [min(t.max_trace_history_length, 8 * (i + 1)) for i in range(options.num_users)]
    return random_batch(config.model, options.seed, histories, [t.num_candidates] * options.num_users)
