"""The vLLM sidecar's management API against a fake vLLM server that answers vLLM's adapter endpoints as vLLM
does (its status codes and messages): load, idempotence, hot swap, unload, capacity, bad adapters, vLLM down,
a restarted vLLM or sidecar, the admin token."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from lorafleet_sidecar.adapters import VllmAdapters
from lorafleet_sidecar.app import build_app
from lorafleet_sidecar.vllm import VllmClient
from lorafleet_sync.ids import lora_id
from lorafleet_sync.sources import AdapterSources

BASE = "base-model"
MAX_RANK = 16


@dataclass
class FakeVllm:
    """vLLM's OpenAI server as far as adapters go (vllm/entrypoints/openai/models/serving.py)."""

    loras: dict[str, str] = field(default_factory=dict)  # name -> lora_path
    calls: list[dict[str, Any]] = field(default_factory=list)  # every load/unload body
    up: bool = True

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)
        return app

    @staticmethod
    def error(status: int, message: str, kind: str) -> web.Response:
        return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(status=200 if self.up else 503)

    async def models(self, _: web.Request) -> web.Response:
        data = [{"id": BASE, "object": "model", "root": "/models/base", "parent": None}]
        data += [{"id": n, "object": "model", "root": p, "parent": BASE} for n, p in self.loras.items()]
        return web.json_response({"object": "list", "data": data})

    async def load(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append({"op": "load", **body})
        name, path = body["lora_name"], body["lora_path"]
        if name == BASE:
            return self.error(400, f"The lora adapter '{name}' conflicts with a served base model.", "BadRequest")
        if not body.get("load_inplace") and name in self.loras:
            return self.error(400, f"The lora adapter '{name}' has already been loaded.", "BadRequest")
        config = Path(path) / "adapter_config.json"
        if not config.is_file():
            return self.error(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError")
        rank = json.loads(config.read_text())["r"]
        if rank > MAX_RANK:
            message = f"LoRA rank {rank} is greater than max_lora_rank {MAX_RANK}."
            return self.error(500, message, "InternalServerError")
        self.loras[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append({"op": "unload", **body})
        if body["lora_name"] not in self.loras:
            return self.error(404, f"The lora adapter '{body['lora_name']}' cannot be found.", "NotFoundError")
        del self.loras[body["lora_name"]]
        return web.Response(text="Success")


def make_adapter(root: Path, name: str, rank: int = 8) -> str:
    """A directory the adapter sources accept (config + weights file); its file:// URI."""
    path = root / name
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 16, "peft_type": "LORA"}))
    (path / "adapter_model.safetensors").write_bytes(b"\0" * 16)
    return f"file://{path}"


@dataclass
class Pod:
    vllm: FakeVllm
    server: TestServer
    client: TestClient
    adapters: VllmAdapters
    root: Path

    async def call(self, method: str, path: str, **kw: Any) -> tuple[int, dict[str, Any]]:
        resp = await self.client.request(method, path, **kw)
        return resp.status, await resp.json()


async def start_pod(
    tmp_path: Path, vllm: FakeVllm, *, capacity: int | None = None, token: str | None = None, cache: str = "cache"
) -> Pod:
    """A fake vLLM and a sidecar in front of it, with file:// adapters under tmp_path/adapters."""
    server = TestServer(vllm.app())
    await server.start_server()
    sources = AdapterSources(cache_dir=tmp_path / cache, file_roots=[tmp_path / "adapters"])
    adapters = VllmAdapters(VllmClient(str(server.make_url("")), timeout_s=5), sources, capacity=capacity)
    client = TestClient(TestServer(build_app(adapters, admin_token=token)))
    await client.start_server()
    return Pod(vllm, server, client, adapters, tmp_path / "adapters")


@pytest.fixture
async def pod(tmp_path: Path) -> AsyncIterator[Pod]:
    (tmp_path / "adapters").mkdir()
    p = await start_pod(tmp_path, FakeVllm(), capacity=2)
    yield p
    await p.client.close()
    await p.adapters.vllm.close()
    await p.server.close()


def load_body(name: str, uri: str) -> dict[str, Any]:
    return {"json": {"lora_name": name, "source": {"uri": uri}}}


