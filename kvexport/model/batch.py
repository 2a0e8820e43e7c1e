"""The request batch: jagged int64 tensors, the signature shared by the model, the package and the trace."""

from __future__ import annotations

import dataclasses

import torch

from kvexport.errors import UserError
from kvexport.io import first_line

# Input order of the exported module and of every recorded request.
SIGNATURE = (
    "user_ids",          # [B]
    "history_lengths",   # [B] events per user
    "item_ids",          # [sum(history_lengths)]
    "action_ids",        # [sum(history_lengths)]
    "context_ids",       # [B, num_contextual_features]
    "num_candidates",    # [B]
    "candidate_ids",     # [sum(num_candidates)]
)


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

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(*(t.to(device) for t in self.tensors()))

    @property
    def batch_size(self) -> int:
        return self.user_ids.shape[0]

    @staticmethod
    def concat(users: list["UserRequest"]) -> "Batch":
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


@dataclasses.dataclass(frozen=True)
class UserRequest:
    """One user's part of a batch (1-D int64 tensors)."""

    user_id: int
    item_ids: torch.Tensor
    action_ids: torch.Tensor
    context_ids: torch.Tensor
    candidate_ids: torch.Tensor


def random_user(model_config, generator: torch.Generator, user_id: int, num_events: int,
                num_candidates: int) -> UserRequest:
    """A user with random ids inside the config's vocabularies."""
    m = model_config

    def ids(high: int, n: int) -> torch.Tensor:
        return torch.randint(0, high, (n,), generator=generator, dtype=torch.int64)

    return UserRequest(
        user_id=user_id,
        item_ids=ids(m.item_vocab_size, num_events),
        action_ids=ids(m.action_vocab_size, num_events),
        context_ids=ids(m.context_vocab_size, m.num_contextual_features),
        candidate_ids=ids(m.item_vocab_size, num_candidates),
    )


def random_batch(model_config, seed: int, history_lengths: list[int], num_candidates: list[int],
                 first_user_id: int = 0) -> Batch:
    """A seeded random batch with the given per-user history and candidate counts."""
    generator = torch.Generator().manual_seed(seed)
    users = [
        random_user(model_config, generator, first_user_id + i, h, t)
        for i, (h, t) in enumerate(zip(history_lengths, num_candidates))
    ]
    return Batch.concat(users)


class RequestError(UserError):
    """A request batch that does not fit the signature or the config's limits."""


def _check_tensor(name: str, value: object, ndim: int, index: int | None) -> torch.Tensor:
    where = f"batch {index}: " if index is not None else ""
    if not isinstance(value, torch.Tensor):
        raise RequestError(f"{where}{name} must be a tensor, got {type(value).__name__}")
    if value.dtype != torch.int64:
        raise RequestError(f"{where}{name} must be int64, got {str(value.dtype).replace('torch.', '')}")
    if value.dim() != ndim:
        raise RequestError(f"{where}{name} must be {ndim}-D, got shape {list(value.shape)}")
    if value.device.type != "cpu":
        raise RequestError(f"{where}{name} must be on the CPU, got {value.device}")
    return value


def _check_range(where: str, name: str, values: torch.Tensor, low: int, high: int, what: str) -> None:
    if values.numel() and (values.min() < low or values.max() >= high):
        bad = values[(values < low) | (values >= high)][0].item()
        raise RequestError(f"{where}{name} has {bad}, outside {what} [{low}, {high - 1}]")


def check_batch(raw: object, config, index: int | None = None) -> Batch:
    """Validates a request (a Batch or a dict of tensors) against the signature and config limits."""
    where = f"batch {index}: " if index is not None else ""
    if isinstance(raw, Batch):
        raw = raw.to_dict()
    if not isinstance(raw, dict):
        raise RequestError(f"{where}must be a dict of tensors, got {type(raw).__name__}")
    missing = [name for name in SIGNATURE if name not in raw]
    if missing:
        raise RequestError(f"{where}missing {missing[0]}")
    unknown = sorted(set(raw) - set(SIGNATURE))
    if unknown:
        raise RequestError(f"{where}unknown field {unknown[0]}")
    t = {name: _check_tensor(name, raw[name], 2 if name == "context_ids" else 1, index) for name in SIGNATURE}
    # The value rules (limits, jagged sums, vocabularies, distinct users) have one owner: the
    # check every package runs inside itself.
    from kvexport.ops import wrappers as kv

    try:
        checked = kv.check_request("", config.request_limits_json(), *(t[name] for name in SIGNATURE))
    except ValueError as exc:
        raise RequestError(f"{where}{first_line(exc)}") from None
    return Batch(*checked)
