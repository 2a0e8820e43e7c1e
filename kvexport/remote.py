"""The remote KV tier's load-time settings: where the shared Redis/Valkey server is and when users
are written to it. A deployment choice, never part of a package (docs/hosting.md, *Remote tier*).

torch-free, so the CLI can check an option without importing torch.
"""

from __future__ import annotations

import os
import stat
from urllib.parse import quote, unquote

from kvexport.artifact import CONTRACT, contract_failure
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


def read_password_file(path: str | os.PathLike) -> str:
    """The password a file holds (a mounted secret, so that it never appears in a process list):
    its UTF-8 text less one trailing newline ("\\n" or "\\r\\n"). UserError naming the problem for a
    file that does not exist, cannot be read, is not a regular file, is over the contract's size,
    starts with a byte-order mark, is not UTF-8, is empty or holds more than one line: the rules and
    messages of kvexport/contract.json's password_file, which the C++ harness follows too."""
    path = os.fspath(path)  # as given: "pw/" names no file, as it does for the harness
    max_bytes = CONTRACT["password_file"]["max_bytes"]
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise contract_failure("password_file_not_regular", path=path)
        with open(path, "rb") as file:
            data = file.read(max_bytes + 1)  # one byte past the limit tells a file over it
    except (FileNotFoundError, NotADirectoryError):
        raise contract_failure("password_file_missing", path=path) from None
    except OSError as exc:
        raise contract_failure(
            "password_file_unreadable", path=path, reason=exc.strerror or type(exc).__name__
        ) from None
    if len(data) > max_bytes:
        raise contract_failure("password_file_too_large", path=path, max_bytes=max_bytes)
    if data.startswith(b"\xef\xbb\xbf"):
        raise contract_failure("password_file_bom", path=path)
    data = data[:-2] if data.endswith(b"\r\n") else data[:-1] if data.endswith(b"\n") else data
    if not data:
        raise contract_failure("password_file_empty", path=path)
    if b"\n" in data or b"\r" in data:
        raise contract_failure("password_file_lines", path=path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise contract_failure("password_file_not_utf8", path=path) from None


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
    host = rest[len(user) + 1 :] if "@" in authority else rest
    return f"{scheme}://{user}:{quote(password, safe='')}@{host}"


def split_password(url: str) -> tuple[str, str | None]:
    """(`url` without its password, the password decoded) — url_with_password's inverse; (url, None)
    when it holds none."""
    scheme, sep, rest = url.partition("://")
    authority = rest.split("/", 1)[0]
    if not sep or "@" not in authority:
        return url, None
    user = authority.rsplit("@", 1)[0]
    if ":" not in user:
        return url, None
    name, password = user.split(":", 1)
    host = rest[len(user) + 1 :]
    return f"{scheme}://{name + '@' if name else ''}{host}", unquote(password)