async def test_load_list_unload(pod: Pod) -> None:
    uri = make_adapter(pod.root, "a")
    status, body = await pod.call("POST", "/v1/loras", **load_body("org/a", uri))
    assert status == 200, body
    assert body == {
        "status": "success",
        "message": "LoRA adapter 'org/a' loaded successfully",
        "lora_name": "org/a",
        "lora_id": lora_id("org/a"),
    }
    assert pod.vllm.loras == {"org/a": str(pod.root / "a")}
    assert pod.vllm.calls[-1]["load_inplace"] is False
    status, body = await pod.call("GET", "/v1/loras")
    assert (status, body["loras"], body["count"]) == (200, {"org/a": lora_id("org/a")}, 1)
    assert body["capacity"] == 2 and body["pinned"] == {"org/a": True}

    status, body = await pod.call("DELETE", "/v1/loras/org/a")
    assert (status, body["message"]) == (200, "LoRA adapter 'org/a' unloaded successfully")
    assert pod.vllm.loras == {}
    status, body = await pod.call("DELETE", "/v1/loras/org/a")
    assert (status, body["status"]) == (404, "error") and "not loaded" in body["message"]


async def test_same_uri_is_idempotent_and_another_is_a_hot_swap_in_place(pod: Pod) -> None:
    v1, v2 = make_adapter(pod.root, "v1"), make_adapter(pod.root, "v2")
    assert (await pod.call("POST", "/v1/loras", **load_body("a", v1)))[0] == 200
    status, body = await pod.call("POST", "/v1/loras", **load_body("a", v1))
    assert (status, body["message"]) == (200, "LoRA adapter 'a' already loaded")
    assert [c["op"] for c in pod.vllm.calls] == ["load"]

    status, body = await pod.call("POST", "/v1/loras", **load_body("a", v2))
    assert (status, body["message"]) == (200, "LoRA adapter 'a' swapped successfully")
    assert pod.vllm.calls[-1] == {
        "op": "load",
        "lora_name": "a",
        "lora_path": str(pod.root / "v2"),
        "load_inplace": True,
    }
    assert pod.vllm.loras == {"a": str(pod.root / "v2")}


async def test_capacity_is_reported_and_enforced(pod: Pod) -> None:
    uris = [make_adapter(pod.root, n) for n in ("a", "b", "c")]
    for name, uri in zip("ab", uris, strict=False):
        assert (await pod.call("POST", "/v1/loras", **load_body(name, uri)))[0] == 200
    status, body = await pod.call("POST", "/v1/loras", **load_body("c", uris[2]))
    assert status == 507 and "capacity" in body["message"]
    assert "c" not in pod.vllm.loras
    # a swap of a held adapter takes no new place
    assert (await pod.call("POST", "/v1/loras", **load_body("a", uris[2])))[0] == 200


async def test_bad_adapters_are_400_with_the_reason(pod: Pod) -> None:
    status, body = await pod.call("POST", "/v1/loras", **load_body("big", make_adapter(pod.root, "big", rank=64)))
    assert status == 400 and "greater than max_lora_rank" in body["message"], body
    status, body = await pod.call("POST", "/v1/loras", **load_body("x", f"file://{pod.root}/nowhere"))
    assert status == 400 and "no such directory" in body["message"], body
    status, body = await pod.call("POST", "/v1/loras", **load_body(BASE, make_adapter(pod.root, "b")))
    assert status == 400 and "conflicts with a served base model" in body["message"], body
    status, body = await pod.call("POST", "/v1/loras", **load_body("../x", make_adapter(pod.root, "c")))
    assert status == 400 and "invalid lora_name" in body["message"]
    status, body = await pod.call("POST", "/v1/loras", json={"lora_name": "a"})
    assert status == 400 and "source" in body["message"]
    assert pod.vllm.loras == {} and (await pod.call("GET", "/v1/loras"))[1]["count"] == 0


