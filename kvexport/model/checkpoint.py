"""Checkpoint format: a plain `torch.save`d state_dict of `HSTURanker` (see docs/checkpoint.md).

Loaded with `weights_only=True` only: a file that needs pickle code execution is refused.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvexport.errors import UserError
from kvexport.io import load_tensor_file, write_atomically
from kvexport.model.hstu import HSTURanker


class CheckpointError(UserError):
    """The checkpoint file is unreadable or does not fit the config."""


def check_state_dict(state_dict: object, model: HSTURanker, path: Path) -> dict[str, torch.Tensor]:
    """Checks keys and shapes against the model built from the config."""
    if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise CheckpointError(f"checkpoint {path} must hold a dict of tensors")
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state_dict))
    if missing:
        raise CheckpointError(f"checkpoint {path} is missing tensor {missing[0]} ({len(missing)} missing)")
    unexpected = sorted(set(state_dict) - set(expected))
    if unexpected:
        raise CheckpointError(f"checkpoint {path} has unexpected tensor {unexpected[0]} ({len(unexpected)} unexpected)")
    for key, tensor in expected.items():
        if state_dict[key].shape != tensor.shape:
            raise CheckpointError(
                f"checkpoint {path} tensor {key} has shape {list(state_dict[key].shape)}, "
                f"the config needs {list(tensor.shape)}"
            )
    for name in ("item_keys", "context_keys"):
        if name in state_dict:
            _check_keys(state_dict[name], name, path)
    keys, limit = state_dict.get("item_keys"), model.config.model.item_id_limit
    if keys is not None and keys.numel() and int(keys[-1]) >= limit:
        # With combined event tokens the action's bits lower the limit: a larger key's row no request reaches.
        raise CheckpointError(
            f"checkpoint {path} item_keys holds {int(keys[-1])}, past the item ids this config's "
            f"requests may carry (below {limit})"
        )
    return state_dict


def _check_keys(keys: torch.Tensor, name: str, path: Path) -> None:
    """A key table (docs/checkpoint.md): int64, each key >= 0, strictly ascending."""
    if keys.dtype != torch.int64:
        raise CheckpointError(
            f"checkpoint {path} tensor {name} must be int64, got {str(keys.dtype).replace('torch.', '')}"
        )
    if keys.numel() and int(keys.min()) < 0:
        raise CheckpointError(f"checkpoint {path} tensor {name} has a negative key ({int(keys.min())})")
    repeated = (keys[1:] <= keys[:-1]).nonzero()
    if repeated.numel():
        i = int(repeated[0, 0])
        raise CheckpointError(
            f"checkpoint {path} tensor {name} must ascend strictly, but key {i + 1} "
            f"({int(keys[i + 1])}) follows {int(keys[i])}"
        )


def load_checkpoint(path: str | Path, model: HSTURanker) -> dict[str, torch.Tensor]:
    """Reads and checks a checkpoint for `model` (weights_only)."""
    return check_state_dict(load_tensor_file(path, "checkpoint"), model, Path(path))


def save_checkpoint(model: HSTURanker, path: str | Path) -> None:
    """Writes the model's state_dict atomically (temporary file, then rename)."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    write_atomically(path, lambda tmp: torch.save(state, tmp), "checkpoint")
