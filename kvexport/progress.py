"""Progress of a long loop as log lines: `name: i/n steps, elapsed s`, at most every few seconds."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

DEFAULT_INTERVAL_S = 5.0


class Progress:
    """Counts steps of one stage and logs at INFO at most every `interval` seconds, and at the end.

        progress = Progress("verify", len(steps), log)
        for step in steps:
            ...
            progress.step()
        progress.finish()

    or as a context manager (`with Progress(...) as progress:`), which calls finish() on success.
    total may be None when the number of steps is not known in advance.
    """

    def __init__(
        self,
        name: str,
        total: int | None,
        logger: logging.Logger,
        interval: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.name, self.total, self.logger, self.interval, self.clock = name, total, logger, interval, clock
        self.done, self.logged_done = 0, None
        self.started = self.last_logged = clock()

    def step(self, count: int = 1) -> None:
        """Records `count` finished steps; logs when `interval` has passed since the last line."""
        self.done += count
        now = self.clock()
        if now - self.last_logged >= self.interval:
            self._log(now)

    def finish(self) -> None:
        """Logs the final count and the total elapsed time (unless the last line already did)."""
        if self.logged_done != self.done:
            self._log(self.clock())

    def _log(self, now: float) -> None:
        self.last_logged, self.logged_done = now, self.done
        steps = f"{self.done}/{self.total}" if self.total is not None else str(self.done)
        self.logger.info("%s: %s steps, %.1f s elapsed", self.name, steps, now - self.started)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:  # an error is reported by its own message, not by a progress line
            self.finish()
