"""Operator runtime (queue, pod index, reconcile, finalizer) and router against real workers.

No Kubernetes: DynamoModel and Pod bodies are fed to the same entry points the kopf handlers
call, and status patches are applied to the in-memory objects and fed back as watch events.
The workers are real ``lorafleet-worker serve`` processes with real PEFT adapters.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from lorafleet_operator import api
from lorafleet_operator.controller import Runtime
from lorafleet_operator.placement import place
from lorafleet_operator.reconcile import Reconciler
from lorafleet_operator.resources import Model
from lorafleet_operator.settings import OperatorSettings
from lorafleet_operator.workers import WorkerClient
from lorafleet_router import metrics
from lorafleet_router.router import Router, RoutingTable

from .conftest import INFER_PORT, MGMT_PORT, REAL_BASE, RealFleet, pod_body, requeue_every_model

pytestmark = pytest.mark.asyncio(loop_scope="module")
PROMPT = [1, 5, 9, 13, 17, 21]


async def eventually(check: Callable[[], Awaitable[bool] | bool], timeout: float = 120, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.1)


@dataclass
class Env:
    runtime: Runtime
    table: RoutingTable
    fleet: RealFleet
    router_url: str
    router: Router
    objects: dict[tuple[str, str], dict[str, Any]]
    http: aiohttp.ClientSession

    def apply(self, name: str, model_name: str, uri: str | None, model_type: str = "lora", **spec: Any) -> None:
        """Create or update a DynamoModel (bumps generation on spec change, like the API server)."""
        key = ("ns", name)
        new_spec = {"modelName": model_name, "baseModelName": REAL_BASE, "modelType": model_type, **spec}
        if uri:
            new_spec["source"] = {"uri": uri}
        old = self.objects.get(key)
        meta: dict[str, Any] = {"name": name, "namespace": "ns", "uid": f"uid-dm-{name}", "generation": 1}
        if old is not None:
            meta = dict(old["metadata"])
            if old["spec"] != new_spec:
                meta["generation"] += 1
        body = {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": meta, "spec": new_spec,
                "status": (old or {}).get("status", {})}  # fmt: skip
        self.objects[key] = body
        self.runtime.on_model("MODIFIED", body)
        self.table.on_model("MODIFIED", body)

    def status(self, name: str) -> dict[str, Any]:
        return self.objects[("ns", name)].get("status") or {}

    def phase(self, name: str) -> str | None:
        return self.status(name).get("phase")

    def holders(self, model_name: str) -> set[str]:
        return {w.name for w in self.fleet.workers if model_name in w.loras()}

    def set_pod(self, index: int, ready: bool) -> None:
        w = self.fleet.workers[index]
        body = pod_body(w.name, w.host, ready, REAL_BASE)
        self.runtime.on_pod("MODIFIED", body)
        self.table.on_pod("MODIFIED", body)

    async def complete(self, model: str, *, expect: int = 200, **kw: Any) -> dict[str, Any]:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **kw}
        async with self.http.post(f"{self.router_url}/v1/completions", json=body) as resp:
            data: dict[str, Any] = await resp.json()
            assert resp.status == expect, data
            return data

    async def text(self, model: str) -> str:
        return str((await self.complete(model))["choices"][0]["text"])


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def env(real_fleet: RealFleet) -> AsyncIterator[Env]:
    objects: dict[tuple[str, str], dict[str, Any]] = {}
    table = RoutingTable(inference_port=INFER_PORT)

    async def write_status(model: Model, patch: Mapping[str, Any]) -> dict[str, Any] | None:
        """The API server's /status merge patch, then the watch event it causes."""
        await asyncio.sleep(0)
        body = objects.get(model.key)
        if body is None:
            return None
        status = dict(body.get("status") or {})
        for k, v in patch.items():
            if v is None:
                status.pop(k, None)
            else:
                status[k] = v
        body = {**body, "status": json.loads(json.dumps(status))}
        objects[model.key] = body
        runtime.on_model("MODIFIED", body)
        table.on_model("MODIFIED", body)
        return body

    settings = OperatorSettings(
        default_replicas=2, reconcile_workers=3, drift_interval=3600, retry_base=0.2, retry_max=2
    )
    client = WorkerClient(load_timeout=60, call_timeout=10)
    reconciler = Reconciler(client, default_replicas=2, management_port=MGMT_PORT, listing_ttl=3600)
    runtime = Runtime(settings, reconciler, write_status)
    for w in real_fleet.workers:
        for sink in (runtime.on_pod, table.on_pod):
            sink("ADDED", w.pod_body())
    runtime.start()
    router = Router(table, timeout=60, unavailable_wait=3)
    runner = web.AppRunner(router.app())
    await runner.setup()
    host = real_fleet.addresses.take()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    port = runner.addresses[0][1]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        yield Env(runtime, table, real_fleet, f"http://{host}:{port}", router, objects, http)
    await runner.cleanup()
    await runtime.stop()


