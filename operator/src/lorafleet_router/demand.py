"""Per-adapter demand as one router sees it, for the operator's autoscaler (``GET /demand``).

For every adapter (its DynamoModel's namespace and name, and ``modelName``) the router counts the
requests in flight to a worker and those queued in the router (waiting for a ready endpoint), and
keeps two exponentially weighted means over ``window`` seconds, exact for piecewise-constant
signals and O(1) per request: ``concurrency`` (in flight + queued; by Little's law the request
rate times the latency) and ``rate`` (requests per second). Idle adapters whose means have decayed
below 0.001 are dropped from the report. The same counts are Prometheus gauges on ``/metrics``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lorafleet_router import metrics

Key = tuple[str, str, str]  # (namespace, DynamoModel name, modelName)
FORGET_BELOW = 1e-3


@dataclass
class _Adapter:
    inflight: int = 0
    queued: int = 0
    concurrency: float = 0.0  # EWMA of inflight + queued at ``at``
    rate: float = 0.0  # EWMA of arrivals per second at ``at``
    at: float = 0.0


class DemandTracker:
    """In-flight and queued requests per adapter, with their window means."""

    def __init__(self, window: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self.clock = clock
        self._adapters: dict[Key, _Adapter] = {}

    def _advance(self, a: _Adapter, now: float) -> None:
        decay = math.exp(-(now - a.at) / self.window) if now > a.at else 1.0
        level = a.inflight + a.queued
        a.concurrency = level + (a.concurrency - level) * decay
        a.rate *= decay
        a.at = now

    def _get(self, key: Key) -> _Adapter:
        a = self._adapters.get(key)
        if a is None:
            a = self._adapters[key] = _Adapter(at=self.clock())
        self._advance(a, self.clock())
        return a

    def arrive(self, key: Key) -> None:
        """A request for the adapter arrived; it is queued until ``dispatch``."""
        a = self._get(key)
        a.queued += 1
        a.rate += 1.0 / self.window
        metrics.ROUTER_ADAPTER_REQUESTS.labels(key[2]).inc()
        metrics.ROUTER_ADAPTER_QUEUED.labels(key[2]).inc()

    def dispatch(self, key: Key) -> None:
        """The request was sent to a worker (queued -> in flight)."""
        a = self._get(key)
        a.queued -= 1
        a.inflight += 1
        metrics.ROUTER_ADAPTER_QUEUED.labels(key[2]).dec()
        metrics.ROUTER_ADAPTER_INFLIGHT.labels(key[2]).inc()

    def requeue(self, key: Key) -> None:
        """The worker did not take it (retried elsewhere): in flight -> queued."""
        a = self._get(key)
        a.inflight -= 1
        a.queued += 1
        metrics.ROUTER_ADAPTER_INFLIGHT.labels(key[2]).dec()
        metrics.ROUTER_ADAPTER_QUEUED.labels(key[2]).inc()

    def finish(self, key: Key, *, dispatched: bool) -> None:
        """The request ended (answered, or given up while queued)."""
        a = self._get(key)
        if dispatched:
            a.inflight -= 1
            metrics.ROUTER_ADAPTER_INFLIGHT.labels(key[2]).dec()
        else:
            a.queued -= 1
            metrics.ROUTER_ADAPTER_QUEUED.labels(key[2]).dec()

    def report(self) -> dict[str, Any]:
        """The ``GET /demand`` body."""
        now = self.clock()
        out = []
        for key, a in list(self._adapters.items()):
            self._advance(a, now)
            if a.inflight + a.queued == 0 and a.concurrency < FORGET_BELOW and a.rate < FORGET_BELOW:
                del self._adapters[key]
                continue
            entry = {"namespace": key[0], "name": key[1], "modelName": key[2], "inflight": a.inflight}
            entry |= {"queued": a.queued, "concurrency": round(a.concurrency, 4), "rate": round(a.rate, 4)}
            out.append(entry)
        out.sort(key=lambda e: (e["namespace"], e["name"]))
        return {"window": self.window, "adapters": out}
