"""Level-based, idempotent reconcile of one DynamoModel (no kopf, no Kubernetes API here).

Input: the model (its spec and current status) and the pods of its base model. Output: the
status document it should have and when to look again. Side effects go only through the
``WorkerClient`` (load/unload/list on workers), the ``SyncBackend`` (sync Jobs) and an
event callback, so the whole loop runs against real worker processes in tests.

One pass:
1. source: ``hf://`` with an object store -> the sync Job; done -> load ``status.resolvedUri``
   (the store copy). ``s3://`` / ``file://`` (or ``hf://`` without a store) load directly.
2. placement = top-``replicas`` Ready pods by HRW (``placement.place``).
3. load on every placed pod whose ``GET /v1/loras`` lacks the adapter or that holds another URI
   (hot swap); listings are cached per pod for ``listing_ttl`` (the drift timer invalidates them).
4. unload from Ready pods outside the placement that still hold it, but only once the status
   already published shows the new placement fully loaded (load first, switch, then unload:
   the router never loses its last holder).
5. a worker's 400 ends the model in ``Failed/AdapterInvalid`` until the source changes; other
   failures are retried with exponential backoff (``requeue_after``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from lorafleet_sync.ids import BASE_MODEL_HASH_LABEL, base_model_hash
from lorafleet_sync.uris import HfURI, URIError, is_commit_sha, parse_uri

from lorafleet_operator import metrics
from lorafleet_operator import status as st
from lorafleet_operator.placement import place
from lorafleet_operator.workers import WorkerClient, WorkerError

log = logging.getLogger(__name__)

NORMAL, WARNING = "Normal", "Warning"
SYNC_POLL_SECONDS = 5.0


@dataclass(frozen=True, order=True)
class Pod:
    """A worker pod as the reconcile sees it."""

    namespace: str
    name: str
    uid: str = ""
    ip: str | None = None
    ready: bool = False
    base_hash: str | None = None

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Pod:
        meta, status = body.get("metadata") or {}, body.get("status") or {}
        conditions = status.get("conditions") or []
        ready = (
            status.get("phase") == "Running"
            and not meta.get("deletionTimestamp")
            and any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        )
        return cls(
            namespace=meta.get("namespace", ""),
            name=meta.get("name", ""),
            uid=meta.get("uid", ""),
            ip=status.get("podIP") or None,
            ready=bool(ready and status.get("podIP")),
            base_hash=(meta.get("labels") or {}).get(BASE_MODEL_HASH_LABEL),
        )

    def address(self, port: int) -> str:
        return f"http://{self.ip}:{port}"


@dataclass(frozen=True)
class Model:
    """The parts of a DynamoModel the reconcile reads."""

    namespace: str
    name: str
    uid: str
    generation: int
    model_name: str
    base_model_name: str
    model_type: str = "base"
    uri: str | None = None
    replicas: int | None = None
    status: Mapping[str, Any] = field(default_factory=dict)
    deleting: bool = False

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Model:
        meta, spec = body.get("metadata") or {}, body.get("spec") or {}
        return cls(
            namespace=meta.get("namespace", ""),
            name=meta.get("name", ""),
            uid=meta.get("uid", ""),
            generation=int(meta.get("generation") or 0),
            model_name=str(spec.get("modelName", "")),
            base_model_name=str(spec.get("baseModelName", "")),
            model_type=str(spec.get("modelType") or "base").lower(),
            uri=(spec.get("source") or {}).get("uri"),
            replicas=spec.get("replicas"),
            status=dict(body.get("status") or {}),
            deleting=bool(meta.get("deletionTimestamp")),
        )

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    @property
    def base_hash(self) -> str:
        return base_model_hash(self.base_model_name)

    @property
    def is_lora(self) -> bool:
        return self.model_type == "lora"


@dataclass(frozen=True)
class SyncResult:
    """State of the sync Job of an ``hf://`` source."""

    state: str  # "running" | "succeeded" | "failed"
    job_name: str
    resolved_uri: str | None = None
    revision: str | None = None
    message: str = ""
    reason: str = ""  # CamelCase reason for the Synced condition ("" = the state's default)


