"""Demand-aware replicas (``spec.autoscaling``, a lorafleet extension): the policy and its state.

An autoscaled DynamoModel asks for ``minReplicas <= n <= maxReplicas`` pods, sized so that each
replica carries at most ``target`` units of demand. Demand is what the routers report per adapter
(``GET /demand``): the time-averaged number of requests in flight plus queued for it over the
routers' window (Little's law: request rate x latency), summed over the router replicas.

The policy (``decide``, a plain function the simulation ``bench/sim_placement.py`` calls too):
- grow at once to ``ceil(demand / target)`` when that exceeds the current count;
- shrink only when ``demand / target`` has fallen below ``scale_down_at`` of the current count
  (hysteresis: shrinking never lands a replica back above ``scale_down_at x target``), and only
  after ``cooldown`` since the last change (cool-down), to ``ceil(demand / (scale_down_at x target))``;
- always within ``[minReplicas, maxReplicas]`` (a spec change applies at once);
- ``minReplicas: 0``: at least one replica while there is demand; after ``scaleToZeroAfter`` (a
  duration: seconds, or a number with ``s``, ``m`` or ``h``; default 300 s) with no demand (the routers
  no longer report it: their mean decayed below ``IDLE_DEMAND``) none (``ScaledToZero``): the
  reconciler unloads it everywhere and it stays in the workers' catalogues, so the first request
  loads it on demand on its rendezvous pod; that request's demand scales it back up, and the
  placement keeps the replica there.

The reconciler places the wanted count along the adapter's HRW order within capacity and, by
default, by demand-weighted bounded loads (``placement.place_balanced``, weighted by the demand
this module keeps from the last poll: ``Autoscaler.weights``), so growing adds the next pods of
that order below the balance bound and shrinking drops the last ones; leavers are unloaded only
after the shrunk placement is published (make-before-break, ``reconcile._unload_leavers``).
Adapters a placement left on a pod above the bound (``Autoscaler.place_again``) are re-queued by the
next poll.

``Autoscaler`` keeps the per-model state (wanted count, time of the last change) and is what the
reconciler asks for a model's replica count; ``autoscale_pass`` is one poll of the routers.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from lorafleet_operator.resources import Model

log = logging.getLogger(__name__)

SCALE_DOWN_AT = 0.5  # shrink when demand per replica would stay below half the target
DEFAULT_COOLDOWN = 300.0  # seconds between a change and the next shrink

# reasons of the Autoscaling condition
SCALED_UP, SCALED_DOWN, STEADY, COOLING_DOWN = "ScaledUp", "ScaledDown", "AtTarget", "CoolingDown"
AT_MIN, AT_MAX, NO_DEMAND_DATA = "AtMinReplicas", "AtMaxReplicas", "NoDemandData"
LIMITED_BY_CAPACITY = "LimitedByCapacity"
SCALED_TO_ZERO = "ScaledToZero"

DEFAULT_SCALE_TO_ZERO_AFTER = 300.0  # seconds without demand before minReplicas 0 means none
IDLE_DEMAND = 0.001  # below this the routers drop an adapter from their report: no demand
_DURATION = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([smh]?)$")
_UNIT = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: object, default: float) -> float:
    """Seconds of a duration given as a number of seconds or a string like ``"300"``, ``"90s"``,
    ``"5m"``, ``"1h"`` (None: ``default``)."""
    if value is None:
        return default
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value).strip())
        if match is None:
            raise ValueError(f"not a duration (seconds, or a number with s, m or h): {value!r}")
        seconds = float(match.group(1)) * _UNIT[match.group(2)]
    if seconds < 0:
        raise ValueError(f"a duration must not be negative: {value!r}")
    return seconds


@dataclass(frozen=True)
class Policy:
    """``spec.autoscaling``: replica bounds and the demand one replica should carry."""

    min_replicas: int  # 0: scales to zero after ``scale_to_zero_after`` seconds without demand
    max_replicas: int
    target: float
    scale_to_zero_after: float = DEFAULT_SCALE_TO_ZERO_AFTER

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any] | None) -> Policy | None:
        """The policy of ``spec.autoscaling`` (None when absent: fixed replicas)."""
        if not spec:
            return None
        raw = spec.get("minReplicas")
        low = max(0, int(1 if raw is None else raw))
        high = max(low, 1, int(spec.get("maxReplicas") or low))
        target = float(spec.get("target") or 1.0)
        try:
            idle = parse_duration(spec.get("scaleToZeroAfter"), DEFAULT_SCALE_TO_ZERO_AFTER)
        except ValueError as e:  # the CRD validates it; an object from before that is read as the default
            log.warning("spec.autoscaling.scaleToZeroAfter: %s; using %gs", e, DEFAULT_SCALE_TO_ZERO_AFTER)
            idle = DEFAULT_SCALE_TO_ZERO_AFTER
        return cls(low, high, target if target > 0 else 1.0, idle)

    def clamp(self, n: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, n))


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str
    message: str

    @property
    def changed(self) -> bool:
        return self.reason in (SCALED_UP, SCALED_DOWN, SCALED_TO_ZERO)


def at_zero(after: float) -> Decision:
    """The decision of an adapter scaled to zero."""
    return Decision(0, SCALED_TO_ZERO, f"no demand for {after:g}s: no replicas; the first request loads it on demand")


def decide(
    policy: Policy,
    demand: float,
    current: int,
    since_change: float,
    *,
    cooldown: float = DEFAULT_COOLDOWN,
    scale_down_at: float = SCALE_DOWN_AT,
    idle_for: float = 0.0,
) -> Decision:
    """The replica count for ``demand`` given the ``current`` count, changed ``since_change`` ago, with no
    demand for ``idle_for`` seconds (``minReplicas: 0`` only)."""
    demand = max(0.0, demand)
    per = demand / max(current, 1)
    what = f"demand {demand:.2f} = {per:.2f} per replica on {current} (target {policy.target:g})"
    if policy.min_replicas == 0:
        if demand < IDLE_DEMAND and (current == 0 or idle_for >= policy.scale_to_zero_after):
            return at_zero(policy.scale_to_zero_after)
        policy = replace(policy, min_replicas=1)  # while there is demand, or not for long enough yet
        if current == 0:
            up = policy.clamp(math.ceil(demand / policy.target - 1e-9))
            return Decision(up, SCALED_UP, f"{what}: back from zero to {up}")
    clamped = policy.clamp(current)
    if clamped != current:
        reason = SCALED_UP if clamped > current else SCALED_DOWN
        return Decision(clamped, reason, f"{what}: spec bounds [{policy.min_replicas}, {policy.max_replicas}]")
    up = policy.clamp(math.ceil(demand / policy.target - 1e-9))
    if up > current:
        return Decision(up, SCALED_UP, f"{what}: scaled up to {up}")
    down = policy.clamp(math.ceil(demand / (policy.target * scale_down_at) - 1e-9))
    if down < current:
        if since_change < cooldown:
            wait = cooldown - since_change
            return Decision(current, COOLING_DOWN, f"{what}: {down} would do; cooling down for {wait:.0f}s")
        return Decision(down, SCALED_DOWN, f"{what}: scaled down to {down}")
    if current == policy.max_replicas and demand > policy.target * current:
        return Decision(current, AT_MAX, f"{what}: at maxReplicas")
    if current == policy.min_replicas and demand <= policy.target * scale_down_at * current:
        return Decision(current, AT_MIN, f"{what}: at minReplicas")
    return Decision(current, STEADY, f"{what}")


@dataclass
class _State:
    replicas: int
    changed: float  # monotonic time of the last change
    decision: Decision
    active: float  # monotonic time demand was last seen (or the state was made)


class Autoscaler:
    """Per-model autoscaling state; the reconciler asks it how many replicas a model wants."""

    def __init__(
        self,
        *,
        cooldown: float = DEFAULT_COOLDOWN,
        scale_down_at: float = SCALE_DOWN_AT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cooldown = cooldown
        self.scale_down_at = scale_down_at
        self.clock = clock
        self._state: dict[str, _State] = {}  # model uid -> state
        self._demand: dict[str, dict[str, float]] | None = None  # base model -> modelName -> demand (last poll)
        self._revisit: set[tuple[str, str]] = set()  # (base model, modelName): to place again (placement.relief)

    def place_again(self, base_model: str, model_names: Iterable[str]) -> None:
        """Ask the next poll to re-queue these adapters (a placement left them on pods above the bound)."""
        self._revisit.update((base_model, n) for n in model_names)

    def take_revisits(self) -> set[tuple[str, str]]:
        """The (base model, modelName) pairs asked for since the last call; the set is emptied."""
        revisit, self._revisit = self._revisit, set()
        return revisit

    def note_demand(self, models: Iterable[tuple[tuple[str, str], Model]], demand: Demand) -> None:
        """Keep every adapter's demand from the last poll (the balance weights of its base model's pods)."""
        weights: dict[str, dict[str, float]] = {}
        for key, model in models:
            if model.is_lora and not model.deleting:
                weights.setdefault(model.base_model_name, {})[model.model_name] = demand.get(key, 0.0)
        self._demand = weights

    def weights(self, base_model_name: str) -> dict[str, float] | None:
        """modelName -> demand on ``base_model_name``'s pods, as of the last poll (None: no poll answered yet)."""
        return None if self._demand is None else self._demand.get(base_model_name, {})

    def _current(self, model: Model, policy: Policy) -> _State:
        state = self._state.get(model.uid)
        if state is None:  # first sight (or an operator restart): resume from the published status
            published = model.status.get("desiredReplicas")
            if not isinstance(published, int):  # newly autoscaled: keep what is placed (no sudden shrink)
                # a new adapter is loaded once (checked, served, catalogued) even with minReplicas 0
                published = len(model.status.get("placement") or ()) or max(policy.min_replicas, 1)
            start = policy.clamp(published)
            decision = Decision(start, NO_DEMAND_DATA, f"{start} replicas until the routers report demand")
            if start == 0:
                decision = at_zero(policy.scale_to_zero_after)
            now = self.clock()
            state = self._state[model.uid] = _State(start, now, decision, now)
        return state

    def replicas(self, model: Model) -> tuple[int, Decision] | None:
        """(wanted replicas, the last decision) for an autoscaled model; None for fixed replicas."""
        policy = Policy.from_spec(model.autoscaling)
        if policy is None:
            self._state.pop(model.uid, None)
            return None
        state = self._current(model, policy)
        if policy.clamp(state.replicas) != state.replicas:  # the spec's bounds changed
            self.observe(model, None)
        return state.replicas, state.decision

    def floor(self, model: Model) -> int:
        """``minReplicas`` of an autoscaled model (1 otherwise; 0 for one that scales to zero)."""
        policy = Policy.from_spec(model.autoscaling)
        return 1 if policy is None else policy.min_replicas

    def observe(self, model: Model, demand: float | None) -> bool:
        """Apply the policy to ``model``'s current demand (None: not reported); True when the count changed."""
        policy = Policy.from_spec(model.autoscaling)
        if policy is None:
            return False
        state = self._current(model, policy)
        now = self.clock()
        if demand is None:
            clamped = policy.clamp(state.replicas)
            if clamped == state.replicas:
                return False
            decision = Decision(clamped, SCALED_UP if clamped > state.replicas else SCALED_DOWN, "spec bounds changed")
        else:
            if demand >= IDLE_DEMAND:
                state.active = now
            decision = decide(
                policy, demand, state.replicas, now - state.changed, cooldown=self.cooldown,
                scale_down_at=self.scale_down_at, idle_for=now - state.active,
            )  # fmt: skip
        changed = decision.replicas != state.replicas
        if not changed and decision.reason == STEADY and state.decision.changed:
            return False  # the last change (ScaledUp/ScaledDown) stays the reason while demand fits
        if changed:
            log.info("%s/%s: %s -> %d replicas (%s)", model.namespace, model.name, state.replicas, decision.replicas,
                     decision.message)  # fmt: skip
            state.replicas, state.changed = decision.replicas, now
        before = state.decision
        state.decision = decision
        return changed or before.reason != decision.reason

    def forget(self, uid: str) -> None:
        self._state.pop(uid, None)


