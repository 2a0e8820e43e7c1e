"""The command line's parameter types: each checks its value while the arguments are parsed, so a bad
one fails before any work. Most report it as a UserError is reported (one `error:` line, exit 2);
the import options' NAME=VALUE pairs as click's usage errors."""

from __future__ import annotations

import math
import os
from pathlib import Path

import click

from kvexport.errors import UserError


class BadValue(click.ClickException):
    """A bad option or argument value, reported like a UserError: one `error:` line, exit 2."""

    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


def param_name(param: click.Parameter | None) -> str:
    """How a message names the parameter: its first option name, or the argument's name."""
    if param is None:
        return "value"
    return param.opts[0] if isinstance(param, click.Option) else param.human_readable_name


class Tolerance(click.ParamType):
    """A finite float >= 0 (NaN would make every comparison fail, inf would pass anything)."""

    name = "float"

    def convert(self, value, param, ctx) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number) or number < 0:
            raise BadValue(f"{param_name(param)} must be a finite number >= 0, got {value}")
        return number


class BoundedInt(click.ParamType):
    """An integer >= low (and <= high when given), reported like a UserError otherwise."""

    name = "integer"

    def __init__(self, low: int, high: int | None = None):
        self.low, self.high = low, high

    def convert(self, value, param, ctx) -> int:
        try:
            number = int(value)
        except (TypeError, ValueError):
            number = None
        if number is None or number < self.low or (self.high is not None and number > self.high):
            bounds = f"in {self.low}..{self.high}" if self.high is not None else f">= {self.low}"
            raise BadValue(f"{param_name(param)} must be an integer {bounds}, got {value}")
        return number


PORT = BoundedInt(1, 65535)


class WritablePath(click.ParamType):
    """A file to write: checked while parsing, so a bad path fails before hours of work, not after."""

    name = "path"

    def convert(self, value, param, ctx) -> Path:
        path = Path(value)
        where = f"cannot write {param_name(param)} {path}"
        if path.is_dir():
            raise BadValue(f"{where}: it is a directory")
        parent = path.resolve().parent
        if not parent.exists():
            raise BadValue(f"{where}: directory {parent} does not exist")
        if not parent.is_dir():
            raise BadValue(f"{where}: {parent} is not a directory")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise BadValue(f"{where}: directory {parent} is not writable")
        return path


class ArtifactDirectory(click.ParamType):
    """An artifact directory; a file (say OUT/model.pt2) is named as such, not as missing."""

    name = "out"

    def convert(self, value, param, ctx) -> Path:
        path = Path(value)
        if path.is_file():
            command = f"kvexport {ctx.info_name}" if ctx else "this command"
            raise BadValue(f"{path} is a file; {command} takes the artifact directory (the one holding manifest.json)")
        return path


class RemoteWritePolicy(click.ParamType):
    """One of kvexport.remote.WRITE_POLICIES."""

    name = "policy"

    def convert(self, value, param, ctx) -> str:
        from kvexport.remote import check_write_policy

        try:
            return check_write_policy(value, param_name(param))
        except UserError as exc:
            raise BadValue(str(exc)) from None


class Route(click.ParamType):
    """I/N with 0 <= I < N: this process's share of a routed request stream."""

    name = "I/N"

    def convert(self, value, param, ctx) -> tuple[int, int]:
        if isinstance(value, tuple):
            return value
        parts = str(value).split("/")
        try:
            index, count = (int(p) for p in parts)
        except ValueError:
            index, count = -1, 0
        if len(parts) != 2 or not 0 <= index < count:
            raise BadValue(f"{param_name(param)} must be I/N with 0 <= I < N, got {value}")
        return index, count


class TableRows(click.ParamType):
    """NAME=ROWS: the rows of one of the trainer's data-parallel embedding tables."""

    name = "NAME=ROWS"

    def convert(self, value, param, ctx) -> tuple[str, int]:
        name, equals, rows = str(value).partition("=")
        if not equals or not name or not rows.isdigit() or int(rows) < 1:
            self.fail(f"{param_name(param)} takes NAME=ROWS with ROWS a positive integer, got {value!r}", param, ctx)
        return name, int(rows)


class IdsFile(click.ParamType):
    """FEATURE=FILE: a text file of one contextual feature's served ids."""

    name = "FEATURE=FILE"

    def convert(self, value, param, ctx) -> tuple[str, Path]:
        if isinstance(value, tuple):
            return value
        feature, equals, path = str(value).partition("=")
        if not equals or not feature or not path:
            self.fail(f"{param_name(param)} takes FEATURE=FILE, got {value!r}", param, ctx)
        return feature, Path(path)
