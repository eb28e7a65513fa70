"""DynamoModel status: conditions (metav1.Condition), phase, and the status document.

Condition types: ``Synced`` (source available in the store), ``EndpointsReady`` (every placed
pod loaded the wanted version), ``Degraded`` (serving, but not what the spec asks: a failed hot
swap keeps the last good version, reason ``SwapFailed``) and ``Ready`` (routable: true once the
adapter was fully loaded and while some endpoint still serves a good version; a first load
that has not completed yet is not Ready). Reasons are CamelCase constants below.
``Autoscaling`` (only with ``spec.autoscaling``: reason ``ScaledUp``, ``ScaledDown``, ``AtTarget``,
``CoolingDown``, ``AtMaxReplicas``, ``AtMinReplicas``, ``LimitedByCapacity``, ``NoDemandData`` or
``ScaledToZero``, with the demand in the message) says why ``desiredReplicas`` is what it is. Phase
``ScaledToZero`` (``minReplicas: 0`` after its idle window): no pod holds it, it is routable all the
same (``Ready``, reason ``ScaledToZero``): the first request loads it on demand. A condition's
``lastTransitionTime`` changes only when its ``status`` changes, so recomputing an unchanged
state yields an identical document (no status patch, no event loop).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

# phases
PENDING, SYNCING, LOADING, READY, DEGRADED, FAILED = "Pending", "Syncing", "Loading", "Ready", "Degraded", "Failed"
SCALED_TO_ZERO = "ScaledToZero"  # also the reason: no replica; workers load it on demand from their catalogue

# reasons
SOURCE_AVAILABLE = "SourceAvailable"  # s3:// / file:// (or hf:// without a store): workers fetch directly
NO_SOURCE_NEEDED = "NoSourceNeeded"  # base / adapter models
SYNC_JOB_RUNNING = "SyncJobRunning"
SYNC_JOB_RETRYING = "SyncJobRetrying"  # running, after failed pods (retryable errors: the source is unreachable)
SYNC_SUCCEEDED = "SyncSucceeded"
SYNC_FAILED = "SyncFailed"
CREDENTIALS_MISSING = "CredentialsSecretMissing"  # spec.source.credentialsSecretRef names no Secret (yet)
INVALID_SOURCE = "InvalidSource"
RESOLVE_FAILED = "RevisionResolveFailed"
ALL_LOADED = "AllEndpointsLoaded"
ENDPOINTS_READY = "EndpointsReady"
NO_WORKERS = "NoWorkers"
LOADING_REASON = "Loading"
PARTIALLY_LOADED = "PartiallyLoaded"
LOAD_FAILED = "LoadFailed"
ADAPTER_INVALID = "AdapterInvalid"
WAITING_FOR_SYNC = "WaitingForSync"
INSUFFICIENT_CAPACITY = "InsufficientCapacity"  # the Ready pods cannot hold (all replicas of) the adapter
SWAP_FAILED = "SwapFailed"  # Degraded: the new version failed, the last good one keeps serving
NOT_DEGRADED = "AsExpected"
MODEL_NAME_CONFLICT = "ModelNameConflict"  # an older DynamoModel owns this modelName
SERVING = "Serving"  # Ready while a change is in progress: a good version is still served

CONDITION_TYPES = ("Synced", "EndpointsReady", "Degraded", "Ready")


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool
    reason: str
    message: str


NOT_DEGRADED_CONDITION = Condition("Degraded", False, NOT_DEGRADED, "serving the spec")


@dataclass
class Observed:
    """What one reconcile pass found; ``render`` turns it into the status document."""

    generation: int
    phase: str
    synced: Condition
    endpoints_ready: Condition
    endpoints: list[dict[str, Any]] = field(default_factory=list)
    placement: list[str] = field(default_factory=list)
    resolved_uri: str | None = None
    revision: str | None = None
    sync_job: str | None = None
    degraded: Condition = field(default_factory=lambda: NOT_DEGRADED_CONDITION)
    served_uri: str | None = None  # the last URI loaded on the whole placement (the last good version)
    routable: bool = False  # a good version is served although the phase is not Ready
    desired_replicas: int | None = None  # spec.autoscaling: the replicas wanted now
    scaling: Condition | None = None  # spec.autoscaling: the Autoscaling condition (why)

    def outcome(
        self,
        phase: str,
        endpoints_ready: Condition,
        endpoints: list[dict[str, Any]] | None = None,
        placement: list[str] | None = None,
    ) -> Observed:
        """These facts with a pass's outcome (a copy): its phase, ``EndpointsReady`` and endpoints."""
        return replace(
            self, phase=phase, endpoints_ready=endpoints_ready, endpoints=endpoints or [], placement=placement or []
        )

    @property
    def ready_count(self) -> int:
        return sum(1 for e in self.endpoints if e["ready"])

    @property
    def current_replicas(self) -> int:
        """Placed pods that serve the adapter now."""
        return sum(1 for e in self.endpoints if e["ready"] and e.get("podName") in self.placement)

    def summary(self) -> Condition:
        """The Ready condition: true in phase Ready and at zero (routable: loaded on demand), else the
        most telling failing reason."""
        if self.phase == SCALED_TO_ZERO:
            return Condition("Ready", True, SCALED_TO_ZERO, self.endpoints_ready.message)
        if self.phase == READY:
            return Condition("Ready", True, "Ready", f"{self.ready_count}/{len(self.endpoints)} endpoints ready")
        if self.routable and self.ready_count:
            cause = self.degraded if self.degraded.status else self.endpoints_ready
            return Condition("Ready", True, SERVING, f"{self.ready_count} endpoint(s) serving; {cause.message}")
        cause = self.synced if not self.synced.status else self.endpoints_ready
        return Condition("Ready", False, cause.reason, cause.message)


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_condition(
    previous: Sequence[Mapping[str, Any]], cond: Condition, generation: int, now: str
) -> dict[str, Any]:
    """A metav1.Condition dict, keeping lastTransitionTime when the status did not change."""
    status = "True" if cond.status else "False"
    old = next((c for c in previous if c.get("type") == cond.type), None)
    since = old["lastTransitionTime"] if old and old.get("status") == status and old.get("lastTransitionTime") else now
    return {
        "type": cond.type,
        "status": status,
        "observedGeneration": generation,
        "lastTransitionTime": since,
        "reason": cond.reason,
        "message": cond.message[:32000],
    }


