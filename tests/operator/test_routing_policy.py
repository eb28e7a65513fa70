"""The router's policies: cache-aware prefix affinity per adapter within a load bound, fewest in flight
otherwise; and through the router, each conversation's turns reach the holder that served the first."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import unused_port
from lorafleet_router.policy import CacheAware, FewestInFlight, Route, make_policy, route_of
from lorafleet_router.router import Router, RoutingTable

SYSTEM = "You are a helpful assistant for tenant A. " * 10  # ~430 characters
PODS = ["http://a", "http://b", "http://c"]


def test_route_of_completions_and_chat() -> None:
    assert route_of({"model": "m", "prompt": "hello"}) == Route("m", "hello")
    assert route_of({"model": "m", "prompt": ["first", "second"]}) == Route("m", "first")
    assert route_of({"model": "m", "prompt": [1, 2, 3]}) == Route("m", "1 2 3")
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    policy = CacheAware(chunk_chars=16)
    names1 = policy.chunk_names(route_of({"model": "m", "messages": turn1}))
    names2 = policy.chunk_names(route_of({"model": "m", "messages": turn2}))
    assert len(names1) > 20 and names2[: len(names1)] == names1  # a later turn extends the earlier one


def test_a_prompt_goes_back_to_where_its_prefix_went_per_adapter() -> None:
    policy = CacheAware(chunk_chars=16)
    first = policy.choose(PODS, {}, Route("tenant-a", SYSTEM + "question one"))
    assert all(policy.choose(PODS, {}, Route("tenant-a", SYSTEM + f"question {i}")) == first for i in range(10))
    assert policy.affinity_hits == 10
    # the same text for another adapter matches nothing (its KV differs): fewest in flight decides
    loads = {p: 0 if p != first else 5 for p in PODS}
    assert policy.choose(PODS, loads, Route("tenant-b", SYSTEM)) != first
    assert policy.affinity_hits == 10


def test_the_load_bound_overrides_affinity_and_short_prompts_go_to_the_least_loaded() -> None:
    policy = CacheAware(chunk_chars=16, balance=1.25)
    home = policy.choose(PODS, {}, Route("m", SYSTEM))
    others = [p for p in PODS if p != home]
    fair = {home: 2, others[0]: 2, others[1]: 1}
    assert policy.choose(PODS, fair, Route("m", SYSTEM)) == home  # within the bound: affinity wins
    assert policy.choose(PODS, fair, Route("m", "hi")) == others[1]  # shorter than a chunk
    busy = {home: 4, others[0]: 1, others[1]: 1}  # 4 + 1 > ceil(1.25 * (6 + 1) / 3)
    assert policy.choose(PODS, busy, Route("m", SYSTEM)) in others


def test_little_overlap_and_forgotten_prefixes_fall_back_to_fewest_in_flight() -> None:
    policy = CacheAware(chunk_chars=16, max_chunks=30, min_match=0.5)
    home = policy.choose(PODS, {}, Route("m", SYSTEM))
    loads = {p: 0 if p != home else 1 for p in PODS}
    unrelated = "x" * 16 * 20
    assert policy.choose(PODS, loads, Route("m", SYSTEM[:32] + unrelated)) != home  # 2 of 22 chunks matched
    idle_home = {p: 0 if p == home else 5 for p in PODS}
    assert policy.choose(PODS, idle_home, Route("m", "z" * 16 * 40)) == home  # 40 new chunks: SYSTEM's forgotten
    assert policy.matched(home, policy.chunk_names(Route("m", SYSTEM))) == 0


def test_policy_names_and_knob_checks() -> None:
    assert isinstance(make_policy("fewest-in-flight"), FewestInFlight)
    assert isinstance(make_policy("cache-aware", balance=2.0), CacheAware)
    with pytest.raises(ValueError, match="unknown router policy"):
        make_policy("random")
    with pytest.raises(ValueError, match="balance"):
        CacheAware(balance=0.5)


def _pod(i: int) -> dict[str, Any]:
    return {"metadata": {"namespace": "ns", "name": f"w{i}", "uid": f"u{i}", "labels": {}},
            "status": {"phase": "Running", "podIP": f"127.0.0.{i + 1}",
                       "conditions": [{"type": "ContainersReady", "status": "True"},
                                      {"type": "Ready", "status": "True"}]}}  # fmt: skip


def _adapter(name: str) -> dict[str, Any]:
    endpoints = [{"address": f"http://127.0.0.{i + 1}:9090", "podName": f"w{i}", "ready": True} for i in range(3)]
    return {"metadata": {"namespace": "ns", "name": name, "uid": name},
            "spec": {"modelName": name, "baseModelName": "b", "modelType": "lora", "source": {"uri": "s3://b/x"}},
            "status": {"phase": "Ready", "endpoints": endpoints}}  # fmt: skip


async def test_through_the_router_every_turn_of_a_conversation_reaches_the_same_holder() -> None:
    port = unused_port()
    served: dict[str, list[str]] = {}  # adapter -> pods that served it, in order

    def handler(pod: str) -> Any:
        async def chat(request: web.Request) -> web.Response:
            served.setdefault((await request.json())["model"], []).append(pod)
            return web.json_response({"choices": [{"message": {"role": "assistant", "content": "ok"}}]})

        return chat

    runners = []
    for i in range(3):
        app = web.Application()
        app.add_routes([web.post("/v1/chat/completions", handler(f"w{i}"))])
        runners.append(web.AppRunner(app))
        await runners[-1].setup()
        await web.TCPSite(runners[-1], f"127.0.0.{i + 1}", port).start()
    table = RoutingTable(inference_port=port)
    for i in range(3):
        table.on_pod("ADDED", _pod(i))
    for name in ("tenant-a", "tenant-b"):
        table.on_model("ADDED", _adapter(name))
    router_port = unused_port()
    runners.append(web.AppRunner(Router(table).app()))
    await runners[-1].setup()
    await web.TCPSite(runners[-1], "127.0.0.1", router_port).start()
    try:
        async with aiohttp.ClientSession() as http:
            for name in ("tenant-a", "tenant-b"):
                messages = [{"role": "system", "content": f"{name}: {SYSTEM}"}]
                for turn in range(4):
                    messages.append({"role": "user", "content": f"question {turn}"})
                    body = {"model": name, "messages": messages}
                    async with http.post(f"http://127.0.0.1:{router_port}/v1/chat/completions", json=body) as r:
                        assert r.status == 200
                    messages.append({"role": "assistant", "content": "ok"})
        assert {name: len(set(pods)) for name, pods in served.items()} == {"tenant-a": 1, "tenant-b": 1}
        assert all(len(pods) == 4 for pods in served.values())
    finally:
        for runner in runners:
            await runner.cleanup()
    await asyncio.sleep(0)


def test_a_pod_that_goes_away_is_forgotten_by_the_policy() -> None:
    """Deleted, or back with a new IP: its successor at that address holds none of its prefixes."""
    policy = CacheAware(chunk_chars=16)
    table = RoutingTable(inference_port=9090)
    Router(table, policy=policy)
    for i in range(3):
        table.on_pod("ADDED", _pod(i))
    urls = [f"http://127.0.0.{i + 1}:9090" for i in range(3)]
    home = policy.choose(urls, {}, Route("m", SYSTEM))
    names = policy.chunk_names(Route("m", SYSTEM))
    table.on_pod("MODIFIED", _pod(int(home[-6]) - 1))  # same pod, same IP: remembered
    assert policy.matched(home, names) == len(names)
    i = int(home[-6]) - 1
    moved = _pod(i)
    moved["status"]["podIP"] = "127.0.0.9"
    table.on_pod("MODIFIED", moved)  # restarted with a new IP: the old address is gone
    assert policy.matched(home, names) == 0
    other = next(u for u in urls if u != home)
    policy.choose([other], {}, Route("m", SYSTEM))
    table.on_pod("DELETED", _pod(int(other[-6]) - 1))
    assert policy.matched(other, names) == 0
