"""Level-based, idempotent reconcile of one DynamoModel (no kopf, no Kubernetes API here).

Input: the model (its spec and current status) and the pods of its base model. Output: the
status document it should have and when to look again. Side effects go only through the
``WorkerClient`` (load/unload/list on workers), the ``SyncBackend`` (sync Jobs), the
``Ledger`` (which names the operator placed) and an event callback, so the whole loop runs
against real worker processes in tests.

One pass:
1. source: ``hf://`` with an object store -> the sync Job; done -> load ``status.resolvedUri``
   (the store copy). ``s3://`` / ``file://`` (or ``hf://`` without a store) load directly.
2. target = the source's URI, or, while it syncs or after it failed (sync failure, a worker's
   400), the last good version (``status.servedUri``): a failed hot swap keeps serving.
3. placement: a pod is full at the capacity its ``GET /v1/loras`` reports (``--max-loaded-loras``).
   Fixed-replica adapters (``balance="autoscaled"``, the default) take the first ``replicas`` Ready
   pods in HRW order that have room (``placement.place_within``). Autoscaled ones (every adapter
   with ``balance="all"``) are placed by demand-weighted bounded loads (``placement.place_balanced``,
   ``balance_epsilon``): the pods' loads are the listed adapters weighted by the routers' demand
   (``Autoscaler.weights``; equal weights before any demand is known), replicas stay where they are
   unless their pod is above ``(1 + epsilon) x`` the mean and they are among its largest movable
   shares, new ones go along the HRW order to pods below the entry level; adapters left on a pod
   above the bound are re-queued by the next demand poll (``Autoscaler.place_again``). Adapters that
   do not fit (or get a worker's 507) show ``InsufficientCapacity`` and are retried with backoff.
4. load the target on every placed pod whose ``GET /v1/loras`` lacks the adapter or that holds
   another URI (hot swap); listings are cached per pod for ``listing_ttl`` (the drift pass
   refreshes them).
5. make-before-break: until every placed pod holds the target, ``status.endpoints`` also lists
   the pods that still hold the adapter (old placement, or the old version during a swap);
   that status is published before the loads. A first load (nothing served or held) publishes
   ``Loading`` only if it takes longer than ``progress_after`` seconds.
   Pods that left the placement are unloaded only once the status already published shows the
   new placement fully loaded and ``unload_grace`` seconds passed (routers saw it).
6. a worker's 400 on a first load ends the model in ``Failed/AdapterInvalid`` until the source
   changes (on a swap: ``Degraded/SwapFailed``); other failures end the pass with
   ``Result.failed``: the work queue retries the model with its per-key exponential backoff.

Adapters a worker loaded on demand (unpinned, from the catalogue ``catalog.Catalogs`` gives it) are
not placement: never leavers, never drift. An autoscaled model the autoscaler scaled to zero
(``minReplicas: 0``) publishes phase ``ScaledToZero`` with no endpoint, then unloads it from every
pod, on-demand copies included (once per scale-down: copies a request loads later stay; see
``_at_zero``); its ``servedUri`` keeps it in the catalogue. Coming back, a placement that holds no
Ready pod keeps the pods that hold an on-demand copy (the router's rendezvous pod), so nothing moves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from lorafleet_sync.uris import HfURI, URIError, is_commit_sha, parse_uri

from lorafleet_operator import metrics
from lorafleet_operator import status as st
from lorafleet_operator.autoscale import LIMITED_BY_CAPACITY, Autoscaler, Decision, DemandSource, autoscale_pass
from lorafleet_operator.drift import drift_pass
from lorafleet_operator.inventory import WorkerInventory
from lorafleet_operator.ledger import Ledger, MemoryLedger
from lorafleet_operator.placement import DEFAULT_EPSILON, Loads, place_balanced, place_within, rank, relief
from lorafleet_operator.resources import Model, Pod
from lorafleet_operator.workers import WorkerClient, WorkerError

log = logging.getLogger(__name__)

NORMAL, WARNING = "Normal", "Warning"
SYNC_POLL_SECONDS = 5.0
BALANCE_SCOPES = ("autoscaled", "all", "off")  # which adapters place_balanced places


@dataclass(frozen=True)
class SyncResult:
    """State of the sync Job of an ``hf://`` source."""

    state: str  # "running" | "succeeded" | "failed"
    job_name: str
    resolved_uri: str | None = None
    revision: str | None = None
    message: str = ""
    reason: str = ""  # CamelCase reason for the Synced condition ("" = the state's default)
    retry_after: float | None = None  # failed: seconds until the next try; succeeded: until the branch re-check


