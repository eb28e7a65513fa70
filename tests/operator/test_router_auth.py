"""The router's API key (vLLM's `--api-key`) and its answer to a worker's 404:
- with a key, `/v1/*` without `Authorization: Bearer <key>` (or with a wrong one) gets OpenAI's 401 shape, the
  `openai` client with the key gets its answer, and health, readiness, metrics and demand stay open;
- towards the workers the router sends `--worker-api-key` (default: its own key) in place of the client's
  header; with no key at all the client's header passes through;
- a worker's 404 for a path it does not serve comes back at once, while its "model not found" 404 (the pod
  does not hold the adapter yet) is tried again;
- with a real worker that has its own key ($LORAFLEET_API_KEY), the `openai` client with the router's key gets
  its answer through the router, while neither key opens the other's door.

Real HTTP on 127.0.0.x: the router's own `serve` (what `lorafleet-router` runs) in front of a stub worker, and
in front of a real worker process.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
import openai
import pytest
from aiohttp import web
from lorafleet_devcluster.nodeagent import AddressBlock
from lorafleet_router.router import Router, RoutingTable, serve
from lorafleet_router.settings import RouterSettings

from .conftest import INFER_PORT, MGMT_PORT, REAL_BASE, RealWorker, pod_body

ADAPTER = "org/auth"
KEY, WORKER_KEY = "router-key-0123456789", "worker-key-9876543210"
PORT = 8080
UNAVAILABLE_WAIT = 20.0
SEEN = web.AppKey("seen", list)  # (path, Authorization header, prompt) of every request the stub got


def _completion(prompt: str) -> dict[str, Any]:
    return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": ADAPTER,
            "choices": [{"index": 0, "text": f" {prompt}", "finish_reason": "length", "logprobs": None}]}  # fmt: skip


async def _stub(request: web.Request) -> web.Response:
    """A holder of ADAPTER: `/v1/completions` answers; its first "loading" request gets the worker's
    model-not-found 404 (it does not hold the adapter yet); any other path gets FastAPI's 404."""
    body = await request.json()
    seen = request.app[SEEN]
    seen.append((request.path, request.headers.get("Authorization"), body.get("prompt")))
    if request.path != "/v1/completions":
        error = {"message": "Not Found", "type": "invalid_request_error", "param": None, "code": None}
        return web.json_response({"error": error}, status=404)
    if body.get("prompt") == "loading" and sum(s[2] == "loading" for s in seen) == 1:
        error = {"message": f"The model `{ADAPTER}` does not exist.", "type": "invalid_request_error",
                 "param": "model", "code": "model_not_found"}  # fmt: skip
        return web.json_response({"error": error}, status=404)
    return web.json_response(_completion(str(body.get("prompt"))))


@dataclass
class Front:
    url: str
    seen: list[tuple[str, str | None, str | None]] = field(default_factory=list)


@asynccontextmanager
async def front(
    api_key: str | None = None, worker_api_key: str | None = None, real: RealWorker | None = None
) -> AsyncIterator[Front]:
    """The router's `serve` in front of a stub worker, or of `real` (a worker process holding the base model)."""
    block = AddressBlock()
    worker, host = block.take(), block.take()
    if real is not None:
        worker = real.host
    stub = web.Application()
    stub[SEEN] = []
    stub.router.add_post("/v1/{tail:.*}", _stub)
    runner = web.AppRunner(stub)
    await runner.setup()
    if real is None:
        await web.TCPSite(runner, worker, INFER_PORT).start()
    table = RoutingTable(inference_port=INFER_PORT)
    table.on_pod("ADDED", pod_body("worker-0", worker, True, REAL_BASE))
    table.on_model("ADDED", {
        "metadata": {"name": "auth", "namespace": "ns", "uid": "uid-auth", "generation": 1},
        "spec": {"modelName": ADAPTER, "baseModelName": REAL_BASE, "modelType": "lora"},
        "status": {"phase": "Ready", "endpoints": [
            {"address": f"http://{worker}:{MGMT_PORT}", "podName": "worker-0", "ready": True}]},
    })  # fmt: skip
    router = Router(table, timeout=60, unavailable_wait=UNAVAILABLE_WAIT, api_key=api_key,
                    worker_api_key=worker_api_key)  # fmt: skip
    stop = asyncio.Event()
    serving = asyncio.create_task(serve(router, host, PORT, stop, 0.0, 5.0))
    url = f"http://{host}:{PORT}"
    try:
        for _ in range(200):
            if await _get(url, "/health") == 200:
                break
            await asyncio.sleep(0.05)
        yield Front(url, stub[SEEN])
    finally:
        stop.set()
        await serving
        await runner.cleanup()
        block.close()


async def _get(url: str, path: str) -> int | None:
    try:
        async with aiohttp.ClientSession() as http, http.get(url + path) as r:
            return r.status
    except aiohttp.ClientConnectionError:
        return None