Demand = dict[tuple[str, str], float]  # (namespace, DynamoModel name) -> demand
DemandSource = Callable[[], Awaitable[Demand | None]]


def merge_reports(reports: Iterable[Mapping[str, Any]]) -> Demand:
    """Sum the routers' ``GET /demand`` bodies: (namespace, name) -> in flight + queued (window mean)."""
    total: Demand = {}
    for report in reports:
        for entry in report.get("adapters") or []:
            key = (str(entry.get("namespace", "")), str(entry.get("name", "")))
            total[key] = total.get(key, 0.0) + float(entry.get("concurrency") or 0.0)
    return total


async def autoscale_pass(
    autoscaler: Autoscaler,
    models: Iterable[tuple[tuple[str, str], Model]],
    fetch: DemandSource,
    enqueue: Callable[[tuple[str, str]], None],
) -> list[tuple[str, str]]:
    """One poll: apply the policy to every autoscaled model, re-queue those whose count (or reason)
    changed, and those a placement asked to place again (``Autoscaler.place_again``: adapters on pods
    above the balance bound). Keeps the demand as the balance weights (``Autoscaler.weights``).

    When no router answered, nothing changes (no demand data is not zero demand)."""
    models = list(models)
    revisit = autoscaler.take_revisits()
    for key, model in models:
        if (model.base_model_name, model.model_name) in revisit and model.is_lora and not model.deleting:
            enqueue(key)
    demand = await fetch()
    if demand is None:
        return []
    autoscaler.note_demand(models, demand)
    changed = []
    for key, model in models:
        if not model.autoscaling or not model.is_lora or model.deleting:
            continue
        if autoscaler.observe(model, demand.get(key, 0.0)):
            enqueue(key)
            changed.append(key)
    return changed