class SyncBackend(Protocol):
    async def ensure(self, model: Model, source: HfURI) -> SyncResult: ...


EventSink = Callable[[Model, str, str, str], None]
ProgressSink = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class Result:
    """What one pass found and what it asks for next (as controller-runtime's ``Result``): the runtime
    alone decides from it what to queue when."""

    status: dict[str, Any]
    requeue_after: float | None = None
    # one more pass once this status is published (leavers are unloaded only after routers saw it);
    # False when the pass left nothing that waits for its own status (a cold start's loads)
    followup: bool = True
    failed: bool = False  # retry with backoff (the work queue owns the failure count: add_rate_limited)
    # LoRA models: the pods it wants; a pod joining its base model calls for another pass only when it
    # enters the model's top-``replicas`` HRW set (``placement.takes``)
    replicas: int | None = None


@dataclass(frozen=True)
class _Loaded:
    """A load that succeeded: on which pod, whether it replaced another version, how long it took."""

    pod: str
    swap: bool
    seconds: float


@dataclass(frozen=True)
class _Source:
    """What the source stage found: the URI to load (None = none usable yet) and why not."""

    uri: str | None
    synced: st.Condition
    revision: str | None = None
    job: str | None = None
    pending: bool = False  # a sync Job is running: wait, keep serving what is served
    failure: st.Condition | None = None  # the source cannot be served (reason, message)
    requeue: float | None = None


