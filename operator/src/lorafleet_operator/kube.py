"""A small asyncio Kubernetes API client (aiohttp) and a list+watch informer.

Credentials come from ``KUBECONFIG`` (or ``~/.kube/config``) through the official client's
loader, else from the in-cluster service account. Objects are plain dicts. Used for status
patches, sync Jobs and Secrets by the operator, and for the router's watches (the router
does not run kopf).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

log = logging.getLogger(__name__)
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class KubeClient:
    """``await kube.get('/api/v1/namespaces/x/pods/y')`` and friends, with the right credentials."""

    def __init__(self, host: str, ssl_context: ssl.SSLContext | bool, token: Callable[[], str | None]) -> None:
        self.host = host.rstrip("/")
        self._ssl = ssl_context
        self._token = token
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_environment(cls) -> KubeClient:
        """Kubeconfig (``KUBECONFIG`` / ~/.kube/config) if present, else in-cluster."""
        from kubernetes import client, config

        kubeconfig = os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
        cfg = client.Configuration()
        if Path(kubeconfig.split(os.pathsep)[0]).is_file():
            config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        else:
            config.load_incluster_config(client_configuration=cfg)
        ctx: ssl.SSLContext | bool
        if cfg.verify_ssl:
            ctx = (
                ssl.create_default_context(cafile=cfg.ssl_ca_cert) if cfg.ssl_ca_cert else ssl.create_default_context()
            )
            if cfg.cert_file:
                ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
        else:
            ctx = False

        def token() -> str | None:
            if cfg.refresh_api_key_hook is not None:
                cfg.refresh_api_key_hook(cfg)
            # kubernetes >= 36.0.1 keeps the token under "BearerToken", older versions under "authorization"
            value = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
            if value and " " not in value:
                value = f"Bearer {value}"
            return value or None

        return cls(cfg.host, ctx, token)

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self._ssl, limit=32))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if token := self._token():
            headers["Authorization"] = token
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        timeout: float = 30.0,
    ) -> dict[str, Any]:
        data = None if body is None else json.dumps(body)
        async with self._http().request(
            method,
            self.host + path,
            data=data,
            params=params,
            headers=self._headers(content_type if data is not None else None),
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            text = await resp.text()
            if resp.status >= 400:
                try:
                    message = json.loads(text).get("message", text)
                except ValueError:
                    message = text
                raise KubeError(resp.status, str(message)[:1000])
            return json.loads(text) if text else {}

    async def get(self, path: str, **kw: Any) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return await self.request("GET", path, **kw)
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    async def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self.request("POST", path, body)

    async def merge_patch(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self.request("PATCH", path, body, content_type="application/merge-patch+json")

    async def strategic_patch(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """A strategic merge patch: lists with a merge key (a pod's ``status.conditions``, by ``type``)
        are merged entry by entry, so a condition the kubelet owns is left alone."""
        return await self.request("PATCH", path, body, content_type="application/strategic-merge-patch+json")

    async def json_patch(self, path: str, ops: list[dict[str, Any]]) -> dict[str, Any]:
        return await self.request("PATCH", path, ops, content_type="application/json-patch+json")

    async def delete(self, path: str, body: Mapping[str, Any] | None = None) -> None:
        try:
            await self.request("DELETE", path, body)
        except KubeError as e:
            if e.status != 404:
                raise

    async def watch(
        self, path: str, params: Mapping[str, str], timeout_seconds: int = 300
    ) -> AsyncIterator[dict[str, Any]]:
        """Watch events (``{"type", "object"}``) from ``resourceVersion`` in ``params``."""
        query = {**params, "watch": "true", "allowWatchBookmarks": "true", "timeoutSeconds": str(timeout_seconds)}
        async with self._http().get(
            self.host + path,
            params=query,
            headers=self._headers(),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=timeout_seconds + 30),
        ) as resp:
            if resp.status >= 400:
                raise KubeError(resp.status, (await resp.text())[:1000])
            async for line in resp.content:
                if line.strip():
                    yield json.loads(line)


def collection_path(group: str, version: str, plural: str, namespace: str | None = None) -> str:
    """``/api/v1/pods``, ``/apis/nvidia.com/v1alpha1/namespaces/ns/dynamomodels``..."""
    prefix = "/api/v1" if not group else f"/apis/{group}/{version}"
    return f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"


EventHandler = Callable[[str, dict[str, Any]], Awaitable[None] | None]


MAX_BACKOFF_S = 10.0  # an informer lists again at least this often while its list or watch keeps failing


class Informer:
    """List, then watch, forever; calls ``handler(type, object)`` for each change.

    A relist (after a 410 Gone or a broken connection) reports objects that vanished meanwhile
    as DELETED, so the consumer's cache stays exact. ``synced`` is set after the first list.
    """

    def __init__(
        self,
        kube: KubeClient,
        path: str,
        handler: EventHandler,
        *,
        label_selector: str | None = None,
        page_size: int = 500,
    ) -> None:
        self.kube = kube
        self.path = path
        self.handler = handler
        self.params = {"labelSelector": label_selector} if label_selector else {}
        self.page_size = page_size  # the list is read in pages (10,000 objects are not one response)
        self.synced = asyncio.Event()
        self._known: dict[str, dict[str, Any]] = {}

    async def _emit(self, kind: str, obj: dict[str, Any]) -> None:
        uid = (obj.get("metadata") or {}).get("uid", "")
        if kind == "DELETED":
            self._known.pop(uid, None)
        else:
            self._known[uid] = obj
        result = self.handler(kind, obj)
        if result is not None:
            await result

    async def _list(self) -> tuple[list[dict[str, Any]], str]:
        """Every object (one consistent snapshot, read in pages) and the list's resourceVersion."""
        items: list[dict[str, Any]] = []
        params = {**self.params, "limit": str(self.page_size)}
        while True:
            page = await self.kube.request("GET", self.path, params=params, timeout=120)
            items += page.get("items") or []
            meta = page.get("metadata") or {}
            if not meta.get("continue"):
                return items, str(meta.get("resourceVersion", ""))
            params = {**params, "continue": meta["continue"]}

    async def run(self) -> None:
        backoff = 0.5  # doubled after each failure, up to MAX_BACKOFF_S
        missing = False  # the last list answered 404: the resource (its CRD) does not exist (yet)
        while True:
            try:
                items, version = await self._list()
                if missing:
                    log.warning("%s exists now: watching it", self.path)
                    missing = False
                seen = {(i.get("metadata") or {}).get("uid") for i in items}
                for uid in [u for u in self._known if u not in seen]:
                    await self._emit("DELETED", self._known[uid])
                for item in items:
                    await self._emit("MODIFIED", item)
                self.synced.set()
                backoff = 0.5
                while True:
                    async for event in self.kube.watch(self.path, {**self.params, "resourceVersion": version}):
                        obj = event.get("object") or {}
                        version = (obj.get("metadata") or {}).get("resourceVersion", version)
                        if event.get("type") == "ERROR":
                            raise KubeError(int(obj.get("code") or 500), str(obj.get("message")))
                        if event.get("type") != "BOOKMARK":
                            await self._emit(str(event.get("type")), obj)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # relist after any failure (410 Gone, connection loss, no such resource)
                if isinstance(e, KubeError) and e.status == 404:
                    if not missing:  # once per outage: a CRD installed after the operator is picked up here
                        log.warning("%s: not found (is its CRD installed?); listing again every %.0f s at most",
                                    self.path, MAX_BACKOFF_S)  # fmt: skip
                    missing = True
                else:
                    log.info("watch of %s restarts: %s", self.path, e)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)