class RouterDemand:
    """Reads ``GET <url>`` (the routers' ``/demand``) and sums the answers.

    A URL's host name is resolved to all its addresses and each is read: a headless Service
    (the chart's ``<fullname>-router-pods``) names every router pod, so every router's share counts."""

    def __init__(self, urls: Iterable[str], timeout: float = 5.0) -> None:
        self.urls = list(urls)
        self.timeout = timeout
        self._session: Any = None
        self._unresolved: set[str] = set()  # hosts whose last lookup failed: warned once, until they resolve

    async def targets(self) -> list[str] | None:
        """The URLs to read, one per address of each URL's host (None when a name does not resolve)."""
        import asyncio
        import ipaddress
        import socket
        from urllib.parse import urlsplit

        out: list[str] = []
        for url in self.urls:
            parts = urlsplit(url)
            host, port = parts.hostname or "", parts.port or 80
            try:
                ipaddress.ip_address(host)
                out.append(url)
                continue
            except ValueError:
                pass
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as e:
                if host not in self._unresolved:  # once per outage: a dev cluster without DNS never resolves it
                    log.warning("cannot resolve %s for demand (no demand data until it resolves): %s", host, e)
                    self._unresolved.add(host)
                return None
            if host in self._unresolved:
                self._unresolved.discard(host)
                log.info("%s resolves again for demand", host)
            for address in sorted({str(info[4][0]) for info in infos}):
                netloc = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
                out.append(parts._replace(netloc=netloc).geturl())
        return out

    async def __call__(self) -> Demand | None:
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        targets = await self.targets()
        if targets is None:
            return None
        reports = []
        for url in targets:
            try:
                async with self._session.get(url) as response:
                    response.raise_for_status()
                    reports.append(await response.json())
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                log.warning("cannot read demand from %s: %s", url, e)
                return None  # a partial sum would read as lower demand: change nothing this time
        return merge_reports(reports)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