class Reconciler:
    """Reconciles DynamoModels against the worker inventory (what each pod holds), which it updates."""

    def __init__(
        self,
        client: WorkerClient,
        *,
        default_replicas: int = 2,
        management_port: int = 9090,
        sync: SyncBackend | None = None,
        emit: EventSink | None = None,
        ledger: Ledger | None = None,
        listing_ttl: float = 30.0,
        inventory: WorkerInventory | None = None,
        retry_max: float = 60.0,
        unload_grace: float = 5.0,
        balance_epsilon: float = DEFAULT_EPSILON,
        balance: str = "autoscaled",
        autoscaler: Autoscaler | None = None,
        progress_after: float = 1.0,
    ) -> None:
        self.client = client
        self.default_replicas = default_replicas
        self.port = management_port
        self.sync = sync
        self.emit: EventSink = emit or (lambda *_: None)
        self.ledger: Ledger = ledger or MemoryLedger()
        self.inventory = inventory or WorkerInventory(client, management_port, listing_ttl)
        self.retry_max = retry_max  # an autoscaled model short of room looks again after this long
        self.unload_grace = unload_grace
        if balance not in BALANCE_SCOPES or balance_epsilon < 0:
            raise ValueError(f"balance must be one of {BALANCE_SCOPES}, epsilon >= 0: {balance}, {balance_epsilon}")
        self.balance_epsilon = balance_epsilon
        self.balance = balance
        self.autoscaler = autoscaler or Autoscaler()
        self.progress_after = progress_after  # a first load publishes "Loading" only once it takes this long
        self._invalid: dict[str, tuple[str, str]] = {}  # model uid -> (URI, worker message)
        self._settled: dict[str, tuple[tuple[str, ...], float]] = {}  # model uid -> (placement, first seen)
        self._zeroing: set[str] = set()  # model uids scaled to zero in this run whose copies are not all unloaded

    # ---- what the runtime's loops ask of the pieces the reconciler holds (so none reaches through it) ----
    def observe_job(self, body: Mapping[str, Any], *, deleted: bool) -> None:
        """A sync Job's watch event, into the sync backend's Job cache (no GET per pass)."""
        observe = getattr(self.sync, "observe", None)
        if observe is not None:
            observe(body, deleted=deleted)

    async def claim_names(self, namespace: str, base_hash: str, names: Iterable[str]) -> None:
        """Write adapter names into the ledger in one go (write-ahead of their first loads)."""
        await self.ledger.claim_many(namespace, base_hash, names)

    async def autoscale(
        self,
        models: Iterable[tuple[tuple[str, str], Model]],
        demand: DemandSource,
        requeue: Callable[[tuple[str, str]], None],
    ) -> None:
        """One poll of the routers' demand (``autoscale.autoscale_pass``) with this reconciler's autoscaler."""
        await autoscale_pass(self.autoscaler, models, demand, requeue)

    async def drift(
        self,
        owners: Iterable[tuple[tuple[str, str], Model]],
        requeue: Callable[[tuple[str, str]], None],
        wanted: Callable[[str, str, str], bool],
    ) -> None:
        """One drift pass (``drift.drift_pass``) over the inventory this reconciler updates."""
        await drift_pass(self.inventory, self.ledger, owners, requeue, wanted)

    async def close(self) -> None:
        await self.client.close()

    def forget_model(self, model: Model, *, keep_loaded: bool = False) -> None:
        """Forget a deleted model (``keep_loaded``: its adapter stays, a successor owns the name)."""
        self._invalid.pop(model.uid, None)
        self._settled.pop(model.uid, None)
        self._zeroing.discard(model.uid)
        self.autoscaler.forget(model.uid)
        if not keep_loaded:
            self.inventory.forget_name(model.model_name)

    # ---- reconcile ---------------------------------------------------------------------
    async def reconcile(
        self,
        model: Model,
        pods: Sequence[Pod],
        progress: ProgressSink | None = None,
        owner: Model | None = None,
    ) -> Result:
        """One level-based pass for ``model`` given the pods of its base model.

        ``owner``: another DynamoModel that owns this ``modelName`` (this one is then never loaded)."""
        if not model.is_lora:
            return self._track_base(model, pods)
        replicas, scaling = self.replicas_for(model)
        if owner is not None:
            result = self._conflict(model, owner)
        else:
            result = await self._reconcile_lora(model, pods, replicas, scaling, progress)
        result.replicas = replicas
        return result

    async def _reconcile_lora(
        self, model: Model, pods: Sequence[Pod], replicas: int, scaling: Decision | None, progress: ProgressSink | None
    ) -> Result:
        """The pass of a LoRA model that owns its name (see the module docstring)."""
        source = await self._source(model)
        served = _served_uri(model.status)
        failure = source.failure
        if source.uri is not None and (message := self._known_invalid(model, source.uri)) is not None:
            reason = st.SWAP_FAILED if served and served != source.uri else st.ADAPTER_INVALID
            failure = st.Condition("EndpointsReady", False, reason, message)
        target = source.uri if failure is None and not source.pending else served
        resolved = source.uri or (model.status.get("resolvedUri") if source.pending else None)
        obs = _facts(model, source.synced, resolved, source.revision, source.job, served)
        _scale(obs, replicas, scaling)
        if target is None:
            if failure is not None:
                result = self._done(model, obs.outcome(st.FAILED, failure), ok=True)
                result.requeue_after = source.requeue  # e.g. when a failed sync Job is tried again
                return result
            cond = st.Condition("EndpointsReady", False, st.WAITING_FOR_SYNC, f"waiting for sync Job {source.job}")
            return Result(st.render(obs.outcome(st.SYNCING, cond), model.status), source.requeue)
        if replicas == 0:
            result = await self._at_zero(model, pods, target, obs, scaling)
            result.requeue_after = _earliest(source.requeue, result.requeue_after)
            return result
        self._zeroing.discard(model.uid)

        ready_pods = sorted(p for p in pods if p.ready and p.ip)
        if ready_pods and model.status.get("phase") == st.SCALED_TO_ZERO:
            # back from zero: what the router's rendezvous pod loaded on demand is placement's to keep
            self.inventory.drop_listing(_by_rank(model.model_name, ready_pods)[0])
        if not ready_pods:
            self._count_churn(model, [])
            cond = st.Condition(
                "EndpointsReady", False, st.NO_WORKERS, f"no Ready worker pod serves {model.base_model_name}"
            )
            return self._done(model, obs.outcome(st.PENDING, cond), ok=True)

        live = sorted(p for p in pods if (p.ready or p.serving) and p.ip)  # terminating pods still serve
        listings = await self.inventory.listings_of(live)
        placement = self._place(model, ready_pods, replicas, listings, balanced=self._balanced(scaling))
        self._count_churn(model, [p.name for p in placement])
        short = min(replicas, len(ready_pods)) - len(placement)  # replicas no pod has room for
        limited = scaling is not None and short > 0
        if limited and scaling is not None:  # autoscaled: only short of minReplicas is Degraded
            _scale(
                obs, replicas, Decision(replicas, LIMITED_BY_CAPACITY, f"{scaling.message}; the other pods are full")
            )
            short = max(0, min(self.autoscaler.floor(model), len(ready_pods)) - len(placement))
        if not placement:
            cond = st.Condition(
                "EndpointsReady", False, st.INSUFFICIENT_CAPACITY, f"all {len(ready_pods)} Ready pod(s) are full"
            )
            return self._done(model, obs.outcome(st.PENDING, cond), ok=False)
        holding = {p for p in live if model.model_name in (listings[p] or ())}
        to_load = [p for p in placement if self._needs_load(model, p, target, listings[p])]
        leavers = [p for p in live if p in holding and p not in placement]
        if to_load:
            await self.ledger.claim(model.namespace, model.base_hash, model.model_name)
        loads = asyncio.ensure_future(asyncio.gather(*(self._load(model, p, target) for p in to_load)))
        if to_load and progress is not None:
            # Something is served (or held): publish old holders next to the new placement before
            # loading (make-before-break). A first load protects nothing: "Loading" is published
            # only if it takes longer than ``progress_after`` (a cold start of thousands of quick
            # loads then costs one status write per model, not two).
            if served is None and not holding:
                await asyncio.wait({loads}, timeout=self.progress_after)
            if not loads.done():
                loading = _endpoints_changing(placement, holding, leavers, self.port)
                cond = st.Condition("EndpointsReady", False, st.LOADING_REASON, f"loading on {len(to_load)} pod(s)")
                obs.routable = served is not None
                new = st.render(obs.outcome(st.LOADING, cond, *loading), model.status)
                if st.status_patch(new, model.status):
                    await progress(new)

        outcomes = await loads
        errors = {p.name: e for p, e in zip(to_load, outcomes, strict=True) if isinstance(e, WorkerError)}
        self._emit_loaded(model, target, [o for o in outcomes if isinstance(o, _Loaded)])
        invalid = [e for e in errors.values() if e.invalid]
        if invalid and target == source.uri:
            self._invalid[model.uid] = (target, invalid[0].message)
            self.emit(model, WARNING, st.ADAPTER_INVALID, f"worker rejected {target}: {invalid[0].message}")
            if served is not None and served != target:
                return await self._reconcile_lora(model, pods, replicas, scaling, progress)  # the last good one serves
        serving = {p for p in placement if p.name not in errors} | (holding & set(placement))
        names = [p.name for p in placement]

        if errors:
            endpoints, placed = _endpoints_changing(placement, serving, leavers, self.port)
            obs.routable = served is not None
            if invalid and target == source.uri:
                failure = st.Condition("EndpointsReady", False, st.ADAPTER_INVALID, invalid[0].message)
                return self._done(model, obs.outcome(st.FAILED, failure, endpoints, placed), ok=True)
            ready = len(placement) - len(errors)
            reason = st.PARTIALLY_LOADED if ready else st.LOAD_FAILED
            if all(e.full for e in errors.values()):
                reason = st.INSUFFICIENT_CAPACITY
            detail = "; ".join(f"{n}: {e}" for n, e in sorted(errors.items()))
            cond = st.Condition("EndpointsReady", False, reason, f"{ready}/{len(placement)} loaded; {detail}")
            return self._done(model, obs.outcome(st.DEGRADED, cond, endpoints, placed), ok=False)

        obs.served_uri = target
        obs.routable = True
        cond = st.Condition("EndpointsReady", True, st.ALL_LOADED, f"loaded on {len(placement)}/{len(placement)}")
        endpoints = [_endpoint(p, self.port, True) for p in placement]
        if failure is not None:
            obs.degraded = st.Condition("Degraded", True, st.SWAP_FAILED, failure.message)
            observed = obs.outcome(st.DEGRADED, cond, endpoints, names)
        elif short:
            message = f"placed {len(placement)} of {replicas} replicas: the other Ready pods are full"
            obs.degraded = st.Condition("Degraded", True, st.INSUFFICIENT_CAPACITY, message)
            observed = obs.outcome(st.DEGRADED, cond, endpoints, names)
        elif source.pending:
            observed = obs.outcome(st.SYNCING, cond, endpoints, names)
        else:
            observed = obs.outcome(st.READY, cond, endpoints, names)
        requeue = await self._unload_leavers(model, names, target, leavers)
        result = self._done(model, observed, ok=not short)  # short: look again for room, with backoff
        limited_retry = self.retry_max if limited else None  # autoscaled, above minReplicas: look again for room
        # fewer Ready pods than replicas: a pod joining re-queues it (``placement.takes``); look again anyway,
        # so that an event missed or read against a stale status never leaves it under-replicated for good
        under = self.retry_max if len(placement) < replicas else None
        result.requeue_after = _earliest(source.requeue, requeue, limited_retry, under)
        result.followup = bool(leavers)
        return result

    async def _at_zero(
        self, model: Model, pods: Sequence[Pod], target: str, obs: st.Observed, scaling: Decision | None
    ) -> Result:
        """An autoscaled model at zero replicas: publish it without endpoints (``ScaledToZero``; its
        ``servedUri`` keeps it in the workers' catalogues), then unload it from every pod after the
        grace. The scale-down that brought it here also unloads the copies workers loaded on demand;
        later passes (and a restarted operator, which finds it at zero already) leave such copies to
        the requests that loaded them, whose demand brings it back."""
        if model.status.get("phase") != st.SCALED_TO_ZERO:
            self._zeroing.add(model.uid)  # this run scales it down: every copy goes
        zeroing = model.uid in self._zeroing
        live = sorted(p for p in pods if (p.ready or p.serving) and p.ip)
        if zeroing:  # on-demand copies come and go without the operator: list every pod afresh
            for pod in live:
                self.inventory.drop_listing(pod)
        listings = await self.inventory.listings_of(live)
        holders = [
            p for p in live
            if model.model_name in (listings[p] or ()) or (zeroing and model.model_name in self.inventory.on_demand(p))
        ]  # fmt: skip
        self._count_churn(model, [])
        obs.served_uri = target
        idle = scaling.message if scaling is not None else "no replicas"
        cond = st.Condition("EndpointsReady", True, st.SCALED_TO_ZERO, idle)
        requeue = await self._unload_leavers(model, [], target, holders)
        if zeroing and requeue is None and _published(model.status, [], target):
            self._zeroing.discard(model.uid)  # unloaded (or tried: a copy left pinned is a holder next time)
        result = self._done(model, obs.outcome(st.SCALED_TO_ZERO, cond), ok=True)
        result.requeue_after = requeue
        result.followup = bool(holders)
        return result

    async def _source(self, model: Model) -> _Source:
        """Parse the source and, for ``hf://`` with a store, follow its sync Job."""
        try:
            source = parse_uri(model.uri or "")
        except URIError as e:
            cond = st.Condition("Synced", False, st.INVALID_SOURCE, str(e))
            return _Source(None, cond, failure=st.Condition("EndpointsReady", False, st.INVALID_SOURCE, str(e)))
        if not isinstance(source, HfURI) or self.sync is None:
            revision = source.revision if isinstance(source, HfURI) and is_commit_sha(source.revision) else None
            synced = st.Condition("Synced", True, st.SOURCE_AVAILABLE, "workers fetch the source directly")
            return _Source(model.uri or "", synced, revision)
        sync = await self.sync.ensure(model, source)
        revision = sync.revision or (source.revision if is_commit_sha(source.revision) else None)
        if sync.state == "succeeded":
            resolved = sync.resolved_uri or model.uri or ""
            synced = st.Condition("Synced", True, st.SYNC_SUCCEEDED, f"synced by Job {sync.job_name} to {resolved}")
            if _reason(model.status, "Synced") != st.SYNC_SUCCEEDED:
                self.emit(model, NORMAL, st.SYNC_SUCCEEDED, synced.message)
            return _Source(resolved, synced, revision, sync.job_name, requeue=sync.retry_after)  # branch re-check
        if sync.state == "failed":
            synced = st.Condition("Synced", False, sync.reason or st.SYNC_FAILED, sync.message)
            if _reason(model.status, "Synced") != synced.reason:
                self.emit(model, WARNING, synced.reason, sync.message)
            failure = st.Condition("EndpointsReady", False, synced.reason, sync.message)
            return _Source(None, synced, revision, sync.job_name, failure=failure, requeue=sync.retry_after)
        synced = st.Condition("Synced", False, sync.reason or st.SYNC_JOB_RUNNING, sync.message)
        if _reason(model.status, "Synced") != synced.reason:
            self.emit(model, NORMAL, synced.reason, f"{sync.job_name}: {sync.message}")
        return _Source(None, synced, revision, sync.job_name, pending=True, requeue=SYNC_POLL_SECONDS)

    async def _unload_leavers(self, model: Model, names: list[str], uri: str, leavers: list[Pod]) -> float | None:
        """Unload pods that left the placement once the full new placement is published and old.

        Returns the seconds to wait before trying again (grace not over yet), or None."""
        if not leavers or not _published(model.status, names, uri):
            return None
        seen = self._settled.get(model.uid)
        now = time.monotonic()
        if seen is None or seen[0] != tuple(names):
            seen = self._settled[model.uid] = (tuple(names), now)
        wait = seen[1] + self.unload_grace - now
        if wait > 0:
            return wait
        await asyncio.gather(*(self._unload(model, p) for p in leavers if p.ready))  # terminating ones just go
        return None

    def _needs_load(self, model: Model, pod: Pod, uri: str, names: set[str] | None) -> bool:
        if names is None or model.model_name not in names:
            return True  # unlistable pods get a load attempt: its outcome tells whether they serve it
        known = self.inventory.loaded_uri(pod, model.model_name)
        if known is not None:
            return known != uri
        # after an operator restart: trust the published status for this pod (no double load)
        published = _served_uri(model.status) == uri and any(
            e.get("podName") == pod.name and e.get("ready") for e in model.status.get("endpoints") or []
        )
        if published:
            self.inventory.adopt(pod, model.model_name, uri)
            return False
        return True

    async def _load(self, model: Model, pod: Pod, uri: str) -> WorkerError | _Loaded:
        previous = self.inventory.loaded_uri(pod, model.model_name)
        started = time.monotonic()
        try:
            await self.client.load(pod.address(self.port), model.model_name, uri)
        except WorkerError as e:
            if e.full:
                self.inventory.drop_listing(pod)  # our view of its load was stale: list it again
            if not e.invalid:
                self.emit(model, WARNING, "LoadFailed", f"loading {uri} on pod {pod.name} failed: {e}")
            return e
        self.inventory.note(pod, model.model_name, uri)
        return _Loaded(pod.name, bool(previous and previous != uri), time.monotonic() - started)

    def _emit_loaded(self, model: Model, uri: str, loaded: list[_Loaded]) -> None:
        """One Event per pass and kind (``Loaded``, ``HotSwapped``) naming every pod, not one per pod:
        a cold start of 10,000 models over 2 replicas posts 10,000 Events, not 20,000."""
        for swap, reason, verb in ((False, "Loaded", "loaded"), (True, "HotSwapped", "swapped to")):
            done = [x for x in loaded if x.swap == swap]
            if done:
                pods = ", ".join(x.pod for x in done)
                took = max(x.seconds for x in done)
                where = f"pod {pods}" if len(done) == 1 else f"pods {pods}"
                self.emit(model, NORMAL, reason, f"{verb} {uri} on {where} in {took:.2f}s")

    async def _unload(self, model: Model, pod: Pod) -> bool:
        try:
            await self.client.unload(pod.address(self.port), model.model_name)
        except WorkerError as e:
            self.emit(model, WARNING, "UnloadFailed", f"unloading from pod {pod.name} failed: {e}")
            return False
        self.inventory.note(pod, model.model_name, None)
        self.emit(model, NORMAL, "Unloaded", f"unloaded from pod {pod.name}")
        return True

    async def finalize(self, model: Model, pods: Sequence[Pod], timeout: float) -> list[str]:
        """Unload ``model`` from every pod that may hold it, waiting at most ``timeout`` seconds.

        Gone pods are not in ``pods``; unreachable ones fail fast or time out; neither blocks.
        Returns the names of the pods it was unloaded from."""
        placed = set(model.status.get("placement") or [])
        targets = [p for p in pods if p.ip and (p.name in placed or self.inventory.may_hold(p, model.model_name))]
        tasks = {asyncio.create_task(self._unload(model, p)): p for p in targets}
        done: set[asyncio.Task[bool]] = set()
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=timeout)
            for task in pending:
                task.cancel()
                self.emit(model, WARNING, "UnloadTimedOut", f"pod {tasks[task].name} did not answer in {timeout}s")
        unloaded = sorted(tasks[t].name for t in done if not t.cancelled() and t.exception() is None and t.result())
        if len(unloaded) == len(tasks):
            await self.ledger.release(model.namespace, model.base_hash, model.model_name)
        self.forget_model(model)
        return unloaded

    # ---- helpers -----------------------------------------------------------------------
    def replicas_for(self, model: Model) -> tuple[int, Decision | None]:
        """How many pods ``model`` wants: the autoscaler's count (``spec.autoscaling``), else
        ``spec.replicas``, else the default; with the autoscaler's last decision (None when fixed)."""
        scaled = self.autoscaler.replicas(model)
        if scaled is not None:
            return scaled
        return model.replicas or self.default_replicas, None

    def _known_invalid(self, model: Model, uri: str) -> str | None:
        """The worker's message if ``uri`` was already rejected as invalid for this model."""
        memo = self._invalid.get(model.uid)
        if memo is not None:
            return memo[1] if memo[0] == uri else None
        if model.status.get("resolvedUri") != uri or model.status.get("observedGeneration") != model.generation:
            return None
        for type_, reason, status in (("Ready", st.ADAPTER_INVALID, "False"), ("Degraded", st.SWAP_FAILED, "True")):
            cond = st.condition(model.status, type_)
            if cond is not None and (cond.get("reason"), cond.get("status")) == (reason, status):
                return str(cond.get("message", ""))
        return None

    def _conflict(self, model: Model, owner: Model) -> Result:
        """Another DynamoModel owns this modelName: report it, load nothing, touch nothing."""
        message = (
            f"modelName {model.model_name} for {model.base_model_name} is served by the older "
            f"DynamoModel {owner.namespace}/{owner.name}; this one is not loaded"
        )
        if _reason(model.status, "Ready") != st.MODEL_NAME_CONFLICT:
            self.emit(model, WARNING, st.MODEL_NAME_CONFLICT, message)
        synced = st.Condition("Synced", False, st.MODEL_NAME_CONFLICT, message)
        cond = st.Condition("EndpointsReady", False, st.MODEL_NAME_CONFLICT, message)
        self._settled.pop(model.uid, None)
        return self._done(model, _facts(model, synced).outcome(st.FAILED, cond), ok=True)

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
        observed = _facts(model, synced).outcome(phase, cond, endpoints, [])
        return self._done(model, observed, ok=True)

    @staticmethod
    def _done(model: Model, observed: st.Observed, *, ok: bool) -> Result:
        return Result(st.render(observed, model.status), failed=not ok)

    def _balanced(self, scaling: Decision | None) -> bool:
        return self.balance == "all" or (self.balance == "autoscaled" and scaling is not None)

    def _place(
        self,
        model: Model,
        ready_pods: list[Pod],
        replicas: int,
        listings: Mapping[Pod, set[str] | None],
        *,
        balanced: bool = False,
    ) -> list[Pod]:
        """The pods for ``model``: its HRW order skipping full pods, or, ``balanced``, by
        demand-weighted bounded loads (see the module docstring)."""
        model_name = model.model_name
        by_name = {p.name: p for p in ready_pods}

        def fits(pod: str, name: str = model_name) -> bool:  # capacity left for ``name`` (no copy of the listing)
            cap = self.inventory.capacity(by_name[pod])
            names = listings[by_name[pod]] or set()
            return cap is None or len(names) - (name in names) < cap

        if not balanced:
            return [by_name[n] for n in place_within(model_name, by_name, replicas, fits)]
        held = {p.name: set(listings[p] or ()) for p in ready_pods}  # a copy: ``relief`` updates it
        loads = Loads(held, self.autoscaler.weights(model.base_model_name))
        current = [str(n) for n in model.status.get("placement") or ()]
        if not any(n in by_name for n in current):  # no Ready pod of its placement: keep on-demand copies
            current = [p.name for p in ready_pods if model_name in self.inventory.on_demand(p)]
        chosen = place_balanced(model_name, by_name, replicas, current, loads, fits, self.balance_epsilon)
        if chosen != current:  # pods it joined may now be above the bound: their movable shares go again
            loads.set(model_name, chosen)
            self.autoscaler.place_again(model.base_model_name, relief(by_name, loads, fits))
        return [by_name[n] for n in chosen]

    def _count_churn(self, model: Model, placement: list[str]) -> None:
        before = set(model.status.get("placement") or [])
        if before:
            metrics.PLACEMENT_CHURN.labels("added").inc(len(set(placement) - before))
            metrics.PLACEMENT_CHURN.labels("removed").inc(len(before - set(placement)))


