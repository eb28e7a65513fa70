"""The runtime controller: watches feed an in-memory index, a work queue drives ``Reconciler`` passes.

- The DynamoModel, worker pod (label ``nvidia.com/dynamo-base-model-hash``) and sync Job watches
  only update caches and queue model keys; they never block on workers. A pod leaving (unready,
  gone, new IP or uid) re-queues only the models placed on it; a pod joining re-queues only the
  models whose top-``replicas`` set it enters (``placement.takes``, with the replicas each model's
  last pass returned in its ``Result``).
- Each piece of state has one owner: ``index.ModelIndex`` (every DynamoModel once, refreshed by
  the answers of our own status and finalizer writes, and name ownership), ``inventory.WorkerInventory``
  (pods and what they hold; the reconciler and the drift pass share it), ``finalizers.Finalizers``
  and ``workqueue.WorkQueue`` (de-duplication and per-key failure backoff, as client-go's
  rate-limited queue). ``Runtime`` wires them and runs the loops.
- Name ownership: among live LoRA DynamoModels with the same (base model, ``modelName``) in the
  watched scope the oldest (creationTimestamp, then namespace/name) owns the name; the others
  get ``ModelNameConflict`` and are never loaded. A change of claimants re-queues them all, so
  deleting the owner hands the name over (the adapter stays loaded: no gap).
- ``Runtime`` runs ``reconcile_workers`` tasks over the queue, so one model is never reconciled
  twice at once, and patches ``status`` only when it changed (merge patch). The pass returns a
  ``reconcile.Result`` and the runtime alone decides what to queue from it: a failed pass again
  with ``add_rate_limited`` (a successful one ``forget``s its failures), ``requeue_after`` with
  ``add_after``, a ``followup`` once its status is published.
- ``catalog.Catalogs`` tells every Ready worker pod the catalogue of its base model (the adapters
  it may load on demand), fed by the index's changes and the pod events.
- A drift timer runs ``drift.drift_pass`` every ``drift_interval`` seconds: one listing per pod,
  re-queueing only models whose pods differ, unloading orphans the ledger says we placed.
- DynamoModels are watched by the runtime's own ``Informer`` (``watch_models``), not by kopf:
  kopf's per-object machinery (a task per object, a deep copy and a cause detection per event,
  its own finalizer, diff-base and progress annotations: several PATCHes per object) costs CPU
  in proportion to the objects. The runtime adds the finalizer ``nvidia.com/finalizer`` itself,
  in the reconcile worker's first pass over an object (one PATCH), and on deletion unloads with a
  bounded wait, then removes it (``finalizers.Finalizers``, retried with backoff). kopf runs the
  pod and Job watches, liveness and signal handling (the handlers at the end of this module).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

import kopf
from lorafleet_sync.ids import BASE_MODEL_HASH_LABEL

from lorafleet_operator import metrics
from lorafleet_operator import status as st
from lorafleet_operator.api import KIND, model_path, models_path, object_reference
from lorafleet_operator.autoscale import RouterDemand
from lorafleet_operator.catalog import Catalogs
from lorafleet_operator.finalizers import Finalizers
from lorafleet_operator.gates import PodGates
from lorafleet_operator.index import Key, ModelIndex, key_of
from lorafleet_operator.inventory import WorkerInventory
from lorafleet_operator.kube import EventPoster, Informer, KubeClient, collection_path
from lorafleet_operator.placement import takes
from lorafleet_operator.reconcile import Reconciler
from lorafleet_operator.resources import Model, Pod
from lorafleet_operator.settings import OperatorSettings
from lorafleet_operator.syncjob import MANAGED_BY
from lorafleet_operator.workqueue import WorkQueue

log = logging.getLogger(__name__)

__all__ = ["Runtime", "event_sink", "kube_status_writer", "prime_pods"]
ANNOTATION_PREFIX = "lorafleet.nvidia.com"

StatusWriter = Callable[[Model, Mapping[str, Any]], Awaitable[dict[str, Any] | None]]


class Runtime:
    """Wires the pieces, each the one owner of its state: the object index (``ModelIndex``: each
    DynamoModel once, and name ownership), the worker inventory (pods and what they hold, shared with
    the reconciler and the drift pass), the finalizers (``Finalizers``), and the rate-limited work
    queue (per-key backoff); runs the reconcile workers and the background loops over them."""

    def __init__(
        self,
        settings: OperatorSettings,
        reconciler: Reconciler,
        write_status: StatusWriter,
        kube: KubeClient | None = None,
    ) -> None:
        self.settings = settings
        self.reconciler = reconciler
        self.write_status = write_status
        self.kube = kube
        self.queue: WorkQueue[Key] = WorkQueue(settings.retry_base, settings.retry_max)
        self.inventory: WorkerInventory = reconciler.inventory  # one inventory: the reconciler reads what we feed
        self.catalogs = Catalogs(
            reconciler.client, reconciler.port, lambda ns, h: self.index.catalog(ns, h), self.inventory.pods_of,
            settings.retry_base, settings.retry_max,
        )  # fmt: skip
        self.index = ModelIndex(on_claim_change=self.queue.add, on_change=self.catalogs.on_model)
        self.finalizers = Finalizers(kube, self.finalize, settings.retry_base, settings.retry_max)
        self.gates = (
            PodGates(kube, lambda ns, h: [m for _k, m in self.index.loras_of(ns, h)]) if kube is not None else None
        )
        self.phases: dict[Key, str] = {}
        self.replicas: dict[Key, int] = {}  # LoRA models: the pods each one's last pass wants (Result.replicas)
        self._locks: dict[Key, asyncio.Lock] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._claims: defaultdict[tuple[str, str], set[str]] = defaultdict(set)  # names to write down in bulk
        self._claims_wakeup = asyncio.Event()

    # ---- inputs -----------------------------------------------------------------------
    def on_model(self, kind: str | None, body: Mapping[str, Any]) -> None:
        key = key_of(body)
        if kind == "DELETED":
            self.index.remove(key)
            self.phases.pop(key, None)
            self.replicas.pop(key, None)
            self.queue.discard(key)
            if self.gates is not None:
                self.gates.after_pass(key)
            return
        old, model = self.index.apply(body)
        if model.is_lora and not model.deleting and (old is None or old.served_name != model.served_name):
            self._claims[(model.namespace, model.base_hash)].add(model.model_name)
            self._claims_wakeup.set()
        if not model.deleting and (
            old is None or (old.uid, old.generation, old.deleting) != (model.uid, model.generation, False)
        ):
            self.queue.add(key)  # new or changed spec; our own status writes (and metadata edits) do not re-queue

    def on_model_event(self, kind: str | None, body: Mapping[str, Any]) -> None:
        """The DynamoModel watch: update the index; objects being deleted go to the finalizers."""
        if self.finalizers.stale(kind, body):
            return
        self.on_model(kind, body)
        self.finalizers.on_event(kind, body)

    def watch_models(self) -> None:
        """Start the DynamoModel informers (one per watched namespace, or one cluster-wide)."""
        assert self.kube is not None
        for ns in self.settings.watched():
            self.spawn(Informer(self.kube, models_path(ns), self.on_model_event).run())

    def owner(self, model: Model) -> Model | None:
        """The oldest live DynamoModel claiming ``model``'s served name (see ``ModelIndex.owner``)."""
        return self.index.owner(model)

    def wanted(self, namespace: str, base_hash: str, name: str) -> bool:
        return self.index.wanted(namespace, base_hash, name)

    def on_pod(self, kind: str | None, body: Mapping[str, Any]) -> None:
        old, pod = self.inventory.on_pod(kind, body)
        self.catalogs.on_pod(pod, old)
        was = old is not None and old.ready and bool(old.ip)
        now = pod.ready and bool(pod.ip)
        moved = old is not None and (old.uid, old.ip, old.base_hash) != (pod.uid, pod.ip, pod.base_hash)
        if old is not None and was and (moved or not now):
            self._requeue_placed_on(old)
        joined = self._requeue_taken_by(pod) if now and (not was or moved) else None
        if self.gates is not None:
            self.gates.on_pod(pod, joined)

    def _requeue_placed_on(self, pod: Pod) -> None:
        """A pod left: only the models it was placed on (or still listed as an endpoint) move."""
        for key, model in self.index.loras_of(pod.namespace, pod.base_hash):
            endpoints = model.status.get("endpoints") or []
            if pod.name in (model.status.get("placement") or []) or any(
                e.get("podName") == pod.name for e in endpoints
            ):
                self.queue.add(key)

    def _requeue_taken_by(self, pod: Pod) -> set[Key]:
        """A pod joined: only the models whose top-``replicas`` set it enters move (a model with no
        pass yet is queued anyway). Returns the LoRA models queued (the pod's readiness gate waits for them)."""
        queued = set()
        for key, model in self.index.loras_of(pod.namespace, pod.base_hash):
            replicas = self.replicas.get(key)
            if replicas is None or takes(model.model_name, model.status.get("placement") or [], replicas, pod.name):
                self.queue.add(key)
                queued.add(key)
        for key in self.index.bases_of(pod.namespace, pod.base_hash):
            self.queue.add(key)  # base models list every pod
        return queued

    def on_job(self, body: Mapping[str, Any], kind: str | None = None) -> None:
        meta = body.get("metadata") or {}
        self.reconciler.observe_job(body, deleted=kind == "DELETED")
        for owner in meta.get("ownerReferences") or []:
            if owner.get("kind") == KIND:
                key = (meta.get("namespace", ""), owner.get("name", ""))
                if key in self.index:
                    self.queue.add(key)

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._work()) for _ in range(self.settings.reconcile_workers)]
        self.spawn(self._write_claims())
        self.spawn(self.catalogs.run())
        if self.gates is not None:
            self.spawn(self.gates.run())
        self.spawn(self._drift())
        if self.settings.demand_urls:
            self.spawn(self._autoscale(RouterDemand(self.settings.demand_urls)))

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a background task for the runtime's lifetime (cancelled by ``stop``)."""
        self._tasks.append(asyncio.create_task(coro))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.finalizers.stop()
        self._tasks = []
        await self.reconciler.close()

    async def _write_claims(self) -> None:
        """Write the names of newly seen LoRA DynamoModels into the ledger in bulk (write-ahead of
        their first loads): a cold start of thousands of models costs a few ledger writes, where a
        claim per first load would be group-committed only as many at a time as reconcile workers."""
        while True:
            await self._claims_wakeup.wait()
            self._claims_wakeup.clear()
            claims, self._claims = self._claims, defaultdict(set)
            for (namespace, base_hash), names in claims.items():
                try:
                    await self.reconciler.claim_names(namespace, base_hash, names)
                except Exception:
                    log.exception("writing %d adapter names to the ledger failed (each first load claims its own)",
                                  len(names))  # fmt: skip

    async def _drift(self) -> None:
        while True:
            await asyncio.sleep(self.settings.drift_interval)
            try:
                await self.drift()
            except Exception:
                log.exception("drift pass failed")

    async def _autoscale(self, demand: RouterDemand) -> None:
        """Every ``autoscale_interval``: read the routers' demand, re-queue autoscaled models whose count changed."""
        try:
            while True:
                await asyncio.sleep(self.settings.autoscale_interval)
                try:
                    await self.reconciler.autoscale(list(self.index.items()), demand, self.queue.add)
                except Exception:
                    log.exception("autoscale pass failed")
        finally:
            await demand.close()

    async def drift(self) -> None:
        """One drift pass over every Ready worker pod (see ``drift.drift_pass``)."""
        await self.reconciler.drift(self.index.owners(), self.queue.add, self.wanted)

    async def _work(self) -> None:
        while True:
            key = await self.queue.get()
            try:
                await self.reconcile_key(key)
            except Exception:
                log.exception("reconcile of %s/%s failed", *key)
                metrics.RECONCILES.labels("error").inc()
                self.queue.add_rate_limited(key)
            else:
                if self.gates is not None:  # its status is published: pods waiting on it may open
                    self.gates.after_pass(key)
            finally:
                self.queue.done(key)

    async def reconcile_key(self, key: Key) -> None:
        body = self.index.body(key)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            ensured = await self.finalizers.ensure(body)
            if ensured is None:
                return
            if ensured is not body:
                self.index.refresh(ensured)
            model = Model.from_body(ensured)
            current: dict[str, Any] = dict(model.status)
            wrote = False

            async def write(new: dict[str, Any]) -> None:
                nonlocal current, wrote
                if await self._write(model, new, current):
                    current, wrote = new, True

            owner = self.index.owner(model)
            started = time.monotonic()
            result = await self.reconciler.reconcile(
                model,
                self.pods_of(model),
                progress=write,
                owner=owner if owner is not None and owner.key != key else None,
            )
            metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
            await write(result.status)
            outcome = "error" if result.failed else "requeue" if result.requeue_after else "ok"
            metrics.RECONCILES.labels(outcome).inc()
            self._set_phase(key, result.status.get("phase"))
            if result.replicas is not None:
                self.replicas[key] = result.replicas
            if result.failed:
                self.queue.add_rate_limited(key)
            else:
                self.queue.forget(key)
            if result.requeue_after:
                self.queue.add_after(key, result.requeue_after)
            if wrote and result.followup:  # one more pass sees the published status (leavers to unload)
                self.queue.add(key)

    def pods_of(self, model: Model) -> list[Pod]:
        return self.inventory.pods_of(model.namespace, model.base_hash)

    async def _write(self, model: Model, new: Mapping[str, Any], current: Mapping[str, Any]) -> bool:
        patch = st.status_patch(new, current)
        if not patch:
            return False
        self.index.refresh(await self.write_status(model, patch))  # read at once by owner(), drift, next pass
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
        meta = body.get("metadata") or {}
        if not meta.get("deletionTimestamp"):
            body = {**body, "metadata": {**meta, "deletionTimestamp": st.now_iso()}}
        model = Model.from_body(body)
        owner = self.index.owner(model)
        self.on_model("MODIFIED", body)  # deleting: workers skip it, the name is handed over
        async with self._locks.setdefault(model.key, asyncio.Lock()):
            unloaded: list[str] = []
            loser = owner is not None and owner.key != model.key  # never loaded: the name is someone else's
            if model.is_lora and (loser or self.wanted(model.namespace, model.base_hash, model.model_name)):
                # the adapter is (or is about to be) another DynamoModel's: keep it loaded, and
                # (make-before-break) keep this object until the successor publishes endpoints
                self.reconciler.forget_model(model, keep_loaded=True)
                if not loser:
                    await self._await_successor(model)
            elif model.is_lora:
                unloaded = await self.reconciler.finalize(model, self.pods_of(model), self.settings.delete_timeout)
        self.queue.discard(model.key)
        self._set_phase(model.key, None)
        self.phases.pop(model.key, None)
        self.replicas.pop(model.key, None)
        self._locks.pop(model.key, None)
        return unloaded

    async def _await_successor(self, model: Model) -> None:
        """Wait (at most ``delete_timeout``) until the new owner of ``model``'s name serves it."""
        deadline = time.monotonic() + self.settings.delete_timeout
        while time.monotonic() < deadline:
            successor = self.index.owner(model)
            if successor is None or successor.status.get("readyEndpoints"):
                return
            await asyncio.sleep(0.2)
        log.warning("handing %s over: the next owner serves no endpoint yet", model.model_name)

    def idle(self) -> bool:
        return self.queue.idle()


