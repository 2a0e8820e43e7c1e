"""Arguments and options several commands share, and what they do with them: the remote tier's
URL with its password file's password, a report written as JSON."""

from __future__ import annotations

from pathlib import Path

import click

from kvexport.commands.params import ArtifactDirectory, RemoteWritePolicy, Tolerance, WritablePath
from kvexport.errors import UserError
from kvexport.remote import DEFAULT_WRITE_POLICY, read_password_file, url_with_password


def remote_options(func):
    """--remote URL, --remote-password-file FILE and --remote-write POLICY: the shared remote KV tier
    (kvexport.load(remote=...))."""
    func = click.option(
        "--remote-password-file",
        type=click.Path(path_type=Path),
        metavar="FILE",
        help="The remote tier's password, read from FILE (a mounted secret) rather than given "
        "in the URL, where the machine's process list would show it.",
    )(func)
    func = click.option(
        "--remote-write",
        type=RemoteWritePolicy(),
        default=DEFAULT_WRITE_POLICY,
        show_default=True,
        help="When users are written to the remote tier: on_evict (when the host tier lets "
        "them go) or after_batch (also after every request).",
    )(func)
    return click.option(
        "--remote",
        metavar="URL",
        help="Share user caches through a remote KV tier: a Redis/Valkey server at "
        "redis://[[user]:password@]host[:port][/db] (unreachable: runs without it, with a "
        "warning; a refused password: an error). Give the password with "
        "--remote-password-file rather than in the URL.",
    )(func)


def remote_url(remote: str | None, password_file: Path | None) -> str | None:
    """--remote with --remote-password-file's password added (kept inside this process)."""
    if password_file is None:
        return remote
    if remote is None:
        raise UserError("--remote-password-file needs --remote URL")
    return url_with_password(remote, read_password_file(password_file))


config_argument = click.argument("config", type=click.Path(path_type=Path))


artifact_argument = click.argument("out", type=ArtifactDirectory())


json_option = click.option("--json", "json_path", type=WritablePath(), help="Also write the report as JSON.")


atol_option = click.option(
    "--atol", type=Tolerance(), help="Override the manifest's absolute tolerance (finite, >= 0)."
)


rtol_option = click.option(
    "--rtol", type=Tolerance(), help="Override the manifest's relative tolerance (finite, >= 0)."
)


def write_json(path: Path, data: dict) -> None:
    """Writes a command's report to path as JSON, whole or not at all."""
    import json

    from kvexport.io import write_atomically

    write_atomically(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2) + "\n"), "report")
