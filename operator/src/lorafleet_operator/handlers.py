"""kopf wiring: watches feed an in-memory index, a work queue drives ``Reconciler`` passes.

- ``@kopf.on.event`` for DynamoModels, worker pods (label ``nvidia.com/dynamo-base-model-hash``)
  and our sync Jobs only update caches and queue model keys; they never block on workers.
  Pods are indexed by (namespace, base-model hash); a pod appearing, vanishing, changing IP or
  flipping Ready re-queues every model of its base model (re-placement).
- ``Runtime`` runs ``reconcile_workers`` tasks over a de-duplicating queue, so one model is
  never reconciled twice at once, and patches ``status`` only when it changed (merge patch).
- A drift timer invalidates the per-pod ``GET /v1/loras`` cache and re-queues every model
  every ``drift_interval`` seconds (worker restarts, lost adapters).
- ``@kopf.on.delete`` (finalizer ``nvidia.com/finalizer``) unloads with a bounded wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

import kopf
from lorafleet_sync.ids import BASE_MODEL_HASH_LABEL

from lorafleet_operator import metrics
from lorafleet_operator import status as st
from lorafleet_operator.kube import EventPoster, KubeClient, collection_path
from lorafleet_operator.reconcile import Model, Pod, Reconciler
from lorafleet_operator.settings import Settings
from lorafleet_operator.syncjob import MANAGED_BY
from lorafleet_operator.workqueue import WorkQueue

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "nvidia.com", "v1alpha1", "dynamomodels"
FINALIZER = "nvidia.com/finalizer"
ANNOTATION_PREFIX = "lorafleet.nvidia.com"

Key = tuple[str, str]
StatusWriter = Callable[[Model, Mapping[str, Any]], Awaitable[dict[str, Any] | None]]


class Runtime:
    """Caches (models, pods by base hash), the queue, and the reconcile workers."""

    def __init__(self, settings: Settings, reconciler: Reconciler, write_status: StatusWriter) -> None:
        self.settings = settings
        self.reconciler = reconciler
        self.write_status = write_status
        self.queue: WorkQueue[Key] = WorkQueue()
        self.models: dict[Key, dict[str, Any]] = {}
        self.pods: dict[Key, Pod] = {}
        self.phases: dict[Key, str] = {}
        self._locks: dict[Key, asyncio.Lock] = {}
        self._tasks: list[asyncio.Task[None]] = []

    # ---- inputs -----------------------------------------------------------------------
    def on_model(self, kind: str | None, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        if kind == "DELETED":
            self.models.pop(key, None)
            self.phases.pop(key, None)
            self.queue.forget(key)
            return
        self.models[key] = dict(body)
        if not meta.get("deletionTimestamp"):
            self.queue.add(key)

    def on_pod(self, kind: str | None, body: Mapping[str, Any]) -> None:
        pod = Pod.from_body(body)
        key = (pod.namespace, pod.name)
        old = self.pods.get(key)
        if kind == "DELETED":
            self.pods.pop(key, None)
            self.reconciler.forget_pod(pod.uid)
            self.requeue_base(pod.namespace, pod.base_hash)
            return
        self.pods[key] = pod
        if old is not None and (old.uid, old.ip, old.ready, old.base_hash) == (
            pod.uid,
            pod.ip,
            pod.ready,
            pod.base_hash,
        ):
            return
        if old is not None and (old.uid != pod.uid or old.ready != pod.ready or old.ip != pod.ip):
            self.reconciler.forget_pod(old.uid)  # a restarted worker comes back empty
        if old is not None and old.base_hash != pod.base_hash:
            self.requeue_base(pod.namespace, old.base_hash)
        self.requeue_base(pod.namespace, pod.base_hash)

    def on_job(self, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        for owner in meta.get("ownerReferences") or []:
            if owner.get("kind") == "DynamoModel":
                key = (meta.get("namespace", ""), owner.get("name", ""))
                if key in self.models:
                    self.queue.add(key)

    def requeue_base(self, namespace: str, base_hash: str | None) -> None:
        for key, body in self.models.items():
            if key[0] == namespace and Model.from_body(body).base_hash == base_hash:
                self.queue.add(key)

    def requeue_all(self) -> None:
        for key in self.models:
            self.queue.add(key)

    def pods_of(self, model: Model) -> list[Pod]:
        return [p for p in self.pods.values() if p.namespace == model.namespace and p.base_hash == model.base_hash]

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._work()) for _ in range(self.settings.reconcile_workers)]
        self.spawn(self._drift())

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a background task for the runtime's lifetime (cancelled by ``stop``)."""
        self._tasks.append(asyncio.create_task(coro))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await self.reconciler.client.close()

    async def _drift(self) -> None:
        while True:
            await asyncio.sleep(self.settings.drift_interval)
            self.reconciler.invalidate_listings()
            self.requeue_all()

    async def _work(self) -> None:
        while True:
            key = await self.queue.get()
            try:
                await self.reconcile_key(key)
            except Exception:
                log.exception("reconcile of %s/%s failed", *key)
                metrics.RECONCILES.labels("error").inc()
                self.queue.add_after(key, self.settings.retry_base * 4)
            finally:
                self.queue.done(key)

    async def reconcile_key(self, key: Key) -> None:
        body = self.models.get(key)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            model = Model.from_body(body)
            current: dict[str, Any] = dict(model.status)

            async def write(new: dict[str, Any]) -> None:
                nonlocal current
                if await self._write(key, model, new, current):
                    current = new

            started = time.monotonic()
            result = await self.reconciler.reconcile(model, self.pods_of(model), progress=write)
            metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
            await write(result.status)
            metrics.RECONCILES.labels("requeue" if result.requeue_after else "ok").inc()
            self._set_phase(key, result.status.get("phase"))
            if result.requeue_after:
                self.queue.add_after(key, result.requeue_after)

    async def _write(self, key: Key, model: Model, new: Mapping[str, Any], current: Mapping[str, Any]) -> bool:
        patch = st.status_patch(new, current)
        if not patch:
            return False
        updated = await self.write_status(model, patch)
        if updated is not None and key in self.models:
            self.models[key] = updated
        return True

    def _set_phase(self, key: Key, phase: str | None) -> None:
        old = self.phases.get(key)
        if old == phase:
            return
        if old:
            metrics.MODELS.labels(old).dec()
        if phase:
            self.phases[key] = phase
            metrics.MODELS.labels(phase).inc()

    async def finalize(self, body: Mapping[str, Any]) -> list[str]:
        """Unload a deleted model everywhere (bounded wait) and forget it."""
        model = Model.from_body(body)
        self.models[model.key] = dict(body)  # carries deletionTimestamp: workers skip it
        async with self._locks.setdefault(model.key, asyncio.Lock()):
            unloaded: list[str] = []
            if model.is_lora:
                unloaded = await self.reconciler.finalize(model, self.pods_of(model), self.settings.delete_timeout)
        self.queue.forget(model.key)
        self._set_phase(model.key, None)
        self.phases.pop(model.key, None)
        self._locks.pop(model.key, None)
        return unloaded

    def idle(self) -> bool:
        return self.queue.idle()