def uri(path: Path) -> str:
    return f"file://{path}"


async def test_models_reach_ready_and_route(env: Env) -> None:
    ads = env.fleet.adapters
    env.apply("base", REAL_BASE, None, model_type="base")
    env.apply("a", "org/adapter-a", uri(ads["a"]))
    env.apply("b", "org/adapter-b", uri(ads["b"]), replicas=3)
    await eventually(lambda: env.phase("a") == "Ready" and env.phase("b") == "Ready", what="a and b Ready")
    pods = [w.name for w in env.fleet.workers]
    assert env.status("a")["placement"] == place("org/adapter-a", pods, 2)
    assert env.holders("org/adapter-a") == set(place("org/adapter-a", pods, 2))
    assert env.holders("org/adapter-b") == set(pods)
    assert env.status("a")["readyEndpoints"] == 2 and env.status("b")["totalEndpoints"] == 3
    assert env.phase("base") == "Ready" and env.status("base")["readyEndpoints"] == 3

    base, a, b = await env.text(REAL_BASE), await env.text("org/adapter-a"), await env.text("org/adapter-b")
    assert len({base, a, b}) == 3, (base, a, b)
    assert await env.text("org/adapter-a") == a  # deterministic, whichever holder answered

    async with env.http.get(f"{env.router_url}/v1/models") as resp:
        listed = {m["id"]: m.get("parent") for m in (await resp.json())["data"]}
    assert listed == {REAL_BASE: None, "org/adapter-a": REAL_BASE, "org/adapter-b": REAL_BASE}

    missing = await env.complete("org/nope", expect=404)
    assert missing["error"]["code"] == "model_not_found" and "org/nope" in missing["error"]["message"]


