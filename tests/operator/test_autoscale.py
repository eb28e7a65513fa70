"""Demand-aware replicas (spec.autoscaling): the policy, the router's demand report, and the reconcile hook."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import unused_port
from lorafleet_operator import status as st
from lorafleet_operator.autoscale import (
    AT_MAX,
    COOLING_DOWN,
    LIMITED_BY_CAPACITY,
    NO_DEMAND_DATA,
    SCALED_DOWN,
    SCALED_UP,
    STEADY,
    Autoscaler,
    Policy,
    RouterDemand,
    autoscale_pass,
    decide,
    merge_reports,
)
from lorafleet_operator.placement import rank
from lorafleet_operator.resources import Model
from lorafleet_router.demand import DemandTracker

from .conftest import MgmtWorker
from .test_reconcile import _close_clients, converge, lora, make, pods_for, reason  # noqa: F401 (fixture)

POLICY = Policy(min_replicas=1, max_replicas=4, target=2.0)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def auto(name: str = "org/hot", **spec: Any) -> Model:
    return lora(name, replicas=None, autoscaling={"minReplicas": 1, "maxReplicas": 4, "target": 2} | spec)


# ---- the policy ------------------------------------------------------------------------------
def test_grows_at_once_to_demand_over_target_within_max() -> None:
    assert decide(POLICY, 5.0, 1, since_change=0.0).replicas == 3  # ceil(5 / 2), no cool-down for growth
    assert decide(POLICY, 5.0, 1, since_change=0.0).reason == SCALED_UP
    at_max = decide(POLICY, 50.0, 4, since_change=0.0)
    assert (at_max.replicas, at_max.reason) == (4, AT_MAX)
    assert decide(POLICY, 50.0, 1, since_change=0.0).replicas == 4


def test_shrinks_only_below_the_hysteresis_band_and_after_the_cool_down() -> None:
    # 3 replicas, target 2: demand 4 fits 2 replicas exactly, but shrinking to 2 would leave 2.0 per
    # replica, above half the target: stays (hysteresis), also long after the last change
    assert decide(POLICY, 4.0, 3, since_change=1e6).replicas == 3
    assert decide(POLICY, 4.0, 3, since_change=1e6).reason == STEADY
    # demand 1.5: one replica would carry 1.5 > 1.0 (half the target), two carry 0.75: shrink to 2
    cooling = decide(POLICY, 1.5, 3, since_change=10.0, cooldown=60.0)
    assert (cooling.replicas, cooling.reason) == (3, COOLING_DOWN)
    down = decide(POLICY, 1.5, 3, since_change=60.0, cooldown=60.0)
    assert (down.replicas, down.reason) == (2, SCALED_DOWN)
    assert decide(POLICY, 0.0, 3, since_change=60.0, cooldown=60.0).replicas == 1  # minReplicas


def test_spec_bounds_apply_at_once() -> None:
    policy = Policy.from_spec({"minReplicas": 2, "maxReplicas": 3, "target": 1})
    assert policy == Policy(2, 3, 1.0)
    assert decide(policy, 0.0, 5, since_change=0.0, cooldown=1e9).replicas == 3  # above max: no cool-down
    assert decide(policy, 0.0, 1, since_change=0.0).replicas == 2
    assert Policy.from_spec(None) is None and Policy.from_spec({}) is None


def test_no_flapping_under_steady_noisy_demand() -> None:
    clock = Clock()
    scaler = Autoscaler(cooldown=60.0, clock=clock)
    model = auto()
    changes = 0
    for i in range(200):  # demand wobbles around 5 (2.5 replicas' worth)
        clock.now += 5
        changes += scaler.observe(model, 5.0 + (0.9 if i % 2 else -0.9)) and scaler.replicas(model) is not None
    replicas, _ = scaler.replicas(model) or (0, None)
    assert replicas == 3
    assert changes <= 3  # the first scale-up (and the reason settling), never back and forth


def test_autoscaler_resumes_from_the_published_status_after_a_restart() -> None:
    model = dataclasses.replace(auto(), status={"desiredReplicas": 3})
    replicas, decision = Autoscaler().replicas(model) or (0, None)
    assert replicas == 3 and decision is not None and decision.reason == NO_DEMAND_DATA
    assert Autoscaler().replicas(lora("org/fixed", replicas=2)) is None  # fixed replicas: not autoscaled
    switched = dataclasses.replace(auto(), status={"placement": ["w-1", "w-2"]})  # was fixed at 2 replicas
    assert (Autoscaler().replicas(switched) or (0, None))[0] == 2  # keeps them until demand says otherwise


async def test_autoscale_pass_requeues_changed_models_and_ignores_missing_data() -> None:
    scaler = Autoscaler(cooldown=0.0)
    hot, fixed = auto("org/hot"), lora("org/fixed", replicas=2)
    models = [(hot.key, hot), (fixed.key, fixed)]
    queued: list[tuple[str, str]] = []

    async def demand() -> dict[tuple[str, str], float]:
        return {hot.key: 7.0, fixed.key: 100.0}

    async def nothing() -> None:
        return None

    assert await autoscale_pass(scaler, models, nothing, queued.append) == []  # no data is not zero demand
    assert await autoscale_pass(scaler, models, demand, queued.append) == [hot.key]
    assert queued == [hot.key] and scaler.replicas(hot) is not None and scaler.replicas(hot)[0] == 4  # type: ignore[index]
    assert await autoscale_pass(scaler, models, demand, queued.append) == []  # unchanged: nothing queued


# ---- the router's demand report ------------------------------------------------------------
def test_demand_tracker_counts_in_flight_and_queued_with_window_means() -> None:
    clock = Clock()
    tracker = DemandTracker(window=10.0, clock=clock)
    key = ("ns", "hot", "org/hot")
    for _ in range(4):
        tracker.arrive(key)
    tracker.dispatch(key)
    tracker.dispatch(key)
    report = tracker.report()
    (entry,) = report["adapters"]
    assert (entry["inflight"], entry["queued"]) == (2, 2)
    assert entry["concurrency"] == 0.0  # no time has passed yet
    clock.now += 100.0  # ten windows at 4 in flight + queued: the mean converges to 4
    (entry,) = tracker.report()["adapters"]
    assert entry["concurrency"] == pytest.approx(4.0, abs=1e-3)
    tracker.requeue(key)
    tracker.finish(key, dispatched=True)
    tracker.finish(key, dispatched=False)
    tracker.finish(key, dispatched=False)
    tracker.finish(key, dispatched=False)
    clock.now += 1000.0
    assert tracker.report()["adapters"] == []  # idle and decayed: dropped


def test_merge_reports_sums_the_routers() -> None:
    one = {"adapters": [{"namespace": "ns", "name": "hot", "concurrency": 1.5}]}
    two = {"adapters": [{"namespace": "ns", "name": "hot", "concurrency": 2.0}, {"namespace": "ns", "name": "x"}]}
    assert merge_reports([one, two]) == {("ns", "hot"): 3.5, ("ns", "x"): 0.0}


async def test_router_demand_reads_every_url_and_none_when_one_fails(caplog: pytest.LogCaptureFixture) -> None:
    port = unused_port()
    app = web.Application()

    async def report(_: web.Request) -> web.Response:
        return web.json_response({"adapters": [{"namespace": "ns", "name": "hot", "concurrency": 2.5}]})

    app.add_routes([web.get("/demand", report)])
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}/demand"
    try:
        both = RouterDemand([url, url])
        assert await both() == {("ns", "hot"): 5.0}
        await both.close()
        broken = RouterDemand([url, f"http://127.0.0.1:{port}/missing"])
        assert await broken() is None
        await broken.close()
        unknown = RouterDemand([url, "http://no-such-router.invalid:8000/demand"])
        with caplog.at_level(logging.WARNING, logger="lorafleet_operator.autoscale"):
            assert await unknown() is None  # a name that does not resolve: no data, not zero demand
            assert await unknown() is None
        warned = [r for r in caplog.records if "cannot resolve no-such-router.invalid" in r.getMessage()]
        assert len(warned) == 1  # once per outage, not every interval
        await unknown.close()
    finally:
        await runner.cleanup()


# ---- reconcile ---------------------------------------------------------------------------------
async def test_reconcile_grows_along_hrw_and_shrinks_make_before_break(mgmt_workers: list[MgmtWorker]) -> None:
    clock = Clock()
    scaler = Autoscaler(cooldown=30.0, clock=clock)
    rec, _ = make(mgmt_workers, autoscaler=scaler)
    pods = pods_for(mgmt_workers)
    order = rank("org/hot", [p.name for p in pods])
    model, result = await converge(rec, auto(), pods)
    status = result.status
    assert status["placement"] == order[:1] and status["desiredReplicas"] == status["currentReplicas"] == 1
    assert reason(status, "Autoscaling") == NO_DEMAND_DATA

    scaler.observe(model, 7.0)  # 3.5 per replica over a target of 2: 4 replicas
    model, result = await converge(rec, dataclasses.replace(model, status=status), pods)
    status = result.status
    assert status["placement"] == order[:4]  # the next pods of its HRW order
    assert status["desiredReplicas"] == status["currentReplicas"] == 4 and status["phase"] == st.READY
    assert reason(status, "Autoscaling") == SCALED_UP
    assert sum("org/hot" in w.loras for w in mgmt_workers) == 4

    clock.now += 10
    scaler.observe(model, 0.5)
    assert reason((await rec.reconcile(model, pods)).status, "Autoscaling") == COOLING_DOWN
    clock.now += 30
    scaler.observe(model, 0.5)
    shrunk = await rec.reconcile(model, pods)  # placement shrinks; leavers keep it until that is published
    assert shrunk.status["placement"] == order[:1] and shrunk.status["desiredReplicas"] == 1
    assert sum("org/hot" in w.loras for w in mgmt_workers) == 4
    model, result = await converge(rec, dataclasses.replace(model, status=shrunk.status), pods)
    assert sum("org/hot" in w.loras for w in mgmt_workers) == 1
    assert reason(result.status, "Autoscaling") == SCALED_DOWN and result.status["currentReplicas"] == 1


async def test_autoscaled_model_short_of_its_wish_but_at_min_is_not_degraded(mgmt_workers: list[MgmtWorker]) -> None:
    workers = mgmt_workers[:3]
    for w in workers:
        w.capacity = 0
    workers[0].capacity = workers[1].capacity = 1
    scaler = Autoscaler(cooldown=0.0)
    rec, _ = make(workers, autoscaler=scaler)
    model = auto(maxReplicas=3, target=1)
    scaler.observe(model, 10.0)
    _, result = await converge(rec, model, pods_for(workers))
    status = result.status
    assert status["desiredReplicas"] == 3 and status["currentReplicas"] == 2
    assert status["phase"] == st.READY and reason(status, "Degraded") == st.NOT_DEGRADED
    assert reason(status, "Autoscaling") == LIMITED_BY_CAPACITY
    assert result.requeue_after is not None  # looks again for room later
    assert all(len(w.loras) <= (w.capacity or 0) for w in workers)


async def test_fixed_replicas_status_has_no_autoscaling_fields(mgmt_workers: list[MgmtWorker]) -> None:
    rec, _ = make(mgmt_workers)
    _, result = await converge(rec, lora("org/fixed", replicas=2), pods_for(mgmt_workers))
    assert "desiredReplicas" not in {k for k, v in result.status.items() if v is not None}
    assert st.condition(result.status, "Autoscaling") is None


async def test_router_reports_in_flight_requests_per_adapter() -> None:
    """Requests held by a worker show as in flight on the router's GET /demand, then decay."""
    import asyncio

    import aiohttp
    from lorafleet_router.router import Router, RoutingTable

    release = asyncio.Event()
    arrived = 0

    async def complete(_: web.Request) -> web.Response:
        nonlocal arrived
        arrived += 1
        await release.wait()
        return web.json_response({"choices": [{"text": "ok"}]})

    worker_port, router_port = unused_port(), unused_port()
    worker = web.Application()
    worker.add_routes([web.post("/v1/completions", complete)])
    runners = [web.AppRunner(worker)]
    table = RoutingTable(inference_port=worker_port)
    table.on_pod("ADDED", {"metadata": {"namespace": "ns", "name": "w0", "uid": "u0", "labels": {}},
                           "status": {"phase": "Running", "podIP": "127.0.0.1",
                                      "conditions": [{"type": "ContainersReady", "status": "True"},
                                                     {"type": "Ready", "status": "True"}]}})  # fmt: skip
    body = {"metadata": {"namespace": "ns", "name": "hot", "uid": "m0"},
            "spec": {"modelName": "org/hot", "baseModelName": "b", "modelType": "lora", "source": {"uri": "s3://b/x"}},
            "status": {"phase": "Ready", "endpoints": [{"address": "http://127.0.0.1:9090", "podName": "w0",
                                                       "ready": True}]}}  # fmt: skip
    table.on_model("ADDED", body)
    clock = Clock()
    router = Router(table, demand=DemandTracker(window=10.0, clock=clock))
    runners.append(web.AppRunner(router.app()))
    for runner, port in zip(runners, (worker_port, router_port), strict=True):
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
    base = f"http://127.0.0.1:{router_port}"
    try:
        async with aiohttp.ClientSession() as http:
            request = {"model": "org/hot", "prompt": "hi", "max_tokens": 1}
            calls = [asyncio.create_task(http.post(f"{base}/v1/completions", json=request)) for _ in range(3)]
            for _ in range(500):
                if arrived == 3:
                    break
                await asyncio.sleep(0.01)
            async with http.get(f"{base}/demand") as r:
                (entry,) = (await r.json())["adapters"]
            assert (entry["namespace"], entry["name"], entry["modelName"]) == ("ns", "hot", "org/hot")
            assert (entry["inflight"], entry["queued"]) == (3, 0)
            clock.now += 20.0
            async with http.get(f"{base}/demand") as r:
                (entry,) = (await r.json())["adapters"]
            assert entry["concurrency"] == pytest.approx(3 * (1 - 2.718281828**-2), rel=1e-3)
            release.set()
            for response in await asyncio.gather(*calls):
                assert response.status == 200
                response.release()
            async with http.get(f"{base}/demand") as r:
                (entry,) = (await r.json())["adapters"]
            assert entry["inflight"] == 0 and entry["rate"] > 0
            metrics = await (await http.get(f"{base}/metrics")).text()
            samples = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line.startswith("lorafleet_router_"))
            assert float(samples['lorafleet_router_adapter_requests_total{adapter="org/hot"}']) >= 3, samples
            assert float(samples['lorafleet_router_adapter_inflight{adapter="org/hot"}']) == 0
    finally:
        for runner in runners:
            await runner.cleanup()


