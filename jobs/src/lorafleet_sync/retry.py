"""Retry policy shared by the worker's fetches and the sync job: exponential backoff, total deadline."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from .errors import SourceError
from .log import get_logger

log = get_logger(__name__)
_T = TypeVar("_T")


@dataclass(frozen=True)
class FetchPolicy:
    """Retry and timeout settings of remote operations."""

    deadline_s: float = 60.0  # total time for one operation, retries included
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0

    def backoff(self, attempt: int) -> float:
        """Delay before retry number ``attempt`` (1-based): exponential, capped."""
        return float(min(self.max_backoff_s, self.initial_backoff_s * 2 ** (attempt - 1)))

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> FetchPolicy:
        deadline = env.get("LORAFLEET_FETCH_DEADLINE_S")
        return cls(deadline_s=float(deadline)) if deadline else cls()

    def give_up(self, err: SourceError, attempt: int, deadline: float) -> SourceError | None:
        """The final error if ``err`` must not be retried (permanent, or the deadline would pass), else None."""
        if not err.retryable:
            return err
        if time.monotonic() + self.backoff(attempt) >= deadline:
            return SourceError(
                err.status, f"{err.message}; gave up after {attempt} attempts ({self.deadline_s:g}s deadline)"
            )
        return None


def retry_call(fn: Callable[[], _T], policy: FetchPolicy, what: str) -> _T:
    """Call ``fn`` (blocking) until it succeeds, retrying retryable SourceErrors until the deadline."""
    deadline = time.monotonic() + policy.deadline_s
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except SourceError as err:
            final = policy.give_up(err, attempt, deadline)
            if final is not None:
                raise final from None
            delay = policy.backoff(attempt)
            log.warning("%s failed (attempt %d: %s); retrying in %.1fs", what, attempt, err.message, delay)
            time.sleep(delay)