class SyncBackend(Protocol):
    async def ensure(self, model: Model, source: HfURI) -> SyncResult: ...


EventSink = Callable[[Model, str, str, str], None]
ProgressSink = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class Result:
    status: dict[str, Any]
    requeue_after: float | None = None


@dataclass
class _Listing:
    names: set[str]
    fetched: float


class Reconciler:
    """Reconciles DynamoModels; holds the per-pod listing cache and what it loaded where."""

    def __init__(
        self,
        client: WorkerClient,
        *,
        default_replicas: int = 2,
        management_port: int = 9090,
        sync: SyncBackend | None = None,
        emit: EventSink | None = None,
        listing_ttl: float = 30.0,
        retry_base: float = 1.0,
        retry_max: float = 60.0,
    ) -> None:
        self.client = client
        self.default_replicas = default_replicas
        self.port = management_port
        self.sync = sync
        self.emit: EventSink = emit or (lambda *_: None)
        self.listing_ttl = listing_ttl
        self.retry_base = retry_base
        self.retry_max = retry_max
        self._listings: dict[str, _Listing] = {}
        self._listing_locks: dict[str, asyncio.Lock] = {}
        self._loaded: dict[tuple[str, str], str] = {}  # (pod uid, lora name) -> URI we loaded / adopted
        self._invalid: dict[str, tuple[str, str]] = {}  # model uid -> (URI, worker message)
        self._failures: dict[str, int] = {}  # model uid -> consecutive failed passes

    # ---- cache management -------------------------------------------------------------
    def invalidate_listings(self) -> None:
        """Force a fresh ``GET /v1/loras`` of every pod on its next use (drift check)."""
        self._listings.clear()

    def forget_pod(self, uid: str) -> None:
        """Drop what we know about a pod (it restarted, became unready or is gone)."""
        self._listings.pop(uid, None)
        lock = self._listing_locks.get(uid)
        if lock is not None and not lock.locked():
            del self._listing_locks[uid]
        for key in [k for k in self._loaded if k[0] == uid]:
            del self._loaded[key]

    def forget_model(self, model: Model) -> None:
        self._invalid.pop(model.uid, None)
        self._failures.pop(model.uid, None)
        for key in [k for k in self._loaded if k[1] == model.model_name]:
            del self._loaded[key]

    async def _listing(self, pod: Pod) -> set[str] | None:
        """Adapter names on ``pod`` (cached), or None when it cannot be listed."""
        cached = self._listings.get(pod.uid)
        if cached and time.monotonic() - cached.fetched < self.listing_ttl:
            return cached.names
        lock = self._listing_locks.setdefault(pod.uid, asyncio.Lock())
        async with lock:
            cached = self._listings.get(pod.uid)
            if cached and time.monotonic() - cached.fetched < self.listing_ttl:
                return cached.names
            try:
                names = await self.client.list(pod.address(self.port))
            except WorkerError as e:
                log.warning("cannot list adapters on pod %s: %s", pod.name, e)
                return None
            self._listings[pod.uid] = _Listing(names, time.monotonic())
            return names

    def _note(self, pod: Pod, name: str, uri: str | None) -> None:
        listing = self._listings.get(pod.uid)
        if uri is None:
            self._loaded.pop((pod.uid, name), None)
            if listing:
                listing.names.discard(name)
        else:
            self._loaded[(pod.uid, name)] = uri
            if listing:
                listing.names.add(name)

    # ---- reconcile ---------------------------------------------------------------------
    async def reconcile(self, model: Model, pods: Sequence[Pod], progress: ProgressSink | None = None) -> Result:
        """One level-based pass for ``model`` given the pods of its base model."""
        if not model.is_lora:
            return self._track_base(model, pods)
        try:
            source = parse_uri(model.uri or "")
        except URIError as e:
            return self._done(model, _failed(model, st.Condition("Synced", False, st.INVALID_SOURCE, str(e))), ok=True)

        resolved, revision, job = model.uri or "", None, None
        synced = st.Condition("Synced", True, st.SOURCE_AVAILABLE, "workers fetch the source directly")
        if isinstance(source, HfURI):
            revision = source.revision if is_commit_sha(source.revision) else None
            if self.sync is not None:
                sync = await self.sync.ensure(model, source)
                job, revision = sync.job_name, sync.revision or revision
                if sync.state != "succeeded":
                    return self._syncing(model, pods, sync)
                resolved = sync.resolved_uri or resolved
                synced = st.Condition("Synced", True, st.SYNC_SUCCEEDED, f"synced by Job {job} to {resolved}")
                if _reason(model.status, "Synced") != st.SYNC_SUCCEEDED:
                    self.emit(model, NORMAL, st.SYNC_SUCCEEDED, synced.message)

        base = _Observed(model, synced, resolved, revision, job)
        invalid = self._known_invalid(model, resolved)
        if invalid is not None:
            return self._done(model, base.failed(invalid), ok=True)

        ready_pods = sorted(p for p in pods if p.ready and p.ip)
        replicas = model.replicas or self.default_replicas
        by_name = {p.name: p for p in ready_pods}
        placement = [by_name[n] for n in place(model.model_name, by_name, replicas)] if ready_pods else []
        self._count_churn(model, [p.name for p in placement])
        if not placement:
            observed = base.observe(
                st.PENDING,
                st.Condition(
                    "EndpointsReady", False, st.NO_WORKERS, f"no Ready worker pod serves {model.base_model_name}"
                ),
            )
            return self._done(model, observed, ok=True)

        listings = dict(zip(ready_pods, await asyncio.gather(*(self._listing(p) for p in ready_pods)), strict=True))
        to_load = [p for p in placement if self._needs_load(model, p, resolved, listings[p])]
        if to_load and progress is not None and model.status.get("phase") != st.LOADING:
            await progress(st.render(base.loading(placement, to_load, self.port), model.status))

        outcomes = await asyncio.gather(*(self._load(model, p, resolved) for p in to_load))
        errors = {p.name: e for p, e in zip(to_load, outcomes, strict=True) if e is not None}
        invalid_errors = [e for e in errors.values() if e.invalid]
        endpoints = [_endpoint(p, self.port, p.name not in errors) for p in placement]
        names = [p.name for p in placement]

        if invalid_errors:
            message = invalid_errors[0].message
            self._invalid[model.uid] = (resolved, message)
            self.emit(model, WARNING, st.ADAPTER_INVALID, f"worker rejected {resolved}: {message}")
            return self._done(model, base.failed(message, endpoints, names), ok=True)
        if errors:
            ready = len(placement) - len(errors)
            reason = st.PARTIALLY_LOADED if ready else st.LOAD_FAILED
            detail = "; ".join(f"{n}: {e}" for n, e in sorted(errors.items()))
            cond = st.Condition("EndpointsReady", False, reason, f"{ready}/{len(placement)} loaded; {detail}")
            return self._done(model, base.observe(st.DEGRADED, cond, endpoints, names), ok=False)

        cond = st.Condition("EndpointsReady", True, st.ALL_LOADED, f"loaded on {len(placement)}/{len(placement)}")
        observed = base.observe(st.READY, cond, endpoints, names)
        if _published(model.status, names, resolved):
            leavers = [p for p in ready_pods if p not in placement and model.model_name in (listings[p] or ())]
            await asyncio.gather(*(self._unload(model, p) for p in leavers))
        return self._done(model, observed, ok=True)

    def _needs_load(self, model: Model, pod: Pod, uri: str, names: set[str] | None) -> bool:
        if names is None or model.model_name not in names:
            return True  # unlistable pods get a load attempt: its outcome tells whether they serve it
        known = self._loaded.get((pod.uid, model.model_name))
        if known is not None:
            return known != uri
        # after an operator restart: trust the published status for this pod (no double load)
        published = model.status.get("resolvedUri") == uri and any(
            e.get("podName") == pod.name and e.get("ready") for e in model.status.get("endpoints") or []
        )
        if published:
            self._loaded[(pod.uid, model.model_name)] = uri
            return False
        return True

    async def _load(self, model: Model, pod: Pod, uri: str) -> WorkerError | None:
        previous = self._loaded.get((pod.uid, model.model_name))
        started = time.monotonic()
        try:
            await self.client.load(pod.address(self.port), model.model_name, uri)
        except WorkerError as e:
            if not e.invalid:
                self.emit(model, WARNING, "LoadFailed", f"loading {uri} on pod {pod.name} failed: {e}")
            return e
        self._note(pod, model.model_name, uri)
        took = f"{time.monotonic() - started:.2f}s"
        if previous and previous != uri:
            self.emit(model, NORMAL, "HotSwapped", f"swapped to {uri} on pod {pod.name} in {took}")
        else:
            self.emit(model, NORMAL, "Loaded", f"loaded {uri} on pod {pod.name} in {took}")
        return None

    async def _unload(self, model: Model, pod: Pod) -> bool:
        try:
            await self.client.unload(pod.address(self.port), model.model_name)
        except WorkerError as e:
            self.emit(model, WARNING, "UnloadFailed", f"unloading from pod {pod.name} failed: {e}")
            return False
        self._note(pod, model.model_name, None)
        self.emit(model, NORMAL, "Unloaded", f"unloaded from pod {pod.name}")
        return True

    async def finalize(self, model: Model, pods: Sequence[Pod], timeout: float) -> list[str]:
        """Unload ``model`` from every pod that may hold it, waiting at most ``timeout`` seconds.

        Gone pods are not in ``pods``; unreachable ones fail fast or time out; neither blocks.
        Returns the names of the pods it was unloaded from."""
        placed = set(model.status.get("placement") or [])
        targets = [
            p
            for p in pods
            if p.ip
            and (
                p.name in placed
                or model.model_name in (self._listings.get(p.uid, _Listing(set(), 0)).names)
                or (p.uid, model.model_name) in self._loaded
            )
        ]
        tasks = {asyncio.create_task(self._unload(model, p)): p for p in targets}
        done: set[asyncio.Task[bool]] = set()
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=timeout)
            for task in pending:
                task.cancel()
                self.emit(model, WARNING, "UnloadTimedOut", f"pod {tasks[task].name} did not answer in {timeout}s")
        self.forget_model(model)
        return sorted(tasks[t].name for t in done if not t.cancelled() and t.exception() is None and t.result())

    # ---- helpers -----------------------------------------------------------------------
    def _known_invalid(self, model: Model, uri: str) -> str | None:
        """The worker's message if ``uri`` was already rejected as invalid for this model."""
        memo = self._invalid.get(model.uid)
        if memo is not None:
            return memo[1] if memo[0] == uri else None
        ready = st.condition(model.status, "Ready")
        if (
            ready is not None
            and ready.get("reason") == st.ADAPTER_INVALID
            and model.status.get("resolvedUri") == uri
            and model.status.get("observedGeneration") == model.generation
        ):
            return str(ready.get("message", ""))
        return None

    def _syncing(self, model: Model, pods: Sequence[Pod], sync: SyncResult) -> Result:
        if sync.state == "failed":
            synced = st.Condition("Synced", False, sync.reason or st.SYNC_FAILED, sync.message)
            cond = st.Condition("EndpointsReady", False, st.WAITING_FOR_SYNC, "the source could not be synced")
            if _reason(model.status, "Synced") != synced.reason:
                self.emit(model, WARNING, synced.reason, sync.message)
            return self._done(
                model, _Observed(model, synced, None, sync.revision, sync.job_name).observe(st.FAILED, cond), ok=True
            )
        synced = st.Condition("Synced", False, sync.reason or st.SYNC_JOB_RUNNING, sync.message)
        if _reason(model.status, "Synced") != synced.reason:
            self.emit(model, NORMAL, synced.reason, f"{sync.job_name}: {sync.message}")
        previous = model.status.get("resolvedUri")
        cond = st.Condition("EndpointsReady", False, st.WAITING_FOR_SYNC, f"waiting for sync Job {sync.job_name}")
        # keep serving what is loaded (if anything) while the new source syncs
        observed = _Observed(model, synced, previous, sync.revision, sync.job_name).observe(
            st.SYNCING, cond, list(model.status.get("endpoints") or []), list(model.status.get("placement") or [])
        )
        return Result(st.render(observed, model.status), requeue_after=SYNC_POLL_SECONDS)

    def _track_base(self, model: Model, pods: Sequence[Pod]) -> Result:
        """Base (and reserved ``adapter``) models: report the base model's pods, load nothing."""
        with_ip = sorted(p for p in pods if p.ip)
        endpoints = [_endpoint(p, self.port, p.ready) for p in with_ip]
        ready = sum(1 for p in with_ip if p.ready)
        synced = st.Condition("Synced", True, st.NO_SOURCE_NEEDED, f"modelType {model.model_type} is not loaded")
        if ready:
            cond = st.Condition("EndpointsReady", True, st.ENDPOINTS_READY, f"{ready} Ready worker pods")
            phase = st.READY
        else:
            cond = st.Condition(
                "EndpointsReady", False, st.NO_WORKERS, f"no Ready worker pod serves {model.base_model_name}"
            )
            phase = st.PENDING
        observed = _Observed(model, synced, None, None, None).observe(phase, cond, endpoints, [])
        return self._done(model, observed, ok=True)

    def _done(self, model: Model, observed: st.Observed, *, ok: bool) -> Result:
        if ok:
            self._failures.pop(model.uid, None)
            requeue = None
        else:
            n = self._failures[model.uid] = self._failures.get(model.uid, 0) + 1
            requeue = min(self.retry_max, self.retry_base * 2 ** (n - 1))
        return Result(st.render(observed, model.status), requeue_after=requeue)

    def _count_churn(self, model: Model, placement: list[str]) -> None:
        before = set(model.status.get("placement") or [])
        if before:
            metrics.PLACEMENT_CHURN.labels("added").inc(len(set(placement) - before))
            metrics.PLACEMENT_CHURN.labels("removed").inc(len(before - set(placement)))


