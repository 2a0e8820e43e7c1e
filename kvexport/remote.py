"""The remote KV tier's load-time settings: where the shared Redis/Valkey server is and when users
are written to it. A deployment choice, never part of a package (docs/hosting.md, *Remote tier*).

torch-free, so the CLI can check an option without importing torch.
"""

from __future__ import annotations

import re

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


_CREDENTIALS = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/]*@")


def redact_url(url: str) -> str:
    """`url` for a message or a log: whatever precedes an '@' in its authority (the user and the
    password of redis://user:password@host) as ***, as the op library writes it."""
    return _CREDENTIALS.sub(r"\1***@", url)