# ---- kopf handlers (pods, Jobs, start-up and clean-up) --------------------------------------------
def _runtime(memo: Any) -> Runtime:
    runtime: Runtime = memo["runtime"]
    return runtime


@kopf.on.startup()
async def _configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # kopf handles no DynamoModel (see the module docstring); its storages would only matter for
    # changing handlers, and it has none.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    # No cluster scanning: kopf would list/watch Namespaces and CRDs (cluster-scoped reads that the
    # least-privilege RBAC does not grant) and retry each 403 with backoff for ~54 s before
    # starting any watch, so the first DynamoModel after an install waited a minute. The watched
    # namespaces are explicit and the DynamoModel watch is our own informer (kube.Informer), which
    # lists again after a 404, so a static setup loses nothing: a CRD installed later is picked up.
    settings.scanning.disabled = True
    # Server-side label selectors: the API server sends only worker pods and our sync Jobs (the
    # handlers' `labels=` filters alone would filter every pod of the namespace client-side).
    settings.watching.label_selectors["v1", "pods"] = BASE_MODEL_HASH_LABEL
    settings.watching.label_selectors["batch", "v1", "jobs"] = f"app.kubernetes.io/managed-by={MANAGED_BY}"
    # "Handler ... succeeded" for every watch event is noise at thousands of objects (and CPU);
    # our own log lines say what was done. --verbose keeps kopf's.
    if not log.isEnabledFor(logging.DEBUG):
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    runtime = _runtime(memo)
    await prime_pods(memo["kube"], runtime)
    runtime.start()
    runtime.watch_models()
    runtime.spawn(memo["events"].run())


