"""The remote KV tier's load-time settings: where the shared Redis/Valkey server is and when users
are written to it. A deployment choice, never part of a package (docs/hosting.md, *Remote tier*).

torch-free, so the CLI can check an option without importing torch.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

from kvexport.errors import UserError

# The write policies kvexport::attach_remote accepts: users the host tier lets go ("on_evict"), or
# also every user of every committed batch ("after_batch").
WRITE_POLICIES = ("on_evict", "after_batch")
DEFAULT_WRITE_POLICY = "on_evict"
# How long close() waits for queued writes to reach the server before dropping them.
FLUSH_TIMEOUT_MS = 5000


def check_write_policy(policy: str, what: str = "remote_write") -> str:
    """The policy, or UserError naming it and the accepted ones."""
    if policy not in WRITE_POLICIES:
        raise UserError(f"{what} {policy!r}: expected one of {', '.join(WRITE_POLICIES)}")
    return policy


def redact_url(url: str) -> str:
    """`url` for a message or a log, as the op library writes it: everything between its scheme and
    its last '@' (the user and the password of redis://user:password@host, however malformed the
    URL) as ***."""
    head, at, tail = url.rpartition("@")
    if not at:
        return url
    scheme, sep, _ = head.partition("://")
    return (scheme + sep if sep else "") + "***@" + tail


def read_password_file(path: Path) -> str:
    """The password a file holds (a mounted secret, so that it never appears in a process list):
    its text less one trailing newline. UserError for a file that cannot be read, is empty or
    holds more than one line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise UserError(f"cannot read the remote tier's password file {path}: {why}") from None
    password = text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text
    if not password:
        raise UserError(f"the remote tier's password file {path} is empty")
    if "\n" in password or "\r" in password:
        raise UserError(f"the remote tier's password file {path} holds more than one line")
    return password


def url_with_password(url: str, password: str) -> str:
    """`url` (redis://[user@]host...) with `password` added, percent-encoded. UserError when the
    URL holds a password already."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url  # not a URL: the op library refuses it, naming the form it takes
    authority = rest.split("/", 1)[0]
    user = authority.rsplit("@", 1)[0] if "@" in authority else ""
    if ":" in user:
        raise UserError("the remote URL holds a password already: give it there or in a password file, not both")
    host = rest[len(user) + 1:] if "@" in authority else rest
    return f"{scheme}://{user}:{quote(password, safe='')}@{host}"