class EventPoster:
    """Posts core/v1 Events in the background, one at a time, never blocking the caller.

    Like client-go's EventCorrelator, events are aggregated: an event for the same object, type
    and reason as one still waiting to be posted joins it (``count`` grows, the newest message
    wins) instead of becoming another POST, so a poster that lags behind a burst (a cold start of
    thousands of models, a retry loop) posts each object's reason once. At most ``maxsize``
    distinct events wait; beyond that new ones are dropped (logged).
    ``post(involved_object, type, reason, message)`` never blocks; ``run()`` is the poster task.
    """

    def __init__(self, kube: KubeClient, component: str, maxsize: int = 10_000) -> None:
        self.kube = kube
        self.component = component
        self.instance = os.environ.get("POD_NAME") or component
        self.maxsize = maxsize
        self.pending: dict[tuple[str, str, str], _PendingEvent] = {}  # insertion order = posting order
        self._wakeup = asyncio.Event()
        self.posted = 0
        self.dropped = 0

    def post(self, involved: dict[str, Any], kind: str, reason: str, message: str) -> None:
        key = (str(involved.get("uid") or (involved.get("namespace"), involved.get("name"))), kind, reason)
        waiting = self.pending.get(key)
        if waiting is not None:
            waiting.count += 1
            waiting.message = message[:1024]
            return
        if len(self.pending) >= self.maxsize:
            self.dropped += 1
            if self.dropped % 1000 == 1:  # a burst beyond the bound logs once per 1,000 drops, not each
                log.warning("event queue full, dropping %s event %s (%d dropped so far)", kind, reason, self.dropped)
            return
        self.pending[key] = _PendingEvent(involved, kind, reason, message[:1024])
        self._wakeup.set()

    def body(self, event: _PendingEvent, now: str) -> dict[str, Any]:
        namespace = event.involved.get("namespace") or "default"
        return {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{event.involved.get('name', 'object')}.", "namespace": namespace},
            "involvedObject": event.involved,
            "type": event.kind,
            "reason": event.reason,
            "message": event.message,
            "source": {"component": self.component},
            "reportingComponent": self.component,
            "reportingInstance": self.instance,
            "firstTimestamp": event.first,
            "lastTimestamp": now,
            "count": event.count,
        }

    async def run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self.pending:
                key = next(iter(self.pending))
                event = self.pending.pop(key)
                body = self.body(event, _now())
                try:
                    await self.kube.create(f"/api/v1/namespaces/{body['metadata']['namespace']}/events", body)
                    self.posted += 1
                except Exception as e:  # events are best effort
                    log.debug("cannot post event %s: %s", event.reason, e)


def _now() -> str:
    from datetime import UTC, datetime

    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class _PendingEvent:
    involved: dict[str, Any]
    kind: str
    reason: str
    message: str
    count: int = 1
    first: str = field(default_factory=_now)
