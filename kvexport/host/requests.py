"""The package API's request contract: what a host may hand a package, checked once per request
before it runs (the value rules by the op library's check_request, the one the package itself runs).

A request that does not fit the signature or the config's limits raises RequestError
(kvexport.errors, code "invalid_request")."""

from __future__ import annotations

import dataclasses

import torch

from kvexport.errors import RequestError
from kvexport.io import first_line
from kvexport.model.batch import SIGNATURE, Batch, UserRequest
from kvexport.ops import wrappers as kv


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


def where(index: int | None) -> str:
    """The prefix of a refusal's message that names the batch of a request file or trace."""
    return f"batch {index}: " if index is not None else ""


def check_structure(raw: object, index: int | None = None) -> Batch:
    """A request (a Batch or a dict of tensors) checked for what must hold before any op may read
    its tensors: the signature's fields, int64, their ranks, on the CPU. The values (limits, jagged
    sums, vocabularies, distinct users) are the op library's check_request's, which every route runs
    once: inside model.pt2, or in the step runner before it plans. RequestError otherwise.
    """
    where_ = where(index)
    if isinstance(raw, Batch):
        raw = raw.to_dict()
    if not isinstance(raw, dict):
        raise RequestError(f"{where_}must be a dict of tensors, got {type(raw).__name__}")
    missing = [name for name in SIGNATURE if name not in raw]
    if missing:
        raise RequestError(f"{where_}missing {missing[0]}")
    unknown = sorted(set(raw) - set(SIGNATURE))
    if unknown:
        raise RequestError(f"{where_}unknown field {unknown[0]}")
    t = {name: _check_tensor(name, raw[name], 2 if name == "context_ids" else 1, where_) for name in SIGNATURE}
    return Batch(*(t[name].contiguous() for name in SIGNATURE))


def check_batch(raw: object, config, index: int | None = None) -> Batch:
    """A request checked whole before anything runs: its structure (check_structure), then the op
    library's value rules (the package's own check_request, run here on no runtime). For a host that
    must refuse a whole request file before scoring any of it; scoring needs only check_structure.
    RequestError (code "invalid_request") otherwise.
    """
    batch = check_structure(raw, index)
    try:
        kv.check_request("", config.request_limits_json(), *batch.tensors())
    except ValueError as exc:
        raise RequestError(f"{where(index)}{first_line(exc)}") from None
    return batch


# The fields of one user's request (Package.score_users): UserRequest's, in its order.
USER_REQUEST_FIELDS = tuple(field.name for field in dataclasses.fields(UserRequest))
_INT64 = torch.iinfo(torch.int64)


def _check_user_id(value: object, where: str) -> int:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise RequestError(
                f"{where}user_id must be an int or a one-element integer tensor, got a tensor "
                f"of dtype {str(value.dtype).replace('torch.', '')} and shape {list(value.shape)}"
            )
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
        raise RequestError(
            f"{where}item_ids has {len(t['item_ids'])} events but action_ids has "
            f"{len(t['action_ids'])}; each event is one item and one action"
        )
    width = config.model.context_width
    if len(t["context_ids"]) != width:
        what = " (its contextual features, then the query time)" if config.model.head == "item_tower" else ""
        raise RequestError(f"{where}context_ids has {len(t['context_ids'])} entries, the model takes {width}{what}")
    return UserRequest(user_id, t["item_ids"], t["action_ids"], t["context_ids"], t["candidate_ids"])
