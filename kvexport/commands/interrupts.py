"""How a command ends: a user error as one line and its exit code, SIGINT and SIGTERM as an unwind
(cleanup runs, what the command was writing is removed) and the shell's status for the signal.

The two share one funnel (handle_errors): a signal's exception can reach it wrapped as any other
exception, so the exit status follows the record of the signal, not the exception's type.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
import threading

import click

from kvexport.errors import UserError

log = logging.getLogger("kvexport")


class Terminated(BaseException):
    """SIGTERM as an exception, so cleanup (`finally`, context managers) runs as for Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


# The signal that interrupted the command: Python may wrap the exception a handler raises (an
# interrupt during an import surfaces as a RuntimeError), so the exit status follows this record.
interrupted_by: list[int] = []


def inside_torch_tracing() -> bool:
    """Whether torch is tracing on this thread (torch.export, AOTInductor's lowering): a fake-tensor
    or proxy dispatch mode is active."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    keys = torch._C._TorchDispatchModeKey
    return any(torch._C._get_dispatch_mode(key) is not None for key in (keys.FAKE, keys.PROXY))


def _raise_interrupted(signum, frame) -> None:
    interrupted_by.append(signum)
    if inside_torch_tracing():
        # Raised here, the exception would unwind through torch's dispatcher, whose mode guards
        # then fail again in C++ and abort the process (SIGABRT: no cleanup, no exit status of
        # ours). Remove what the command is writing and exit now instead.
        from kvexport.io import run_abrupt_cleanups

        run_abrupt_cleanups()
        exit_on_signal(signum)
    raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)


@contextlib.contextmanager
def signals_raise():
    """Within the block SIGINT and SIGTERM raise (handlers can only be set from the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _raise_interrupted) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def exit_on_signal(signum: int) -> None:
    """Exit status 128 + signal number, as a shell reports a process killed by that signal."""
    if log.isEnabledFor(logging.DEBUG):
        log.exception("interrupted")
    click.echo(f"error: interrupted by {signal.Signals(signum).name}", err=True)
    if not interrupted_by:  # raised, not signalled (an embedding caller, a test)
        sys.exit(128 + signum)
    sys.stdout.flush()
    sys.stderr.flush()
    # The command's own cleanup has run. Exit now: an interrupt that landed inside an import can
    # leave the interpreter to re-raise SIGINT at shutdown, which would replace this status.
    os._exit(128 + signum)


def handle_errors(func):
    """User errors: one line on stderr and their exit code; --verbose adds the traceback.

    SIGINT and SIGTERM unwind the command (removing what it was writing) and exit 130 / 143.
    """

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            with signals_raise():
                return func(*args, **kwargs)
        except UserError as exc:
            if interrupted_by:
                exit_on_signal(interrupted_by[0])
            if log.isEnabledFor(logging.DEBUG):
                log.exception("user error")
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except (KeyboardInterrupt, Terminated):
            exit_on_signal(interrupted_by[0] if interrupted_by else signal.SIGINT)
        except Exception:
            if interrupted_by:  # the interrupt, wrapped by Python on its way up
                exit_on_signal(interrupted_by[0])
            raise

    return wrapper
