"""A de-duplicating, rate-limited work queue of keys (client-go's ``workqueue``).

A key is queued at most once; a key being processed is never handed to a second worker, and
if it is added meanwhile it is queued again once the first worker is done. ``add_after``
schedules a delayed add (an earlier pending one wins: sync polling, grace periods).
``add_rate_limited`` is the retry of a failed key: per-key exponential backoff
(client-go's ``ItemExponentialFailureRateLimiter``: ``base x 2^failures``, capped), reset by
``forget`` once the key succeeds. The queue is the only owner of a key's failure count.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class WorkQueue(Generic[K]):
    def __init__(self, retry_base: float = 1.0, retry_max: float = 60.0) -> None:
        self.retry_base = retry_base
        self.retry_max = retry_max
        self._failures: dict[K, int] = {}
        self._queue: asyncio.Queue[K] = asyncio.Queue()
        self._queued: set[K] = set()
        self._processing: set[K] = set()
        self._dirty: set[K] = set()
        self._timers: dict[K, asyncio.TimerHandle] = {}

    def add(self, key: K) -> None:
        if key in self._processing:
            self._dirty.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)

    def add_after(self, key: K, delay: float) -> None:
        """Add ``key`` after ``delay`` seconds (an earlier pending timer for it wins)."""
        loop = asyncio.get_running_loop()
        existing = self._timers.get(key)
        if existing is not None and existing.when() <= loop.time() + delay:
            return
        if existing is not None:
            existing.cancel()
        self._timers[key] = loop.call_later(delay, self._fire, key)

    def add_rate_limited(self, key: K) -> float:
        """Retry ``key`` after its backoff (one more failure counted); returns the delay."""
        failures = self._failures.get(key, 0)
        self._failures[key] = failures + 1
        delay = min(self.retry_max, self.retry_base * 2**failures)
        self.add_after(key, delay)
        return delay

    def forget(self, key: K) -> None:
        """``key`` succeeded: its next failure starts the backoff again from ``retry_base``."""
        self._failures.pop(key, None)

    def num_requeues(self, key: K) -> int:
        return self._failures.get(key, 0)

    def _fire(self, key: K) -> None:
        self._timers.pop(key, None)
        self.add(key)

    async def get(self) -> K:
        key = await self._queue.get()
        self._queued.discard(key)
        self._processing.add(key)
        return key

    def done(self, key: K) -> None:
        self._processing.discard(key)
        if key in self._dirty:
            self._dirty.discard(key)
            self.add(key)

    def discard(self, key: K) -> None:
        """The key's object is gone: cancel its pending delayed add and its failure count."""
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        self.forget(key)

    def __len__(self) -> int:
        return len(self._queued)

    def idle(self) -> bool:
        return not self._queued and not self._processing
