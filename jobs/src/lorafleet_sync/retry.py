"""The one retry helper of lorafleet: the worker's fetches, the sync job and the operator's worker calls.

``FetchPolicy`` says how long to keep trying (a total deadline and/or a number of attempts) and
how long to wait in between (exponential, capped); ``retry_call`` (blocking) and
``retry_async`` (asyncio) run the same loop over it. Only errors the ``retryable`` predicate
accepts are retried (by default a ``SourceError`` marked retryable); others surface at once.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from .errors import SourceError
from .log import get_logger

log = get_logger(__name__)
_T = TypeVar("_T")
Retryable = Callable[[Exception], bool]


def source_retryable(err: Exception) -> bool:
    """The default predicate: a ``SourceError`` marked retryable (network trouble, 5xx, timeouts)."""
    return isinstance(err, SourceError) and err.retryable


@dataclass(frozen=True)
class FetchPolicy:
    """Retry and timeout settings of remote operations."""

    deadline_s: float = 60.0  # total time for one operation, retries included (inf = no deadline)
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0
    attempts: int = 0  # most attempts in all (0 = as many as the deadline allows)

    def backoff(self, attempt: int) -> float:
        """Delay before retry number ``attempt`` (1-based): exponential, capped."""
        return float(min(self.max_backoff_s, self.initial_backoff_s * 2 ** (attempt - 1)))

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> FetchPolicy:
        deadline = env.get("LORAFLEET_FETCH_DEADLINE_S")
        return cls(deadline_s=float(deadline)) if deadline else cls()

    def start(self) -> float:
        """The monotonic deadline of an operation starting now."""
        return time.monotonic() + self.deadline_s if math.isfinite(self.deadline_s) else math.inf

    def give_up(
        self, err: Exception, attempt: int, deadline: float, retryable: Retryable = source_retryable
    ) -> Exception | None:
        """The error to raise if ``err`` must not be retried (permanent, attempts used up, or the
        deadline would pass), else None."""
        if not retryable(err) or (self.attempts and attempt >= self.attempts):
            return err
        if time.monotonic() + self.backoff(attempt) >= deadline:
            if isinstance(err, SourceError):
                message = f"{err.message}; gave up after {attempt} attempts ({self.deadline_s:g}s deadline)"
                return SourceError(err.status, message)
            return err
        return None


def _next_delay(policy: FetchPolicy, err: Exception, attempt: int, deadline: float, what: str,
                retryable: Retryable) -> float:  # fmt: skip
    """Seconds to wait before attempt ``attempt + 1``; raises the final error when giving up."""
    final = policy.give_up(err, attempt, deadline, retryable)
    if final is err:
        raise err
    if final is not None:
        raise final from None
    delay = policy.backoff(attempt)
    if what:
        log.warning("%s failed (attempt %d: %s); retrying in %.1fs", what, attempt, err, delay)
    return delay


def retry_call(fn: Callable[[], _T], policy: FetchPolicy, what: str, retryable: Retryable = source_retryable) -> _T:
    """Call ``fn`` (blocking) until it succeeds or the policy gives up."""
    deadline, attempt = policy.start(), 0
    while True:
        attempt += 1
        try:
            return fn()
        except Exception as err:
            time.sleep(_next_delay(policy, err, attempt, deadline, what, retryable))


async def retry_async(
    fn: Callable[[], Awaitable[_T]],
    policy: FetchPolicy,
    what: str = "",
    retryable: Retryable = source_retryable,
    on_retry: Callable[[], None] | None = None,
) -> _T:
    """Await ``fn()`` until it succeeds or the policy gives up (``what`` = "" logs nothing)."""
    deadline, attempt = policy.start(), 0
    while True:
        attempt += 1
        try:
            return await fn()
        except Exception as err:
            delay = _next_delay(policy, err, attempt, deadline, what, retryable)
            if on_retry is not None:
                on_retry()
            await asyncio.sleep(delay)