@dataclass
class _Observed:
    """Builder of ``status.Observed`` for one model pass (source facts fixed, endpoint facts vary)."""

    model: Model
    synced: st.Condition
    resolved: str | None
    revision: str | None
    job: str | None

    def observe(
        self,
        phase: str,
        cond: st.Condition,
        endpoints: list[dict[str, Any]] | None = None,
        placement: list[str] | None = None,
    ) -> st.Observed:
        return st.Observed(
            generation=self.model.generation,
            phase=phase,
            synced=self.synced,
            endpoints_ready=cond,
            endpoints=endpoints or [],
            placement=placement or [],
            resolved_uri=self.resolved,
            revision=self.revision,
            sync_job=self.job,
        )

    def failed(
        self, message: str, endpoints: list[dict[str, Any]] | None = None, placement: list[str] | None = None
    ) -> st.Observed:
        cond = st.Condition("EndpointsReady", False, st.ADAPTER_INVALID, message)
        return self.observe(st.FAILED, cond, endpoints, placement)

    def loading(self, placement: list[Pod], to_load: list[Pod], port: int) -> st.Observed:
        endpoints = [_endpoint(p, port, p not in to_load) for p in placement]
        cond = st.Condition("EndpointsReady", False, st.LOADING_REASON, f"loading on {len(to_load)} pod(s)")
        return self.observe(st.LOADING, cond, endpoints, [p.name for p in placement])


def _failed(model: Model, synced: st.Condition) -> st.Observed:
    return _Observed(model, synced, None, None, None).observe(
        st.FAILED, st.Condition("EndpointsReady", False, st.WAITING_FOR_SYNC, "the source is not usable")
    )


def _reason(status: Mapping[str, Any], type_: str) -> str | None:
    cond = st.condition(status, type_)
    return None if cond is None else cond.get("reason")


def _endpoint(pod: Pod, port: int, ready: bool) -> dict[str, Any]:
    return {"address": pod.address(port), "podName": pod.name, "ready": ready}


def _published(status: Mapping[str, Any], placement: list[str], uri: str) -> bool:
    """True when ``status`` already announces ``placement`` fully loaded with ``uri``."""
    endpoints = status.get("endpoints") or []
    return (
        status.get("placement") == placement
        and status.get("resolvedUri") == uri
        and len(endpoints) == len(placement)
        and all(e.get("ready") for e in endpoints)
    )