# ---- kopf handlers -------------------------------------------------------------------------
def _runtime(memo: Any) -> Runtime:
    runtime: Runtime = memo["runtime"]
    return runtime


@kopf.on.startup()
async def _configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    # No cluster scanning: kopf would list/watch Namespaces and CRDs (cluster-scoped reads that the
    # least-privilege RBAC does not grant) and retry each 403 with backoff for ~54 s before
    # starting any watch, so the first DynamoModel after an install waited a minute. The watched
    # namespaces are explicit and the CRD is installed before the operator (Helm's crds/), so a
    # static setup loses nothing; a CRD installed after the operator needs an operator restart.
    settings.scanning.disabled = True
    runtime = _runtime(memo)
    await prime_pods(memo["kube"], runtime)
    runtime.start()
    runtime.spawn(memo["events"].run())


async def prime_pods(kube: KubeClient, runtime: Runtime) -> None:
    """List worker pods once before reconciling, so a restarted operator never places on half a list."""
    namespaces: list[str | None] = [None] if runtime.settings.all_namespaces else list(runtime.settings.namespaces)
    for ns in namespaces:
        listing = await kube.request(
            "GET", collection_path("", "v1", "pods", ns), params={"labelSelector": BASE_MODEL_HASH_LABEL}
        )
        for item in listing.get("items") or []:
            runtime.on_pod("ADDED", item)


@kopf.on.cleanup()
async def _cleanup(memo: kopf.Memo, **_: Any) -> None:
    await _runtime(memo).stop()


@kopf.on.event(GROUP, VERSION, PLURAL)
async def _model_event(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    _runtime(memo).on_model(event.get("type"), body)


@kopf.on.event("", "v1", "pods", labels={BASE_MODEL_HASH_LABEL: kopf.PRESENT})
async def _pod_event(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    _runtime(memo).on_pod(event.get("type"), body)


@kopf.on.event("batch", "v1", "jobs", labels={"app.kubernetes.io/managed-by": MANAGED_BY})
async def _job_event(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    _runtime(memo).on_job(body)


@kopf.on.delete(GROUP, VERSION, PLURAL)
async def _model_deleted(body: kopf.Body, memo: Any, logger: Any, **_: Any) -> None:
    unloaded = await _runtime(memo).finalize(body)
    logger.info("unloaded %s from %s", body.get("spec", {}).get("modelName"), unloaded or "no pod")


def event_sink(poster: EventPoster) -> Callable[[Model, str, str, str], None]:
    """Post Kubernetes Events on the DynamoModel (and log them)."""

    def emit(model: Model, kind: str, reason: str, message: str) -> None:
        ref = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "DynamoModel", "name": model.name,
               "namespace": model.namespace, "uid": model.uid}  # fmt: skip
        poster.post(ref, kind, reason, message)
        log.info("%s/%s %s: %s", model.namespace, model.name, reason, message)

    return emit


def kube_status_writer(kube: KubeClient) -> StatusWriter:
    async def write(model: Model, patch: Mapping[str, Any]) -> dict[str, Any] | None:
        path = collection_path(GROUP, VERSION, PLURAL, model.namespace) + f"/{model.name}/status"
        try:
            return await kube.merge_patch(path, {"status": dict(patch)})
        except Exception as e:
            if getattr(e, "status", None) == 404:
                return None  # deleted meanwhile
            raise

    return write