async def prime_pods(kube: KubeClient, runtime: Runtime) -> None:
    """List worker pods once before reconciling, so a restarted operator never places on half a list."""
    for ns in runtime.settings.watched():
        listing = await kube.request(
            "GET", collection_path("", "v1", "pods", ns), params={"labelSelector": BASE_MODEL_HASH_LABEL}
        )
        for item in listing.get("items") or []:
            runtime.on_pod("ADDED", item)


@kopf.on.cleanup()
async def _cleanup(memo: kopf.Memo, **_: Any) -> None:
    await _runtime(memo).stop()


@kopf.on.event("", "v1", "pods", labels={BASE_MODEL_HASH_LABEL: kopf.PRESENT})
async def _pod_event(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    _runtime(memo).on_pod(event.get("type"), body)


@kopf.on.event("batch", "v1", "jobs", labels={"app.kubernetes.io/managed-by": MANAGED_BY})
async def _job_event(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    _runtime(memo).on_job(body, event.get("type"))


def event_sink(poster: EventPoster) -> Callable[[Model, str, str, str], None]:
    """Post Kubernetes Events on the DynamoModel (and log them)."""

    def emit(model: Model, kind: str, reason: str, message: str) -> None:
        poster.post(object_reference(model.namespace, model.name, model.uid), kind, reason, message)
        log.info("%s/%s %s: %s", model.namespace, model.name, reason, message)

    return emit


def kube_status_writer(kube: KubeClient) -> StatusWriter:
    async def write(model: Model, patch: Mapping[str, Any]) -> dict[str, Any] | None:
        path = model_path(model.namespace, model.name) + "/status"
        try:
            return await kube.merge_patch(path, {"status": dict(patch)})
        except Exception as e:
            if getattr(e, "status", None) == 404:
                return None  # deleted meanwhile
            raise

    return write
