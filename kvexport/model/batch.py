"""The request batch: jagged int64 tensors, the signature shared by the model, the package and the trace."""

from __future__ import annotations

import dataclasses

import torch

from kvexport.errors import RequestError
from kvexport.io import first_line

# Input order of the exported module and of every recorded request.
SIGNATURE = (
    "user_ids",          # [B]
    "history_lengths",   # [B] events per user
    "item_ids",          # [sum(history_lengths)]
    "action_ids",        # [sum(history_lengths)]
    "context_ids",       # [B, num_contextual_features], then (model.head: item_tower) the query time
    "num_candidates",    # [B]
    "candidate_ids",     # [sum(num_candidates)]
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

    def to(self, device: torch.device | str) -> "Batch":
        """The batch on `device`. Seven int64 host tensors go to a GPU in one copy through pinned
        memory, not seven blocking ones: the copy is asynchronous on the device's current stream
        (work queued later on that stream sees the data), and each tensor is a view of the one
        uploaded buffer, starting on a 128-byte boundary. Anything else moves tensor by tensor."""
        device = torch.device(device)
        tensors = self.tensors()
        if (device.type != "cuda" or not torch.cuda.is_available()
                or any(t.device.type != "cpu" or t.dtype != torch.int64 for t in tensors)):
            return Batch(*(t.to(device) for t in tensors))
        starts = [0]
        for t in tensors:
            starts.append(starts[-1] + -(-t.numel() // _ALIGN) * _ALIGN)
        staged = torch.empty(starts[-1], dtype=torch.int64, pin_memory=True)
        for t, start in zip(tensors, starts):
            staged[start:start + t.numel()].copy_(t.reshape(-1))
        uploaded = staged.to(device, non_blocking=True)
        return Batch(*(uploaded[start:start + t.numel()].view(t.shape) for t, start in zip(tensors, starts)))

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


def random_context(model_config, generator: torch.Generator) -> torch.Tensor:
    """A user's random context ids [context_width]: one per contextual feature, then (a head that
    reads one) a query time."""
    m = model_config
    context_ids = torch.randint(0, m.context_vocab_size, (m.num_contextual_features,), generator=generator)
    if m.head == "item_tower":
        context_ids = torch.cat([context_ids, torch.randint(*QUERY_TIMES, (1,), generator=generator)])
    return context_ids


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
        context_ids=random_context(m, generator),
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


# A request that does not fit the signature or the config's limits raises RequestError
# (kvexport.errors, code "invalid_request"); it stays importable from here.


def _check_tensor(name: str, value: object, ndim: int, where: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise RequestError(f"{where}{name} must be a tensor, got {type(value).__name__}")
    if value.dtype != torch.int64:
        raise RequestError(f"{where}{name} must be int64, got {str(value.dtype).replace('torch.', '')}")
    if value.dim() != ndim:
        raise RequestError(f"{where}{name} must be {ndim}-D, got shape {list(value.shape)}")
    if value.device.type != "cpu":
        raise RequestError(f"{where}{name} must be on the CPU, got {value.device}")
    return value


def check_batch(raw: object, config, index: int | None = None, runtime: str = "") -> Batch:
    """Validates a request (a Batch or a dict of tensors) against the signature and config limits.

    Raises RequestError (code "invalid_request"). The value rules are checked by the op library's
    check_request; with `runtime` named, a refusal is also what kvexport::last_error(runtime) reports.
    """
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
    t = {name: _check_tensor(name, raw[name], 2 if name == "context_ids" else 1, where) for name in SIGNATURE}
    # The value rules (limits, jagged sums, vocabularies, distinct users) have one owner: the
    # check every package runs inside itself.
    from kvexport.ops import wrappers as kv

    try:
        kv.check_request(runtime, config.request_limits_json(), *(t[name] for name in SIGNATURE))
    except ValueError as exc:
        raise RequestError(f"{where}{first_line(exc)}") from None
    return Batch(*(t[name].contiguous() for name in SIGNATURE))


# The fields of one user's request (Package.score_users): UserRequest's, in its order.
USER_REQUEST_FIELDS = tuple(field.name for field in dataclasses.fields(UserRequest))
_INT64 = torch.iinfo(torch.int64)


def _check_user_id(value: object, where: str) -> int:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise RequestError(f"{where}user_id must be an int or a one-element integer tensor, got a tensor "
                               f"of dtype {str(value.dtype).replace('torch.', '')} and shape {list(value.shape)}")
        value = int(value.item())
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{where}user_id must be an int, got {type(value).__name__}")
    if not _INT64.min <= value <= _INT64.max:
        raise RequestError(f"{where}user_id {value} does not fit int64")
    return value


def check_user_request(raw: object, config, index: int) -> UserRequest:
    """One user's request (a dict with USER_REQUEST_FIELDS, or a UserRequest) checked for what merging
    needs: its fields, their types and ranks, as many actions as items, the config's context width.

    Raises RequestError naming `request {index}`; limits and vocabularies are checked on the merged batch.
    """
    where = f"request {index}: "
    if isinstance(raw, UserRequest):
        raw = {name: getattr(raw, name) for name in USER_REQUEST_FIELDS}
    if not isinstance(raw, dict):
        raise RequestError(f"{where}must be a dict, got {type(raw).__name__}")
    missing = [name for name in USER_REQUEST_FIELDS if name not in raw]
    if missing:
        raise RequestError(f"{where}missing {missing[0]}")
    unknown = sorted(str(k) for k in set(raw) - set(USER_REQUEST_FIELDS))
    if unknown:
        raise RequestError(f"{where}unknown field {unknown[0]}")
    user_id = _check_user_id(raw["user_id"], where)
    t = {name: _check_tensor(name, raw[name], 1, where) for name in USER_REQUEST_FIELDS[1:]}
    if len(t["item_ids"]) != len(t["action_ids"]):
        raise RequestError(f"{where}item_ids has {len(t['item_ids'])} events but action_ids has "
                           f"{len(t['action_ids'])}; each event is one item and one action")
    width = config.model.context_width
    if len(t["context_ids"]) != width:
        what = " (its contextual features, then the query time)" if config.model.head == "item_tower" else ""
        raise RequestError(f"{where}context_ids has {len(t['context_ids'])} entries, the model takes {width}{what}")
    return UserRequest(user_id, t["item_ids"], t["action_ids"], t["context_ids"], t["candidate_ids"])
