"""Leader election on a ``coordination.k8s.io/v1`` Lease, so several operator replicas run safely.

Only the holder of the Lease runs the operator (kopf, the work queue, the drift pass); the
others wait. The holder renews every ``renew_s`` seconds; a Lease not renewed for
``duration_s`` seconds may be taken over (a killed leader hands over within that time). Every
write carries the Lease's ``resourceVersion``, so two candidates can never both win one round
(the API server answers 409 to the slower one). A leader that cannot renew before its Lease
expires stops (the process exits and restarts as a candidate): it must not act once another
replica may. On a clean shutdown the leader gives the Lease up at once.

Why not kopf peering: peering pauses kopf's handlers, but the runtime's own tasks (work queue,
drift pass) would keep running in every replica; a Lease around the whole operator does not
have that gap, and needs no extra CRD (controller-runtime and client-go do the same).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from lorafleet_operator.kube import KubeClient, KubeError, collection_path
from lorafleet_operator.settings import OperatorSettings

log = logging.getLogger(__name__)
LEASE_NAME = "lorafleet-operator"


def _stamp(t: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if t is None else t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(stamp: str | None) -> float:
    if not stamp:
        return 0.0
    return datetime.strptime(stamp.rstrip("Z")[:26], "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=UTC).timestamp()


class LeaderElector:
    """Acquire, renew and release one Lease for ``identity``."""

    def __init__(
        self,
        kube: KubeClient,
        namespace: str,
        name: str,
        identity: str,
        *,
        duration_s: float = 15.0,
        renew_s: float = 5.0,
    ) -> None:
        self.kube, self.namespace, self.name, self.identity = kube, namespace, name, identity
        self.duration_s, self.renew_s = duration_s, renew_s
        self.path = collection_path("coordination.k8s.io", "v1", "leases", namespace) + f"/{name}"
        self.renewed = 0.0  # monotonic time of the last successful acquire/renew

    async def try_acquire(self) -> bool:
        """One round: take (or keep) the Lease if it is free, expired or ours."""
        lease = await self.kube.get(self.path)
        spec: dict[str, Any] = (lease or {}).get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        expires = _parse(spec.get("renewTime")) + float(spec.get("leaseDurationSeconds") or self.duration_s)
        if holder and holder != self.identity and time.time() < expires:
            return False
        new_spec = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": int(self.duration_s),
            "renewTime": _stamp(),
            "acquireTime": spec.get("acquireTime") if holder == self.identity else _stamp(),
            "leaseTransitions": int(spec.get("leaseTransitions") or 0) + (holder != self.identity),
        }
        body: dict[str, Any] = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "spec": new_spec,
                "metadata": {"name": self.name, "namespace": self.namespace}}  # fmt: skip
        try:
            if lease is None:
                await self.kube.create(self.path.rsplit("/", 1)[0], body)
            else:
                body["metadata"]["resourceVersion"] = lease["metadata"]["resourceVersion"]
                await self.kube.request("PUT", self.path, body)
        except KubeError as e:
            if e.status in (409, 422):
                return False  # someone else wrote first
            raise
        if holder != self.identity:
            log.info("acquired leadership (Lease %s/%s, previous holder %r)", self.namespace, self.name, holder)
        self.renewed = time.monotonic()
        return True

    async def acquire(self) -> None:
        """Wait until this replica leads."""
        announced = False
        while True:
            try:
                if await self.try_acquire():
                    return
            except (KubeError, OSError) as e:
                log.warning("leader election: %s", e)
            if not announced:
                log.info("waiting for leadership (Lease %s/%s held by another replica)", self.namespace, self.name)
                announced = True
            await asyncio.sleep(self.renew_s / 2)

    async def keep(self) -> None:
        """Renew until leadership is lost (returns then): the caller must stop acting."""
        while True:
            await asyncio.sleep(self.renew_s)
            try:
                if not await self.try_acquire():
                    log.error("leadership lost: another replica holds the Lease")
                    return
            except (KubeError, OSError) as e:
                log.warning("renewing the Lease failed: %s", e)
                if time.monotonic() - self.renewed > self.duration_s - self.renew_s:
                    log.error("leadership lost: the Lease could not be renewed in time")
                    return

    async def release(self) -> None:
        """Give the Lease up (clean shutdown): a waiting replica takes over at once."""
        try:
            lease = await self.kube.get(self.path)
            if lease and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                lease["spec"]["holderIdentity"] = ""
                lease["spec"]["renewTime"] = _stamp(0)
                await self.kube.request("PUT", self.path, lease)
        except (KubeError, OSError) as e:
            log.warning("releasing the Lease failed: %s", e)


@contextlib.asynccontextmanager
async def standby_liveness(settings: OperatorSettings) -> AsyncIterator[None]:
    """Answer the liveness probe (``/healthz``) while waiting: kopf serves it only once leading."""
    if not settings.liveness_port:
        yield
        return

    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response({"standby": True})

    app = web.Application()
    app.add_routes([web.get("/healthz", healthz)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, settings.bind_host, settings.liveness_port).start()
    try:
        yield
    finally:
        await runner.cleanup()


async def run_as_leader(elector: LeaderElector, run: Callable[[], Awaitable[None]], stop_s: float = 10.0) -> bool:
    """Run ``run()`` only while leading. Returns True when ``run()`` ended by itself; False when
    leadership was lost: ``run()`` was cancelled and awaited (up to ``stop_s``), and the caller must
    exit so that the process restarts as a candidate (controller-runtime exits the same way).

    The exit happens outside the event loop, after ``run()`` has stopped: raising ``SystemExit``
    here left kopf's tasks mid-cancellation, and asyncio logged their tracebacks."""
    await elector.acquire()
    work = asyncio.ensure_future(run())
    keep = asyncio.ensure_future(elector.keep())
    try:
        done, _ = await asyncio.wait({work, keep}, return_when=asyncio.FIRST_COMPLETED)
        if keep in done:
            work.cancel()
            await asyncio.wait({work}, timeout=stop_s)
            if work.done() and not work.cancelled() and work.exception() is not None:
                log.warning("the operator stopped with an error after losing leadership: %r", work.exception())
            return False
        await work
        return True
    finally:
        keep.cancel()
        if not work.done():
            work.cancel()
        await elector.release()
