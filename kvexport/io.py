"""File I/O with the project's error rules: weights_only loads, atomic writes, one-line errors."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Callable

import torch

from kvexport.errors import UserError


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def load_tensor_file(path: str | Path, what: str):
    """`torch.load(weights_only=True)`: a file needing pickle code execution is refused, not run."""
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise UserError(f"{what} {path} does not exist") from exc
    except IsADirectoryError as exc:
        raise UserError(f"{what} {path} is a directory") from exc
    except pickle.UnpicklingError as exc:
        raise UserError(f"{what} {path} is refused: it is not a plain tensor file (weights_only load failed)") from exc
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise UserError(f"{what} {path} is unreadable: {first_line(exc)}") from exc


def write_atomically(path: str | Path, write: Callable[[Path], None], what: str) -> None:
    """Calls write(temporary path) next to `path`, then renames it into place; nothing partial remains."""
    path = Path(path)
    if not path.resolve().parent.is_dir():
        raise UserError(f"cannot write {what} {path}: its directory does not exist")
    tmp = path.with_name(path.name + ".partial")
    try:
        write(tmp)
        tmp.replace(path)
    except (OSError, RuntimeError) as exc:  # torch.save reports I/O failures as RuntimeError
        reason = getattr(exc, "strerror", None) or first_line(exc)
        raise UserError(f"cannot write {what} {path}: {reason}") from exc
    finally:
        tmp.unlink(missing_ok=True)
