"""Scale to zero (``spec.autoscaling.minReplicas: 0`` with ``scaleToZeroAfter``): the policy, the
reconcile that unloads every copy and publishes ``ScaledToZero``, and the way back: the router's
rendezvous pod loads it on demand, and the autoscaler's placement keeps it on that pod.

The reconcile runs against real HTTP management servers (``MgmtWorker``), which load a catalogued
adapter on demand when ``serve`` stands for an inference request.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from lorafleet_operator import status as st
from lorafleet_operator.autoscale import (
    NO_DEMAND_DATA,
    SCALED_TO_ZERO,
    SCALED_UP,
    Autoscaler,
    Policy,
    decide,
    parse_duration,
)
from lorafleet_operator.placement import rank, takes
from lorafleet_operator.resources import Model
from lorafleet_router.router import RoutingTable

from .conftest import MgmtWorker
from .test_reconcile import _close_clients, cond, converge, lora, make, pods_for  # noqa: F401 (fixture)

ZERO = Policy(min_replicas=0, max_replicas=3, target=2.0, scale_to_zero_after=60.0)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def idle_lora(name: str = "org/idle", **spec: Any) -> Model:
    autoscaling = {"minReplicas": 0, "maxReplicas": 3, "target": 2, "scaleToZeroAfter": "1m"} | spec
    return lora(name, replicas=None, autoscaling=autoscaling)


def test_durations_and_the_policy_of_the_spec() -> None:
    assert [parse_duration(v, 7.0) for v in (None, 90, 2.5, "300", "45s", "5m", "1.5h")] == [
        7.0, 90.0, 2.5, 300.0, 45.0, 300.0, 5400.0,
    ]  # fmt: skip
    for bad in ("5 min", "-3", "m", True, -1):
        with pytest.raises(ValueError):
            parse_duration(bad, 7.0)
    assert Policy.from_spec({"minReplicas": 0, "maxReplicas": 3, "target": 2, "scaleToZeroAfter": "1m"}) == ZERO
    assert Policy.from_spec({"maxReplicas": 3, "target": 2}) == Policy(1, 3, 2.0, 300.0)  # defaults


def test_zero_only_after_the_idle_window_and_back_with_demand() -> None:
    one = decide(ZERO, 0.0, 1, since_change=1e6, idle_for=59.0)
    assert one.replicas == 1  # no demand, but not for long enough: one replica stays (never 0 here)
    zero = decide(ZERO, 0.0, 1, since_change=0.0, idle_for=60.0)  # the idle window, not the cool-down, decides
    assert (zero.replicas, zero.reason) == (0, SCALED_TO_ZERO)
    assert decide(ZERO, 0.0, 0, since_change=0.0).replicas == 0
    back = decide(ZERO, 0.2, 0, since_change=0.0)
    assert (back.replicas, back.reason) == (1, SCALED_UP)  # a little demand: one replica
    assert decide(ZERO, 5.0, 0, since_change=0.0).replicas == 3  # much: ceil(5 / 2), at once
    assert decide(ZERO, 0.5, 2, since_change=1e6, idle_for=1e6).replicas == 1  # demand: shrinks to 1, not 0
    # minReplicas 1 never goes to zero, however long it idles
    assert decide(dataclasses.replace(ZERO, min_replicas=1), 0.0, 1, 1e6, idle_for=1e6).replicas == 1


def test_the_autoscaler_times_the_idle_window_from_the_last_demand() -> None:
    clock = Clock()
    scaler = Autoscaler(cooldown=0.0, clock=clock)
    model = idle_lora()
    assert scaler.replicas(model) == (1, scaler.replicas(model)[1])  # type: ignore[index]  # new: loaded once
    assert scaler.replicas(model)[1].reason == NO_DEMAND_DATA  # type: ignore[index]
    clock.now += 50
    scaler.observe(model, 0.5)  # demand: the window starts again
    clock.now += 50
    scaler.observe(model, 0.0)
    assert scaler.replicas(model)[0] == 1  # type: ignore[index]  # 50 s idle < 60 s
    clock.now += 11
    assert scaler.observe(model, 0.0)
    assert scaler.replicas(model)[0] == 0  # type: ignore[index]
    assert not scaler.observe(model, 0.0)  # staying at zero changes nothing: no re-queue
    # a restarted operator resumes at zero from the published status
    resumed = Autoscaler().replicas(dataclasses.replace(model, status={"desiredReplicas": 0}))
    assert resumed is not None and resumed[0] == 0 and resumed[1].reason == SCALED_TO_ZERO
    assert not takes("org/idle", [], 0, "worker-1")  # a pod joining does not concern a model at zero


async def test_scaled_to_zero_unloads_every_copy_and_comes_back_where_the_router_sent_it(
    mgmt_workers: list[MgmtWorker],
) -> None:
    clock = Clock()
    scaler = Autoscaler(cooldown=0.0, clock=clock)
    rec, events = make(mgmt_workers, autoscaler=scaler)
    pods = pods_for(mgmt_workers)
    workers = {p.name: w for p, w in zip(pods, mgmt_workers, strict=True)}
    for w in mgmt_workers:
        w.catalog = [("org/idle", "s3://bucket/a")]  # what catalog.Catalogs tells them (test_catalog.py)

    model, result = await converge(rec, idle_lora(), pods)  # new: loaded once, on one pod
    (placed,) = result.status["placement"]
    assert result.status["phase"] == st.READY and result.status["servedUri"] == "s3://bucket/a"
    other = next(name for name in workers if name != placed)
    assert workers[other].serve("org/idle")  # a request elsewhere loaded a copy on demand

    clock.now += 61
    assert scaler.observe(model, 0.0)  # a minute without demand
    model, result = await converge(rec, model, pods)
    status = result.status
    assert status["phase"] == st.SCALED_TO_ZERO and status["endpoints"] == [] and status["placement"] == []
    assert (status["readyEndpoints"], status["totalEndpoints"]) == (0, 0)
    assert (status["desiredReplicas"], status["currentReplicas"]) == (0, 0)
    assert cond(status, "Ready")["status"] == "True" and cond(status, "Ready")["reason"] == SCALED_TO_ZERO
    assert cond(status, "Autoscaling")["reason"] == SCALED_TO_ZERO
    assert not any("org/idle" in w.loras for w in mgmt_workers)  # pinned and on-demand copies unloaded
    assert status["servedUri"] == "s3://bucket/a"  # still catalogued
    assert "Unloaded" in events.reasons()

    # the router sends the next request to the rendezvous pod, which loads it on demand ...
    table = RoutingTable(inference_port=8000)
    for p in pods:
        table.pods[(p.namespace, p.name)] = p
    (endpoint,) = table.rendezvous_endpoint(model)
    (rendezvous,) = [p.name for p in pods if endpoint == f"http://{p.ip}:8000"]
    assert rendezvous == rank("org/idle", workers)[0]
    assert workers[rendezvous].serve("org/idle")
    # ... a pass at zero meanwhile leaves that copy alone: its request's demand brings the model back
    model, result = await converge(rec, dataclasses.replace(model, generation=model.generation), pods)
    assert workers[rendezvous].on_demand == {"org/idle"}
    deletes = sum(1 for w in mgmt_workers for m, _ in w.calls if m == "DELETE")

    # other adapters: the rendezvous pod a little busier than the rest, between the balance's entry level
    # (where a new replica would not go) and its bound (where a replica it holds stays)
    for name, w in workers.items():
        w.loras |= {f"other-{name}-{i}": "s3://bucket/o" for i in range(11 if name == rendezvous else 10)}
    rec.inventory.invalidate_listings()
    assert scaler.observe(model, 0.4)
    model, result = await converge(rec, model, pods)
    status = result.status
    assert status["phase"] == st.READY and status["placement"] == [rendezvous]  # nothing moved
    assert workers[rendezvous].on_demand == set() and "org/idle" in workers[rendezvous].loras  # pinned now
    assert sum(1 for w in mgmt_workers for m, _ in w.calls if m == "DELETE") == deletes
    assert {n for n, w in workers.items() if "org/idle" in w.loras} == {rendezvous}
    # without the copy (a pod that never served it) the same loads would have placed it elsewhere
    fresh, _ = make(mgmt_workers, autoscaler=Autoscaler(cooldown=0.0, clock=clock))
    workers[rendezvous].loras.pop("org/idle")
    _, elsewhere = await converge(fresh, idle_lora("org/idle"), pods)
    assert elsewhere.status["placement"] != [rendezvous]