async def test_router_demand_reads_every_address_of_a_name() -> None:
    """A headless Service name resolves to every router pod: each one's URL is read."""
    many = RouterDemand(["http://localhost:8000/demand", "http://10.0.0.7:8000/demand"])
    targets = await many.targets()
    assert targets is not None and targets[-1] == "http://10.0.0.7:8000/demand"
    assert "http://127.0.0.1:8000/demand" in targets
    await many.close()


async def test_autoscaled_placement_steers_around_a_hot_pod_fixed_keeps_hrw(mgmt_workers: list[MgmtWorker]) -> None:
    """Balance on by default for autoscaled adapters: the routers' demand weighs what each pod holds,
    and a new replica skips a pod whose weighted load would pass the bound; a fixed-replica adapter
    (and ``balance="off"``) still takes its top HRW pods; with the demand gone (equal weights) and
    nothing above the bound, a placed adapter stays where it is."""
    workers = mgmt_workers[:4]
    pods = pods_for(workers)
    model = auto("org/steered", minReplicas=1, maxReplicas=1)
    top = rank(model.model_name, [p.name for p in pods])[0]
    hot = workers[[p.name for p in pods].index(top)]
    hot.loras["org/very-hot"] = "s3://bucket/hot"  # another adapter carrying nearly all the traffic
    for w in workers:
        w.loras[f"org/cold-{w.port}"] = "s3://bucket/cold"
    others = [(m.key, m) for m in (lora("org/very-hot"), *(lora(f"org/cold-{w.port}") for w in workers))]

    async def demand() -> dict[tuple[str, str], float]:
        return {("ns", "org-very-hot"): 20.0, ("ns", "org-steered"): 1.0}

    scaler = Autoscaler()
    await autoscale_pass(scaler, [(model.key, model), *others], demand, lambda _: None)
    assert scaler.weights(model.base_model_name) == pytest.approx(
        {"org/steered": 1.0, "org/very-hot": 20.0} | {f"org/cold-{w.port}": 0.0 for w in workers}
    )
    rec, _ = make(workers, autoscaler=scaler)
    _, result = await converge(rec, model, pods)
    placed = result.status["placement"]
    assert len(placed) == 1 and placed != [top]  # not on the pod that already carries 20 of 21
    assert "org/steered" not in hot.loras

    plain, _ = make(workers, autoscaler=scaler, balance="off")
    other = auto("org/steered-too", minReplicas=1, maxReplicas=1)
    other_top = rank(other.model_name, [p.name for p in pods])[0]
    _, result = await converge(plain, other, pods)
    assert result.status["placement"] == [other_top]  # off: its top HRW pod, whatever it carries
    fixed = lora("org/fixed-one", replicas=1)
    _, result = await converge(rec, fixed, pods)
    assert result.status["placement"] == rank(fixed.model_name, [p.name for p in pods])[:1]


def test_balance_settings_are_validated(mgmt_workers: list[MgmtWorker]) -> None:
    with pytest.raises(ValueError):
        make(mgmt_workers, balance="sometimes")
    with pytest.raises(ValueError):
        make(mgmt_workers, balance_epsilon=-1.0)


async def test_autoscale_pass_requeues_what_a_placement_left_above_the_bound() -> None:
    scaler = Autoscaler()
    shed, other = lora("org/shed-me"), lora("org/stays")
    scaler.place_again(shed.base_model_name, [shed.model_name])
    queued: list[tuple[str, str]] = []

    async def nothing() -> None:
        return None

    await autoscale_pass(scaler, [(shed.key, shed), (other.key, other)], nothing, queued.append)
    assert queued == [shed.key] and not scaler.take_revisits()  # once: the set is drained
    assert scaler.weights(shed.base_model_name) is None  # no poll answered: equal weights
    await autoscale_pass(scaler, [(shed.key, shed), (other.key, other)], nothing, queued.append)
    assert queued == [shed.key]