def render(observed: Observed, previous: Mapping[str, Any], now: str | None = None) -> dict[str, Any]:
    """The full status document (Dynamo fields first, lorafleet extensions after)."""
    now = now or now_iso()
    old_conditions = previous.get("conditions") or []
    conditions = [
        merge_condition(old_conditions, c, observed.generation, now)
        for c in (observed.synced, observed.endpoints_ready, observed.degraded, observed.summary(), observed.scaling)
        if c is not None
    ]
    return {
        "endpoints": observed.endpoints,
        "readyEndpoints": observed.ready_count,
        "totalEndpoints": len(observed.endpoints),
        "conditions": conditions,
        "observedGeneration": observed.generation,
        "phase": observed.phase,
        "placement": observed.placement,
        "resolvedUri": observed.resolved_uri,
        "revision": observed.revision,
        "syncJob": observed.sync_job,
        "servedUri": observed.served_uri,
        "desiredReplicas": observed.desired_replicas,
        "currentReplicas": None if observed.desired_replicas is None else observed.current_replicas,
    }


def status_patch(new: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch turning ``current`` into ``new`` ({} when nothing changed).

    Keys whose new value is None are removed (JSON merge patch null)."""
    patch: dict[str, Any] = {}
    for key, value in new.items():
        if value is None:
            if current.get(key) is not None:
                patch[key] = None
        elif current.get(key) != value:
            patch[key] = value
    return patch


def condition(status: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    """The condition ``type_`` of a status document, if present."""
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), None)