async def test_vllm_down_is_a_clear_503_and_not_ready(pod: Pod) -> None:
    uri = make_adapter(pod.root, "a")
    assert (await pod.call("GET", "/ready"))[0] == 200
    await pod.server.close()
    status, body = await pod.call("POST", "/v1/loras", **load_body("a", uri))
    assert status == 503 and "not reachable" in body["message"] and pod.adapters.vllm.url in body["message"]
    assert (await pod.call("GET", "/v1/loras"))[0] == 503
    status, body = await pod.call("GET", "/ready")
    assert status == 503 and "not healthy" in body["message"]
    assert (await pod.call("GET", "/health"))[0] == 200  # the sidecar lives; vLLM's own probe restarts vLLM
    metrics = await (await pod.client.get("/metrics")).text()
    assert "lorafleet_sidecar_vllm_up 0.0" in metrics
    assert 'lorafleet_sidecar_lora_loads_total{outcome="error"} 1.0' in metrics


async def test_a_restarted_vllm_lists_nothing_and_a_restarted_sidecar_adopts(pod: Pod, tmp_path: Path) -> None:
    uri = make_adapter(pod.root, "a")
    assert (await pod.call("POST", "/v1/loras", **load_body("a", uri)))[0] == 200
    pod.vllm.loras.clear()  # vLLM restarted: it holds nothing
    assert (await pod.call("GET", "/v1/loras"))[1]["loras"] == {}
    assert (await pod.call("POST", "/v1/loras", **load_body("a", uri)))[1]["message"].endswith("loaded successfully")

    # a new sidecar beside the same vLLM lists what vLLM holds, and reloads it in place on the next load
    other = await start_pod(tmp_path, pod.vllm, cache="cache2")
    try:
        assert (await other.call("GET", "/v1/loras"))[1]["loras"] == {"a": lora_id("a")}
        status, body = await other.call("POST", "/v1/loras", **load_body("a", uri))
        assert status == 200 and body["message"].endswith("swapped successfully")
        assert pod.vllm.calls[-1]["load_inplace"] is True
    finally:
        await other.client.close()
        await other.adapters.vllm.close()
        await other.server.close()


async def test_admin_token_and_no_catalogue(tmp_path: Path) -> None:
    (tmp_path / "adapters").mkdir()
    p = await start_pod(tmp_path, FakeVllm(), token="s3cret")
    try:
        assert (await p.call("GET", "/v1/loras"))[0] == 401
        assert (await p.call("GET", "/v1/loras", headers={"Authorization": "Bearer nope"}))[0] == 403
        auth = {"Authorization": "Bearer s3cret"}
        assert (await p.call("GET", "/v1/loras", headers=auth))[0] == 200
        assert (await p.call("GET", "/ready"))[0] == 200  # probes need no token
        # the operator reads 404/405 on the catalogue as a worker without on-demand loading
        assert (await p.call("PUT", "/v1/loras/catalog", headers=auth, json={"adapters": []}))[0] == 405
    finally:
        await p.client.close()
        await p.adapters.vllm.close()
        await p.server.close()


async def test_the_operators_worker_client_manages_a_vllm_pod(pod: Pod) -> None:
    """The operator's own client (lorafleet_operator.workers) needs nothing new for a vLLM pod."""
    from lorafleet_operator.workers import CatalogUnsupported, WorkerClient, WorkerError

    v1, v2 = make_adapter(pod.root, "v1"), make_adapter(pod.root, "v2")
    address = str(pod.client.make_url("")).rstrip("/")
    client = WorkerClient(attempts=1)
    try:
        assert (await client.load(address, "org/a", v1))["lora_id"] == lora_id("org/a")
        await client.load(address, "org/a", v2)  # hot swap
        inventory = await client.inventory(address)
        assert (inventory.names, inventory.capacity, inventory.on_demand) == ({"org/a"}, 2, frozenset())
        with pytest.raises(CatalogUnsupported):
            await client.put_catalog(address, [("org/a", v2)])
        with pytest.raises(WorkerError) as invalid:
            await client.load(address, "big", make_adapter(pod.root, "big", rank=64))
        assert invalid.value.invalid
        await client.load(address, "b", v1)
        with pytest.raises(WorkerError) as full:
            await client.load(address, "c", v1)
        assert full.value.full
        assert await client.unload(address, "org/a") is True
        assert await client.unload(address, "org/a") is False
        assert await client.list(address) == {"b"}
    finally:
        await client.close()
