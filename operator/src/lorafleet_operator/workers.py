"""Client of the workers' management API (SPEC §3): load, unload, list (with the worker's capacity),
and the catalogue of adapters a worker may load on demand (``PUT /v1/loras/catalog``).

Every call has a timeout and a bounded number of in-flight calls (one semaphore
for the whole client); connection failures and 502/503/504 are retried a few
times with exponential backoff. Other HTTP errors surface at once as
``WorkerError`` carrying the worker's status and message.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp
import yarl
from lorafleet_sync.retry import FetchPolicy, retry_async

from lorafleet_operator import metrics

RETRYABLE_STATUS = frozenset({502, 503, 504})


class WorkerError(Exception):
    """A failed management call. ``status`` is None for connection errors and timeouts."""

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(f"{status or 'unreachable'}: {message}")
        self.status = status
        self.message = message

    @property
    def invalid(self) -> bool:
        """The worker rejected the adapter itself (HTTP 400): retrying cannot help."""
        return self.status == 400

    @property
    def full(self) -> bool:
        """The worker holds as many adapters as it can (HTTP 507, ``--max-loaded-loras``)."""
        return self.status == 507


@dataclass(frozen=True)
class Inventory:
    """What ``GET /v1/loras`` says: the adapters a worker holds and how many it can hold.

    ``names`` are the pinned adapters (loaded by ``POST /v1/loras``: the placement's); ``on_demand``
    the ones the worker loaded itself for a request naming a catalogued adapter (``false`` in the
    answer's ``pinned`` map, a lorafleet extension; a worker without it pins everything)."""

    names: set[str]
    capacity: int | None  # None: unlimited, or a worker that does not report it
    on_demand: frozenset[str] = frozenset()


class CatalogUnsupported(WorkerError):
    """The worker does not serve ``PUT /v1/loras/catalog`` (an older worker: 404 or 405)."""


class WorkerClient:
    """Async client for ``http://<podIP>:9090`` management endpoints."""

    def __init__(
        self,
        *,
        token: str | None = None,
        load_timeout: float = 120.0,
        call_timeout: float = 10.0,
        max_concurrency: int = 16,
        attempts: int = 3,
        backoff: float = 0.25,
    ) -> None:
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._load_timeout = load_timeout
        self._call_timeout = call_timeout
        self._semaphore = asyncio.Semaphore(max_concurrency)
        self._policy = FetchPolicy(
            deadline_s=math.inf, initial_backoff_s=backoff, max_backoff_s=60.0, attempts=attempts
        )
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers=self._headers, connector=aiohttp.TCPConnector(limit=0, force_close=False)
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def load(self, address: str, name: str, uri: str) -> dict[str, Any]:
        """POST /v1/loras; idempotent for the same name and URI, hot swap for a new URI."""
        body = {"lora_name": name, "source": {"uri": uri}}
        return await self._call("load", "POST", address, "/v1/loras", self._load_timeout, json=body)

    async def put_catalog(self, address: str, adapters: Iterable[tuple[str, str]]) -> int:
        """PUT /v1/loras/catalog: replace the worker's catalogue with these (name, URI) pairs, each the
        body ``load`` would send. Returns the count the worker holds; ``CatalogUnsupported`` for an
        older worker."""
        body = {"adapters": [{"lora_name": name, "source": {"uri": uri}} for name, uri in adapters]}
        try:
            data = await self._call("catalog", "PUT", address, "/v1/loras/catalog", self._call_timeout, json=body)
        except WorkerError as e:
            if e.status in (404, 405):
                raise CatalogUnsupported(e.status, e.message) from e
            raise
        count = data.get("count")
        return count if isinstance(count, int) else len(body["adapters"])

    async def unload(self, address: str, name: str) -> bool:
        """DELETE /v1/loras/{name}; False when the worker did not have it (404)."""
        try:
            await self._call("unload", "DELETE", address, "/v1/loras/" + quote(name, safe="/"), self._call_timeout)
        except WorkerError as e:
            if e.status == 404:
                return False
            raise
        return True

    async def list(self, address: str) -> set[str]:
        """GET /v1/loras: the names of the adapters the worker holds pinned."""
        return (await self.inventory(address)).names

    async def inventory(self, address: str) -> Inventory:
        """GET /v1/loras: the adapters the worker holds and its ``capacity`` (lorafleet extension)."""
        data = await self._call("list", "GET", address, "/v1/loras", self._call_timeout)
        loras, capacity = data.get("loras"), data.get("capacity")
        if not isinstance(loras, dict) or not (capacity is None or (isinstance(capacity, int) and capacity >= 0)):
            raise WorkerError(None, f"malformed GET /v1/loras answer from {address}")
        pinned = data.get("pinned")  # name -> false for an adapter loaded on demand (absent: pinned)
        unpinned = frozenset(n for n, p in pinned.items() if p is False) if isinstance(pinned, Mapping) else frozenset()
        return Inventory(set(loras) - unpinned, capacity, unpinned & set(loras))

    async def _call(self, op: str, method: str, address: str, path: str, timeout: float, **kw: Any) -> dict[str, Any]:
        url = yarl.URL(address.rstrip("/") + path, encoded=True)

        async def once() -> dict[str, Any]:
            async with self._semaphore:
                started = time.monotonic()
                outcome = "error"
                try:
                    result = await self._request(method, url, timeout, **kw)
                    outcome = "success"
                    return result
                except WorkerError as e:
                    outcome = str(e.status or "unreachable")
                    raise
                finally:
                    metrics.WORKER_CALLS.labels(op, outcome).inc()
                    metrics.WORKER_CALL_SECONDS.labels(op).observe(time.monotonic() - started)

        return await retry_async(once, self._policy, retryable=_retryable)

    async def _request(self, method: str, url: yarl.URL, timeout: float, **kw: Any) -> dict[str, Any]:
        try:
            async with self._http().request(method, url, timeout=aiohttp.ClientTimeout(total=timeout), **kw) as resp:
                try:
                    data = await resp.json(content_type=None)
                except ValueError:
                    data = {"message": (await resp.text())[:500]}
                if not isinstance(data, dict):
                    data = {"message": str(data)[:500]}
                if resp.status >= 400 or data.get("status") == "error":
                    raise WorkerError(resp.status, str(data.get("message") or resp.reason))
                return data
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise WorkerError(None, f"{type(e).__name__}: {e}".rstrip(": ")) from e


def _retryable(e: Exception) -> bool:
    return isinstance(e, WorkerError) and (e.status is None or e.status in RETRYABLE_STATUS)
