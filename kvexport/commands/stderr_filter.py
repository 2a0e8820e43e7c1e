"""Keeps AOTInductor's raw error lines off stderr while a kvexport command runs.

When an op refuses a request, the package's generated wrapper writes
"Error: <call> API call failed at <its build path>, line N" to stderr (file descriptor 2, from C++)
before rethrowing. kvexport reports every refusal itself, with the runtime's code and message, so
those lines are noise for expected outcomes and leak the build host's paths. The C++ harness
filters them the same way (csrc/replay/stderr_filter.cpp).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading

log = logging.getLogger("kvexport")

# A child process that inherited fd 2 (a compile worker) keeps the pipe open: do not wait for it.
_DRAIN_SECONDS = 2.0


def is_aoti_error_line(line: bytes) -> bool:
    """AOTInductor's line: its message's signature, or only "Error: " fragments (threads that fail
    at once interleave the prefix and the message)."""
    if b" API call failed at " in line:
        return True
    rest = line.replace(b"Error: ", b"")
    return rest != line and not rest.strip()


def _forward(read_fd: int, original_fd: int) -> None:
    pending = b""
    while chunk := os.read(read_fd, 65536):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if not is_aoti_error_line(line):
                os.write(original_fd, line + b"\n")
    if pending and not is_aoti_error_line(pending):
        os.write(original_fd, pending)


@contextlib.contextmanager
def aoti_errors_filtered():
    """Routes fd 2 through a forwarding thread that drops AOTInductor's error lines."""
    sys.stderr.flush()
    read_fd, write_fd = os.pipe()
    original_fd = os.dup(2)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    forwarder = threading.Thread(target=_forward, args=(read_fd, original_fd), name="stderr-filter", daemon=True)
    forwarder.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(original_fd, 2)  # closes our write end: the forwarder sees EOF, unless a child kept one
        forwarder.join(timeout=_DRAIN_SECONDS)
        if not forwarder.is_alive():
            os.close(read_fd)
            os.close(original_fd)


def aoti_errors_filtered_unless_verbose(func):
    """Commands that run a package in this process print no raw AOTInductor error lines: every
    refusal is reported with the runtime's reason instead (kept with --verbose)."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        if log.isEnabledFor(logging.DEBUG):
            return func(*args, **kwargs)
        with aoti_errors_filtered():
            return func(*args, **kwargs)

    return wrapper