async def _post(url: str, path: str, body: dict[str, Any], token: str | None = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with aiohttp.ClientSession() as http, http.post(url + path, json=body, headers=headers) as r:
        return r.status, await r.json(content_type=None)


def _request(prompt: str = "hi") -> dict[str, Any]:
    return {"model": ADAPTER, "prompt": prompt, "max_tokens": 2}


def _client(url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)


async def test_a_router_with_a_key_refuses_v1_without_it_in_openais_shape() -> None:
    async with front(api_key=KEY) as f:
        for token, code in ((None, None), ("wrong", "invalid_api_key")):
            status, body = await _post(f.url, "/v1/completions", _request(), token)
            assert status == 401
            assert set(body["error"]) == {"message", "type", "param", "code"}
            assert body["error"]["code"] == code and body["error"]["type"] == "invalid_request_error"
            assert "wrong" not in body["error"]["message"]
        assert await _get(f.url, "/v1/models") == 401
        for path in ("/health", "/ready", "/metrics", "/demand"):
            assert await _get(f.url, path) == 200, path
        assert f.seen == []  # nothing refused reached a worker
        async with _client(f.url, "wrong") as bad:
            with pytest.raises(openai.AuthenticationError):
                await bad.completions.create(model=ADAPTER, prompt="hi", max_tokens=2)
        async with _client(f.url, KEY) as good:
            out = await good.completions.create(model=ADAPTER, prompt="hi", max_tokens=2)
            assert out.choices[0].text == " hi"
            assert ADAPTER in {m.id async for m in good.models.list()}
        assert [auth for _, auth, _ in f.seen] == [f"Bearer {KEY}"]  # by default the workers get the same key


async def test_the_worker_key_replaces_the_clients_and_no_key_passes_it_through() -> None:
    async with front(api_key=KEY, worker_api_key=WORKER_KEY) as f:
        assert (await _post(f.url, "/v1/completions", _request(), KEY))[0] == 200
        assert [auth for _, auth, _ in f.seen] == [f"Bearer {WORKER_KEY}"]
    async with front() as f:
        assert (await _post(f.url, "/v1/completions", _request(), "client-own")) == (200, _completion("hi"))
        assert (await _post(f.url, "/v1/completions", _request()))[0] == 200
        assert [auth for _, auth, _ in f.seen] == ["Bearer client-own", None]


async def test_a_path_the_worker_does_not_serve_is_a_404_at_once() -> None:
    async with front() as f:
        t0 = time.monotonic()
        status, body = await _post(f.url, "/v1/responses", {"model": ADAPTER, "input": "hi"})
        assert status == 404 and body["error"]["message"] == "Not Found"
        assert time.monotonic() - t0 < UNAVAILABLE_WAIT / 4
        assert [path for path, _, _ in f.seen] == ["/v1/responses"]  # asked once, not retried


async def test_a_holder_without_the_adapter_yet_is_asked_again() -> None:
    async with front() as f:
        assert await _post(f.url, "/v1/completions", _request("loading")) == (200, _completion("loading"))
        assert [prompt for _, _, prompt in f.seen] == ["loading", "loading"]


def test_router_settings_read_the_key_from_lorafleet_or_vllm_variables_and_never_show_it() -> None:
    assert RouterSettings.from_sources({"VLLM_API_KEY": "v"}).upstream_key() == "v"
    both = RouterSettings.from_sources({"VLLM_API_KEY": "v", "LORAFLEET_API_KEY": "l"})
    assert both.api_key == "l" and both.upstream_key() == "l"
    own = RouterSettings.from_sources({"LORAFLEET_API_KEY": "l", "LORAFLEET_WORKER_API_KEY": "w"})
    assert own.upstream_key() == "w" and "'l'" not in repr(own) and "'w'" not in repr(own)
    assert RouterSettings.from_sources({}).upstream_key() is None


@pytest.fixture(scope="module")
def keyed_worker(tiny_models: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealWorker]:
    """A real worker serving the base model with its own key, given as $LORAFLEET_API_KEY."""
    root = tmp_path_factory.mktemp("router_auth")
    (root / "w").mkdir()
    block = AddressBlock()
    worker = RealWorker("worker-0", block.take(), tiny_models["llama"], root, root / "w")
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("LORAFLEET_API_KEY", WORKER_KEY)
            worker.spawn()
        worker.wait_ready()
        yield worker
    finally:
        worker.stop()
        block.close()


async def test_the_router_sends_its_worker_key_to_a_real_worker(keyed_worker: RealWorker) -> None:
    body = {"model": REAL_BASE, "prompt": "Hello", "max_tokens": 2}
    direct = {key: httpx.post(f"{keyed_worker.url}/v1/completions", json=body, timeout=60,
                              headers={"Authorization": f"Bearer {key}"}).status_code
              for key in (KEY, WORKER_KEY)}  # fmt: skip
    assert direct == {KEY: 401, WORKER_KEY: 200}, "the worker takes only its own key"
    async with front(api_key=KEY, worker_api_key=WORKER_KEY, real=keyed_worker) as f:
        async with _client(f.url, KEY) as client:
            out = await client.completions.create(
                model=REAL_BASE, prompt="Hello", max_tokens=2, extra_body={"ignore_eos": True}
            )
            assert out.usage is not None and out.usage.completion_tokens == 2
        async with _client(f.url, WORKER_KEY) as client:
            with pytest.raises(openai.AuthenticationError):
                await client.completions.create(model=REAL_BASE, prompt="Hello", max_tokens=2)
