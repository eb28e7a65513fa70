"""kopf wiring: watches feed an in-memory index, a work queue drives ``Reconciler`` passes.

- ``@kopf.on.event`` for DynamoModels, worker pods (label ``nvidia.com/dynamo-base-model-hash``)
  and our sync Jobs only update caches and queue model keys; they never block on workers.
  A pod leaving (unready, gone, new IP or uid) re-queues only the models placed on it; a pod
  joining re-queues only the models whose top-``replicas`` set it enters (``placement.takes``).
- Name ownership: among live LoRA DynamoModels with the same (base model, ``modelName``) in the
  watched scope the oldest (creationTimestamp, then namespace/name) owns the name; the others
  get ``ModelNameConflict`` and are never loaded. A change of claimants re-queues them all, so
  deleting the owner hands the name over (the adapter stays loaded: no gap).
- ``Runtime`` runs ``reconcile_workers`` tasks over a de-duplicating queue, so one model is
  never reconciled twice at once, and patches ``status`` only when it changed (merge patch).
- A drift timer runs ``drift.drift_pass`` every ``drift_interval`` seconds: one listing per pod,
  re-queueing only models whose pods differ, unloading orphans the ledger says we placed.
- DynamoModels are watched by the runtime's own ``Informer`` (``watch_models``), not by kopf:
  kopf's per-object machinery (a task per object, a deep copy and a cause detection per event,
  its own finalizer, diff-base and progress annotations: several PATCHes per object) was most
  of the operator's CPU at 10,000 models. The runtime adds the finalizer ``nvidia.com/finalizer``
  itself, in the reconcile worker's first pass over an object (one PATCH), and on deletion
  unloads with a bounded wait, then removes it (``finalize_and_release``, retried with
  backoff). kopf still runs the pod and Job watches, liveness and signal handling.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

import kopf
from lorafleet_sync.ids import BASE_MODEL_HASH_LABEL

from lorafleet_operator import metrics
from lorafleet_operator import status as st
from lorafleet_operator.autoscale import RouterDemand, autoscale_pass
from lorafleet_operator.drift import drift_pass
from lorafleet_operator.kube import EventPoster, Informer, KubeClient, KubeError, collection_path
from lorafleet_operator.placement import takes
from lorafleet_operator.reconcile import Reconciler
from lorafleet_operator.resources import Model, Pod
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
    """Caches (models, pods by base hash), the name owners, the queue, and the reconcile workers."""

    def __init__(
        self, settings: Settings, reconciler: Reconciler, write_status: StatusWriter, kube: KubeClient | None = None
    ) -> None:
        self.settings = settings
        self.reconciler = reconciler
        self.write_status = write_status
        self.kube = kube  # finalizers are added and removed through it (None: no finalizers, tests)
        self._finalizing: dict[Key, asyncio.Task[None]] = {}
        self._finalized: set[str] = set()  # uids released, until their DELETED event (stale events)
        self.queue: WorkQueue[Key] = WorkQueue()
        self.models: dict[Key, dict[str, Any]] = {}
        self.parsed: dict[Key, Model] = {}
        self.pods: dict[Key, Pod] = {}
        self.phases: dict[Key, str] = {}
        self.claimants: defaultdict[tuple[str, str], set[Key]] = defaultdict(set)  # served name -> live LoRAs
        self._locks: dict[Key, asyncio.Lock] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._claims: defaultdict[tuple[str, str], set[str]] = defaultdict(set)  # names to write down in bulk
        self._claims_wakeup = asyncio.Event()
        self._pod_groups: dict[tuple[str, str], list[Pod]] = {}  # pods_of, until the next pod event

    # ---- inputs -----------------------------------------------------------------------
    def on_model(self, kind: str | None, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        old = self.parsed.get(key)
        if kind == "DELETED":
            self.models.pop(key, None)
            self.parsed.pop(key, None)
            self.phases.pop(key, None)
            self.queue.forget(key)
            self._claim(key, old, None)
            return
        model = Model.from_body(body)
        self.models[key] = dict(body)
        self.parsed[key] = model
        self._claim(key, old, model)
        if model.is_lora and not model.deleting and (old is None or old.served_name != model.served_name):
            self._claims[(model.namespace, model.base_hash)].add(model.model_name)
            self._claims_wakeup.set()
        if not model.deleting and (
            old is None or (old.uid, old.generation, old.deleting) != (model.uid, model.generation, False)
        ):
            self.queue.add(key)  # new or changed spec; our own status writes (and metadata edits) do not re-queue

    def on_model_event(self, kind: str | None, body: Mapping[str, Any]) -> None:
        """The DynamoModel watch: update the index; an object being deleted that still carries
        our finalizer is finalized (once at a time per object) and then released."""
        meta = body.get("metadata") or {}
        if kind == "DELETED":
            self._finalized.discard(meta.get("uid", ""))
        elif meta.get("uid") in self._finalized:
            return  # an event older than our finalizer removal: the object is as good as gone
        self.on_model(kind, body)
        key = (meta.get("namespace", ""), meta.get("name", ""))
        if kind == "DELETED" or not meta.get("deletionTimestamp") or FINALIZER not in (meta.get("finalizers") or []):
            return
        if key not in self._finalizing:
            task = asyncio.create_task(self.finalize_and_release(body))
            self._finalizing[key] = task
            task.add_done_callback(lambda _t: self._finalizing.pop(key, None))

    def watch_models(self) -> None:
        """Start the DynamoModel informers (one per watched namespace, or one cluster-wide)."""
        assert self.kube is not None
        namespaces: list[str | None] = [None] if self.settings.all_namespaces else list(self.settings.namespaces)
        for ns in namespaces:
            self.spawn(Informer(self.kube, collection_path(GROUP, VERSION, PLURAL, ns), self.on_model_event).run())

    def _object_path(self, namespace: str, name: str) -> str:
        return collection_path(GROUP, VERSION, PLURAL, namespace) + f"/{name}"

    async def _edit_finalizers(self, body: Mapping[str, Any], add: bool) -> dict[str, Any] | None:
        """Add or remove our finalizer (optimistic: a stale resourceVersion re-reads and retries).

        Returns the updated object (None when it is gone)."""
        assert self.kube is not None
        meta = body.get("metadata") or {}
        path = self._object_path(meta.get("namespace", ""), meta.get("name", ""))
        current: Mapping[str, Any] | None = body
        for _ in range(5):
            if current is None:
                return None
            cmeta = current.get("metadata") or {}
            finalizers = list(cmeta.get("finalizers") or [])
            if (FINALIZER in finalizers) == add:
                return dict(current)
            finalizers = [*finalizers, FINALIZER] if add else [f for f in finalizers if f != FINALIZER]
            patch = {"metadata": {"finalizers": finalizers, "resourceVersion": cmeta.get("resourceVersion")}}
            try:
                return await self.kube.merge_patch(path, patch)
            except KubeError as e:
                if e.status == 404:
                    return None
                if e.status != 409:
                    raise
            current = await self.kube.get(path)
        raise KubeError(409, f"{path}: finalizers changed concurrently five times")

    async def finalize_and_release(self, body: Mapping[str, Any]) -> None:
        """Finalize a deleted DynamoModel, then remove our finalizer; retried with backoff."""
        meta = body.get("metadata") or {}
        delay = self.settings.retry_base
        while True:
            try:
                unloaded = await self.finalize(body)
                log.info("%s/%s: unloaded %s from %s", meta.get("namespace"), meta.get("name"),
                         (body.get("spec") or {}).get("modelName"), unloaded or "no pod")  # fmt: skip
                await self._edit_finalizers(body, add=False)
                self._finalized.add(meta.get("uid", ""))
                return
            except Exception:
                log.exception(
                    "finalizing %s/%s failed; retrying in %.0f s", meta.get("namespace"), meta.get("name"), delay
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.settings.retry_max)

    async def _ensure_finalizer(self, key: Key, body: Mapping[str, Any]) -> dict[str, Any] | None:
        """Before the first load of an object: put our finalizer on it (one PATCH, once).

        Returns the object to reconcile (None: it is gone or being deleted meanwhile)."""
        if self.kube is None or FINALIZER in ((body.get("metadata") or {}).get("finalizers") or []):
            return dict(body)
        try:
            updated = await self._edit_finalizers(body, add=True)
        except KubeError as e:
            if e.status == 422:  # being deleted: no finalizer may be added any more
                return None
            raise
        if updated is None or (updated.get("metadata") or {}).get("deletionTimestamp"):
            return None
        if key in self.models:
            self.models[key] = updated
        return updated

    def _claim(self, key: Key, old: Model | None, new: Model | None) -> None:
        """Keep ``claimants`` current; a change of who claims a name re-queues every claimant of it."""
        before = old.served_name if old is not None and old.is_lora and not old.deleting else None
        after = new.served_name if new is not None and new.is_lora and not new.deleting else None
        if before == after:
            return
        for name in (before, after):
            if name is None:
                continue
            if name == before:
                self.claimants[name].discard(key)
            else:
                self.claimants[name].add(key)
            for other in self.claimants[name]:
                self.queue.add(other)
            if not self.claimants[name]:
                del self.claimants[name]

    def owner(self, model: Model) -> Model | None:
        """The oldest live DynamoModel claiming ``model``'s served name (None if there is none)."""
        keys = self.claimants.get(model.served_name)
        if not keys:
            return None
        return min((self.parsed[k] for k in keys if k in self.parsed), key=lambda m: m.seniority, default=None)

    def on_pod(self, kind: str | None, body: Mapping[str, Any]) -> None:
        pod = Pod.from_body(body)
        key = (pod.namespace, pod.name)
        old = self.pods.get(key)
        self._pod_groups.clear()
        if kind == "DELETED":
            self.pods.pop(key, None)
            pod = dataclasses.replace(pod, ready=False)
        else:
            self.pods[key] = pod
        was = old is not None and old.ready and bool(old.ip)
        now = pod.ready and bool(pod.ip)
        moved = old is not None and (old.uid, old.ip, old.base_hash) != (pod.uid, pod.ip, pod.base_hash)
        if old is not None and (moved or not now):
            self.reconciler.forget_pod(old.uid)  # a restarted worker comes back empty
        if old is not None and was and (moved or not now):
            self._requeue_placed_on(old)
        if now and (not was or moved):
            self._requeue_taken_by(pod)

    def _lora_models(self, namespace: str, base_hash: str | None) -> list[tuple[Key, Model]]:
        return [
            (k, m)
            for k, m in self.parsed.items()
            if k[0] == namespace and m.is_lora and not m.deleting and m.base_hash == base_hash
        ]

    def _requeue_placed_on(self, pod: Pod) -> None:
        """A pod left: only the models it was placed on (or still listed as an endpoint) move."""
        for key, model in self._lora_models(pod.namespace, pod.base_hash):
            endpoints = model.status.get("endpoints") or []
            if pod.name in (model.status.get("placement") or []) or any(
                e.get("podName") == pod.name for e in endpoints
            ):
                self.queue.add(key)

    def _requeue_taken_by(self, pod: Pod) -> None:
        """A pod joined: only the models whose top-``replicas`` set it enters move."""
        for key, model in self._lora_models(pod.namespace, pod.base_hash):
            replicas, _ = self.reconciler.replicas_for(model)
            if takes(model.model_name, model.status.get("placement") or [], replicas, pod.name):
                self.queue.add(key)
        for key, model in self.parsed.items():
            if key[0] == pod.namespace and not model.is_lora and model.base_hash == pod.base_hash:
                self.queue.add(key)  # base models list every pod

    def on_job(self, body: Mapping[str, Any], kind: str | None = None) -> None:
        meta = body.get("metadata") or {}
        observe = getattr(self.reconciler.sync, "observe", None)
        if observe is not None:
            observe(body, deleted=kind == "DELETED")  # the Job cache: no GET per pass
        for owner in meta.get("ownerReferences") or []:
            if owner.get("kind") == "DynamoModel":
                key = (meta.get("namespace", ""), owner.get("name", ""))
                if key in self.models:
                    self.queue.add(key)

    def requeue_all(self) -> None:
        for key in self.models:
            self.queue.add(key)

    def pods_of(self, model: Model) -> list[Pod]:
        """The pods of ``model``'s base model, sorted (kept per base model until a pod changes: a pass
        then neither scans every pod nor sorts them again)."""
        group = (model.namespace, model.base_hash)
        pods = self._pod_groups.get(group)
        if pods is None:
            pods = self._pod_groups[group] = sorted(
                p for p in self.pods.values() if p.namespace == model.namespace and p.base_hash == model.base_hash
            )
        return pods

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._work()) for _ in range(self.settings.reconcile_workers)]
        self.spawn(self._write_claims())
        self.spawn(self._drift())
        if self.settings.demand_urls:
            self.spawn(self._autoscale(RouterDemand(self.settings.demand_urls)))

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a background task for the runtime's lifetime (cancelled by ``stop``)."""
        self._tasks.append(asyncio.create_task(coro))

    async def stop(self) -> None:
        for task in [*self._tasks, *self._finalizing.values()]:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for task in list(self._finalizing.values()):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await self.reconciler.client.close()

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
                    await self.reconciler.ledger.claim_many(namespace, base_hash, names)
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
                    await autoscale_pass(self.reconciler.autoscaler, list(self.parsed.items()), demand, self.queue.add)
                except Exception:
                    log.exception("autoscale pass failed")
        finally:
            await demand.close()

    async def drift(self) -> None:
        """One drift pass over every Ready worker pod (see ``drift.drift_pass``)."""
        owners = [(k, m) for k, m in self.parsed.items() if m.is_lora and not m.deleting and self.owner(m) is m]
        await drift_pass(self.reconciler, list(self.pods.values()), owners, self.queue.add, self.wanted)

    def wanted(self, namespace: str, base_hash: str, name: str) -> bool:
        """Whether a live LoRA DynamoModel in ``namespace`` claims ``name`` for that base model."""
        return any(k[0] == namespace for k in self.claimants.get((base_hash, name), ()))

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
            body = await self._ensure_finalizer(key, body)
            if body is None:
                return
            model = Model.from_body(body)
            current: dict[str, Any] = dict(model.status)
            wrote = False

            async def write(new: dict[str, Any]) -> None:
                nonlocal current, wrote
                if await self._write(key, model, new, current):
                    current, wrote = new, True

            owner = self.owner(model)
            started = time.monotonic()
            result = await self.reconciler.reconcile(
                model,
                self.pods_of(model),
                progress=write,
                owner=owner if owner is not None and owner.key != key else None,
            )
            metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
            await write(result.status)
            metrics.RECONCILES.labels("requeue" if result.requeue_after else "ok").inc()
            self._set_phase(key, result.status.get("phase"))
            if result.requeue_after:
                self.queue.add_after(key, result.requeue_after)
            if wrote and result.followup:  # one more pass sees the published status (leavers to unload)
                self.queue.add(key)

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
        meta = body.get("metadata") or {}
        if not meta.get("deletionTimestamp"):
            body = {**body, "metadata": {**meta, "deletionTimestamp": st.now_iso()}}
        model = Model.from_body(body)
        owner = self.owner(model)
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
        self.queue.forget(model.key)
        self._set_phase(model.key, None)
        self.phases.pop(model.key, None)
        self._locks.pop(model.key, None)
        return unloaded

    async def _await_successor(self, model: Model) -> None:
        """Wait (at most ``delete_timeout``) until the new owner of ``model``'s name serves it."""
        deadline = time.monotonic() + self.settings.delete_timeout
        while time.monotonic() < deadline:
            successor = self.owner(model)
            if successor is None or successor.status.get("readyEndpoints"):
                return
            await asyncio.sleep(0.2)
        log.warning("handing %s over: the next owner serves no endpoint yet", model.model_name)

    def idle(self) -> bool:
        return self.queue.idle()


# ---- kopf handlers -------------------------------------------------------------------------
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


@kopf.on.event("", "v1", "pods", labels={BASE_MODEL_HASH_LABEL: kopf.PRESENT})
async def _pod_event(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    _runtime(memo).on_pod(event.get("type"), body)


@kopf.on.event("batch", "v1", "jobs", labels={"app.kubernetes.io/managed-by": MANAGED_BY})
async def _job_event(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    _runtime(memo).on_job(body, event.get("type"))


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