def _by_rank(model_name: str, pods: Sequence[Pod]) -> list[Pod]:
    """``pods`` in ``model_name``'s HRW order (the router's rendezvous pod first)."""
    by_name = {p.name: p for p in pods}
    return [by_name[n] for n in rank(model_name, by_name)]


def _facts(
    model: Model,
    synced: st.Condition,
    resolved: str | None = None,
    revision: str | None = None,
    job: str | None = None,
    served: str | None = None,
) -> st.Observed:
    """What a pass knows of ``model`` before it places it; each outcome is ``Observed.outcome`` of it."""
    unplaced = st.Condition("EndpointsReady", False, st.LOADING_REASON, "not placed yet")
    return st.Observed(
        model.generation, st.PENDING, synced, unplaced,
        resolved_uri=resolved, revision=revision, sync_job=job, served_uri=served,
    )  # fmt: skip


def _scale(observed: st.Observed, replicas: int, decision: Decision | None) -> None:
    """Autoscaled models: the wanted replicas and the ``Autoscaling`` condition (why)."""
    if decision is not None:
        observed.desired_replicas = replicas
        observed.scaling = st.Condition("Autoscaling", True, decision.reason, decision.message)


def _endpoints_changing(
    placement: list[Pod], serving: set[Pod], leavers: list[Pod], port: int
) -> tuple[list[dict[str, Any]], list[str]]:
    """Endpoints while the placement is incomplete: placed pods (ready when they serve a version now),
    then pods that left the placement but still hold it (make-before-break)."""
    endpoints = [_endpoint(p, port, p in serving) for p in placement]
    endpoints += [_endpoint(p, port, True) for p in leavers]
    return endpoints, [p.name for p in placement]


def _served_uri(status: Mapping[str, Any]) -> str | None:
    """The last good version: ``servedUri`` (or, from an older operator, the URI of a Ready status)."""
    if "servedUri" in status:
        return status.get("servedUri") or None
    return status.get("resolvedUri") if status.get("phase") == st.READY else None


def _earliest(*delays: float | None) -> float | None:
    given = [d for d in delays if d is not None]
    return min(given) if given else None


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
        and _served_uri(status) == uri
        and [e.get("podName") for e in endpoints] == placement
        and all(e.get("ready") for e in endpoints)
    )