async def test_streaming_passes_through(env: Env) -> None:
    body = {"model": "org/adapter-a", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    chunks: list[str] = []
    async with env.http.post(f"{env.router_url}/v1/completions", json=body) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        async for line in resp.content:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                chunks.append(json.loads(line[6:])["choices"][0]["text"])
    assert len(chunks) >= 2
    assert "".join(chunks) == await env.text("org/adapter-a")


async def test_invalid_adapter_fails_while_others_serve(env: Env) -> None:
    env.apply("bad", "org/bad", uri(env.fleet.adapters["bad"]))
    await eventually(lambda: env.phase("bad") == "Failed", what="bad Failed")
    ready = next(c for c in env.status("bad")["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "AdapterInvalid" and "rank" in ready["message"].lower(), ready
    assert env.holders("org/bad") == set()
    assert env.phase("a") == "Ready" and await env.text("org/adapter-a")
    await env.complete("org/bad", expect=503)  # known but not served anywhere


async def test_pod_unready_replaces_then_returns(env: Env) -> None:
    pods = [w.name for w in env.fleet.workers]
    first = place("org/adapter-a", pods, 2)[0]
    index = pods.index(first)
    env.set_pod(index, ready=False)
    others = [p for p in pods if p != first]
    await eventually(lambda: env.status("a").get("placement") == place("org/adapter-a", others, 2)
                     and env.phase("a") == "Ready", what="re-placed without the unready pod")  # fmt: skip
    assert env.holders("org/adapter-a") >= set(others)
    env.set_pod(index, ready=True)
    want = place("org/adapter-a", pods, 2)
    await eventually(lambda: env.status("a").get("placement") == want and env.holders("org/adapter-a") == set(want),
                     what="back on the HRW placement, leaver unloaded")  # fmt: skip


async def test_drift_lost_adapter_is_repaired(env: Env) -> None:
    victim = env.fleet.workers[[w.name for w in env.fleet.workers].index(env.status("a")["placement"][0])]
    async with env.http.delete(f"{victim.mgmt}/v1/loras/org/adapter-a") as resp:
        assert resp.status == 200
    assert "org/adapter-a" not in victim.loras()
    env.runtime.inventory.invalidate_listings()  # the drift timer's job
    requeue_every_model(env.runtime)
    await eventually(lambda: "org/adapter-a" in victim.loras(), what="drift repaired")


async def test_hot_swap_changes_answers(env: Env) -> None:
    before = await env.text("org/adapter-a")
    b_text = await env.text("org/adapter-b")
    env.apply("a", "org/adapter-a", uri(env.fleet.adapters["b"]))
    await eventually(lambda: env.status("a").get("observedGeneration") == 2 and env.phase("a") == "Ready",
                     what="swapped")  # fmt: skip
    after = await env.text("org/adapter-a")
    assert after != before and after == b_text


async def test_router_retries_a_dead_endpoint(env: Env) -> None:
    """An endpoint that refuses connections (pod gone, status not yet updated) costs a retry, not an error."""
    dead = {"address": f"http://{env.fleet.addresses.take()}:{MGMT_PORT}", "podName": "worker-gone", "ready": True}
    body = dict(env.objects[("ns", "b")])
    body["status"] = {**body["status"], "endpoints": [dead, *body["status"]["endpoints"]]}
    env.table.on_model("MODIFIED", body)  # the router's view only
    model = env.table.adapter("org/adapter-b")
    assert model is not None
    alive = env.table.adapter_endpoints(model)[1:]
    for endpoint in alive:  # the dead endpoint has the fewest in-flight requests: always tried first
        env.router.inflight[endpoint] += 1
    retries = metrics.ROUTER_RETRIES._value.get()
    try:
        texts = {await env.text("org/adapter-b") for _ in range(4)}
    finally:
        for endpoint in alive:
            env.router.inflight[endpoint] -= 1
        env.table.on_model("MODIFIED", env.objects[("ns", "b")])
    assert len(texts) == 1
    assert metrics.ROUTER_RETRIES._value.get() == retries + 4


async def test_router_waits_for_a_re_placed_adapter(env: Env) -> None:
    """All holders gone at once (e.g. scale-down): a request for an adapter not in the workers'
    catalogues (no served version) waits for the new holders instead of failing; a catalogued one
    goes to its rendezvous pod at once."""
    body = env.objects[("ns", "b")]
    status = {k: v for k, v in body["status"].items() if k != "servedUri"}
    env.table.on_model("MODIFIED", {**body, "status": {**status, "endpoints": []}})
    asyncio.get_running_loop().call_later(1.0, env.table.on_model, "MODIFIED", body)
    started = time.monotonic()
    assert await env.text("org/adapter-b")
    assert time.monotonic() - started >= 0.9
    env.table.on_model("MODIFIED", {**body, "status": {**body["status"], "endpoints": []}})
    try:  # still no endpoint (a wait would end in a 503 after --router-unavailable-wait): the rendezvous pod
        assert await env.text("org/adapter-b")
    finally:
        env.table.on_model("MODIFIED", body)


async def test_least_inflight_spreads_concurrent_requests(env: Env) -> None:
    seen: list[str] = []
    router = Router(env.table)
    model = env.table.adapter("org/adapter-b")
    assert model is not None
    for _ in range(6):
        endpoint = router.choose(env.table.adapter_endpoints(model), set())
        assert endpoint is not None
        router.inflight[endpoint] += 1
        seen.append(endpoint)
    assert {seen.count(e) for e in set(seen)} == {2} and len(set(seen)) == 3


class Traffic:
    """Back-to-back requests for one adapter through the router while changes happen; counts failures."""

    def __init__(self, env: Env, model: str) -> None:
        self.env, self.model = env, model
        self.ok, self.failures, self.step = 0, [], "start"  # type: ignore[var-annotated]
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        body = {"model": self.model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
        while True:
            try:
                async with self.env.http.post(f"{self.env.router_url}/v1/completions", json=body) as resp:
                    text = await resp.text()
                    if resp.status == 200:
                        self.ok += 1
                    else:
                        self.failures.append(f"{self.step}: {resp.status} {text[:200]}")
            except aiohttp.ClientError as e:
                self.failures.append(f"{self.step}: {e!r}")

    async def __aenter__(self) -> Traffic:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def test_continuous_traffic_through_every_change_never_fails(env: Env) -> None:
    """Make-before-break: scale-up, replicas change, hot swap, pod restart, scale-down; zero failed requests.

    The router waits for no holder here (``unavailable_wait`` 0): a moment without a ready holder in
    the published status would fail a request at once."""
    name, ads = "org/mbb", env.fleet.adapters
    pods = [w.name for w in env.fleet.workers]
    best = place(name, pods, 3)
    env.router.unavailable_wait, env.runtime.reconciler.unload_grace = 0, 0.5
    first = pods.index(best[0])
    env.set_pod(first, ready=False)  # the adapter's best pod is not there yet
    env.apply("mbb", name, uri(ads["a"]), replicas=1)
    await eventually(lambda: env.phase("mbb") == "Ready", what="mbb Ready")
    assert env.holders(name) == {best[1]}

    def settled(want: set[str]) -> bool:
        return env.phase("mbb") == "Ready" and env.holders(name) == want == set(env.status("mbb")["placement"])

    async with Traffic(env, name) as traffic:
        traffic.step = "scale-up"
        env.set_pod(first, ready=True)  # scale-up: the only replica moves to the new pod
        await eventually(lambda: settled({best[0]}), what="moved to the new pod")
        traffic.step = "replicas 2"
        env.apply("mbb", name, uri(ads["a"]), replicas=2)
        await eventually(lambda: settled(set(best[:2])), what="replicas 2")
        traffic.step = "hot swap"
        env.apply("mbb", name, uri(ads["b"]), replicas=2)  # hot swap
        await eventually(lambda: env.status("mbb").get("servedUri") == uri(ads["b"]) and settled(set(best[:2])),
                         what="swapped")  # fmt: skip
        # a holder restarts: gone from the router, back empty under a new uid
        traffic.step = "restart"
        body = env.fleet.workers[first].pod_body()
        env.runtime.on_pod("MODIFIED", {**body, "status": {**body["status"], "conditions": []}})
        env.table.on_pod("MODIFIED", {**body, "status": {**body["status"], "conditions": []}})
        async with env.http.delete(f"{env.fleet.workers[first].mgmt}/v1/loras/{name}") as resp:
            assert resp.status == 200
        await eventually(lambda: settled({best[1], best[2]}), what="re-placed around the restarting pod")
        restarted = {**body, "metadata": {**body["metadata"], "uid": "uid-restarted"}}
        env.runtime.on_pod("MODIFIED", restarted)
        env.table.on_pod("MODIFIED", restarted)
        await eventually(lambda: settled(set(best[:2])), what="back on the restarted pod")
        traffic.step = "replicas 1"
        env.apply("mbb", name, uri(ads["b"]), replicas=1)  # replicas down
        await eventually(lambda: settled({best[0]}), what="replicas 1")
        # scale-down: the holder's pod terminates (serving through its grace period), then is gone
        traffic.step = "scale-down"
        body = env.fleet.workers[first].pod_body()
        terminating = {**body, "metadata": {**body["metadata"], "deletionTimestamp": "2026-01-01T00:00:00Z"}}
        for sink in (env.runtime.on_pod, env.table.on_pod):
            sink("MODIFIED", terminating)
        moved = {"placement": [best[1]], "totalEndpoints": 1, "readyEndpoints": 1, "phase": "Ready"}
        await eventually(lambda: all(env.status("mbb").get(k) == v for k, v in moved.items())
                         and best[1] in env.holders(name), what="moved off the terminating pod")  # fmt: skip
        for sink in (env.runtime.on_pod, env.table.on_pod):
            sink("DELETED", terminating)
    assert traffic.ok > 0
    assert not traffic.failures, traffic.failures[:5]
    for sink in (env.runtime.on_pod, env.table.on_pod):
        sink("ADDED", env.fleet.workers[first].pod_body())
    env.router.unavailable_wait = 3


async def test_delete_unloads_everywhere(env: Env) -> None:
    body = env.objects.pop(("ns", "b"))
    unloaded = await env.runtime.finalize(body)
    assert sorted(unloaded) == sorted(w.name for w in env.fleet.workers)
    assert env.holders("org/adapter-b") == set()
    env.table.on_model("DELETED", body)
    await env.complete("org/adapter-b", expect=404)


async def test_metrics_record_reconciles_calls_and_churn(env: Env) -> None:
    from prometheus_client import REGISTRY

    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    assert sample("lorafleet_operator_reconciles_total", result="ok") > 0
    assert sample("lorafleet_operator_worker_calls_total", op="load", outcome="success") >= 5
    assert sample("lorafleet_operator_worker_calls_total", op="load", outcome="400") >= 1
    assert sample("lorafleet_operator_worker_calls_total", op="unload", outcome="success") >= 3
    assert sample("lorafleet_operator_worker_call_seconds_count", op="load") > 0
    assert sample("lorafleet_operator_placement_changes_total", change="added") >= 1
    assert sample("lorafleet_operator_models", phase="Ready") >= 1
    assert sample("lorafleet_router_requests_total", kind="adapter", code="200") > 0
    assert sample("lorafleet_router_requests_total", kind="unknown", code="404") >= 1


async def test_scale_to_zero_and_back_on_demand_through_the_router(env: Env) -> None:
    """minReplicas 0 against real workers: at zero no worker holds the adapter; the catalogue the
    operator pushed lets the router's rendezvous pod load it on demand for the first request (the
    same answer as the same weights under another name), and scaling back up pins it there."""
    import httpx
    from lorafleet_operator.placement import rank

    weights = env.status("a")["servedUri"]  # org/zero: the same weights as org/adapter-a, under another name
    env.apply("z", "org/zero", weights,
              autoscaling={"minReplicas": 0, "maxReplicas": 2, "target": 1, "scaleToZeroAfter": 0})  # fmt: skip
    await eventually(lambda: env.phase("z") == "Ready", what="z loaded once")
    pods = [w.name for w in env.fleet.workers]
    await eventually(
        lambda: all(
            ["org/zero", weights] in [[e["lora_name"], e["source"]["uri"]] for e in
            httpx.get(f"{w.mgmt}/v1/loras/catalog", timeout=10).json()["adapters"]]
            for w in env.fleet.workers
        ),
        what="org/zero in every worker's catalogue",
    )  # fmt: skip
    key = ("ns", "z")
    scaler = env.runtime.reconciler.autoscaler
    model = env.runtime.index.get(key)
    assert model is not None and scaler.observe(model, 0.0)  # no demand, scaleToZeroAfter 0
    env.runtime.queue.add(key)
    await eventually(lambda: env.phase("z") == "ScaledToZero", what="z at zero")
    await eventually(lambda: env.holders("org/zero") == set(), what="every copy unloaded")

    expected = await env.text("org/adapter-a")
    assert await env.text("org/zero") == expected  # loaded on demand, by the rendezvous pod
    rendezvous = rank("org/zero", pods)[0]
    assert env.holders("org/zero") == {rendezvous}
    (worker,) = [w for w in env.fleet.workers if w.name == rendezvous]
    assert httpx.get(f"{worker.mgmt}/v1/loras", timeout=10).json()["pinned"]["org/zero"] is False

    model = env.runtime.index.get(key)
    assert model is not None and scaler.observe(model, 0.5)  # the request's demand: back to one replica
    env.runtime.queue.add(key)
    await eventually(lambda: env.phase("z") == "Ready", what="z back")
    assert env.status("z")["placement"] == [rendezvous] and env.holders("org/zero") == {rendezvous}
    assert httpx.get(f"{worker.mgmt}/v1/loras", timeout=10).json()["pinned"]["org/zero"] is True
    assert await env.text("org/zero") == expected
