"""Concurrency through the HTTP API: slot contention, load/unload races, drains, hot swaps, disconnects."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from lorafleet_sync.ids import lora_id

from tests.worker.conftest import Worker, wait_until

PROMPT = "Serving thousands of adapters means"
MAX_LORAS = 4  # the shared worker's --max-loras


def _ids(out: dict[str, Any]) -> list[int]:
    """Generated token ids of a completion made with logprobs=0 and return_tokens_as_token_ids."""
    return [int(t.split(":")[1]) for t in out["choices"][0]["logprobs"]["tokens"]]


def _body(model: str, max_tokens: int, **kw: Any) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        **kw,
    }


def _reference(worker: Worker, model: str, max_tokens: int) -> list[int]:
    return _ids(worker.complete(**_body(model, max_tokens)))


class Stream:
    """A streaming completion read in the background; `first` is set at the first chunk."""

    def __init__(self, client: httpx.AsyncClient, worker: Worker, body: dict[str, Any]) -> None:
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.first = asyncio.Event()
        self.ended_at: float | None = None
        self.task = asyncio.create_task(self._run(client, worker, body))

    async def _run(self, client: httpx.AsyncClient, worker: Worker, body: dict[str, Any]) -> None:
        async with client.stream("POST", f"{worker.url}/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                self.token_ids += [int(t.split(":")[1]) for t in (choice["logprobs"] or {}).get("tokens", [])]
                self.finish_reason = choice["finish_reason"] or self.finish_reason
                self.first.set()
        self.ended_at = time.monotonic()

    @property
    def done(self) -> bool:
        return self.task.done()


@pytest.fixture(scope="module")
def sources(shared_worker: Worker, tiny_models: Any, tiny_adapter_factory: Any, place_adapter: Any) -> list[Path]:
    """Eight distinct adapters (ranks 4..16) under the worker's allowed root."""
    return [
        place_adapter(tiny_adapter_factory(tiny_models["llama"], rank=4 + 4 * (i % 4), seed=100 + i), f"conc-{i}")
        for i in range(8)
    ]


@pytest.fixture(scope="module")
def slot_adapters(shared_worker: Worker, sources: list[Path]) -> Iterator[list[str]]:
    names = [f"conc/slot-{i}" for i in range(len(sources))]
    for name, path in zip(names, sources, strict=True):
        shared_worker.load(name, path)
    yield names
    for name in names:
        shared_worker.unload(name)


async def test_more_adapters_in_flight_than_slots(shared_worker: Worker, slot_adapters: list[str]) -> None:
    models = [*slot_adapters, "tiny-llama"]
    assert len(slot_adapters) == 2 * MAX_LORAS
    expected = {m: _reference(shared_worker, m, 12) for m in models}
    assert len({tuple(v) for v in expected.values()}) == len(models), "adapters should differ"
    before = shared_worker.metrics()

    async with httpx.AsyncClient(timeout=300) as client:
        requests = [_body(m, 12) for m in models for _ in range(3)]
        random.Random(7).shuffle(requests)
        responses = await asyncio.gather(
            *(client.post(f"{shared_worker.url}/v1/completions", json=b) for b in requests)
        )

    for body, r in zip(requests, responses, strict=True):
        assert r.status_code == 200, r.text
        assert _ids(r.json()) == expected[body["model"]], f"{body['model']} got another adapter's weights"
    after = shared_worker.metrics()
    assert after["lorafleet_max_adapters_in_step"] <= MAX_LORAS
    assert after["lorafleet_max_adapters_in_step"] == MAX_LORAS, "the slots were never all in use"
    assert after["lorafleet_lora_manager_evictions"] > before["lorafleet_lora_manager_evictions"]


async def test_concurrent_load_unload_ends_consistent(
    shared_worker: Worker, sources: list[Path], slot_adapters: list[str]
) -> None:
    names = [f"churn/{i}" for i in range(5)]
    uris = [f"file://{sources[0]}", f"file://{sources[1]}"]
    rng = random.Random(42)
    ops = [(rng.choice(names), rng.choice([*uris, None])) for _ in range(50)]
    headers = shared_worker.admin_headers()

    async def call(client: httpx.AsyncClient, name: str, uri: str | None) -> httpx.Response:
        if uri is None:
            return await client.delete(f"{shared_worker.system_url}/v1/loras/{name}", headers=headers)
        body = {"lora_name": name, "source": {"uri": uri}}
        return await client.post(f"{shared_worker.system_url}/v1/loras", json=body, headers=headers)

    async with httpx.AsyncClient(timeout=300) as client:
        responses = await asyncio.gather(*(call(client, n, u) for n, u in ops))
    for (name, uri), r in zip(ops, responses, strict=True):
        assert r.status_code in ((200,) if uri else (200, 404)), r.text
        if r.status_code == 200:
            assert r.json()["lora_id"] == lora_id(name)

    loras = {n: i for n, i in shared_worker.loras().items() if n.startswith("churn/")}
    models = {
        m["id"]: m["root"]
        for m in httpx.get(f"{shared_worker.url}/v1/models").json()["data"]
        if m["id"].startswith("churn/")
    }
    assert set(loras) == set(models)
    assert all(loras[n] == lora_id(n) for n in loras)
    metrics = shared_worker.metrics()
    assert metrics["lorafleet_lora_manager_registered"] == len(shared_worker.loras())  # engine agrees

    reference = {
        uris[0]: _reference(shared_worker, "conc/slot-0", 4),
        uris[1]: _reference(shared_worker, "conc/slot-1", 4),
    }
    for name in names:
        r = httpx.post(f"{shared_worker.url}/v1/completions", json=_body(name, 4), timeout=60)
        if name in loras:
            assert r.status_code == 200 and _ids(r.json()) == reference[models[name]], name
        else:
            assert r.status_code == 404, r.text
    for name in loras:
        shared_worker.unload(name)


async def test_unload_waits_for_a_stream_and_refuses_new_requests(shared_worker: Worker, sources: list[Path]) -> None:
    name = "drain/x"
    shared_worker.load(name, sources[2])
    expected = _reference(shared_worker, name, 300)
    async with httpx.AsyncClient(timeout=300) as client:
        stream = Stream(client, shared_worker, _body(name, 300))
        await asyncio.wait_for(stream.first.wait(), 120)
        unload = asyncio.create_task(
            client.delete(f"{shared_worker.system_url}/v1/loras/{name}", headers=shared_worker.admin_headers())
        )
        deadline = time.monotonic() + 60
        while (
            name
            in (await client.get(f"{shared_worker.system_url}/v1/loras", headers=shared_worker.admin_headers())).json()[
                "loras"
            ]
        ):
            assert time.monotonic() < deadline, "the unload never took effect"
            await asyncio.sleep(0.01)  # poll interval (the condition is checked, not assumed)
        r = await client.post(f"{shared_worker.url}/v1/completions", json=_body(name, 2))
        assert r.status_code == 404, r.text
        assert not stream.done, "the stream ended before the test could check the drain (make it longer)"
        assert not unload.done(), "the unload returned while a stream still used the adapter"
        response = await unload
        unloaded_at = time.monotonic()
        await stream.task
    assert response.status_code == 200, response.text
    assert stream.ended_at is not None and stream.ended_at <= unloaded_at + 1.0
    assert stream.finish_reason == "length" and stream.token_ids == expected  # finished on its weights


async def test_hot_swap_keeps_in_flight_requests_on_old_weights(shared_worker: Worker, sources: list[Path]) -> None:
    name = "swap/x"
    shared_worker.load("swap/ref-b", sources[4])
    expected_b = _reference(shared_worker, "swap/ref-b", 8)
    shared_worker.unload("swap/ref-b")
    shared_worker.load(name, sources[3])
    expected_a = _reference(shared_worker, name, 300)
    async with httpx.AsyncClient(timeout=300) as client:
        stream = Stream(client, shared_worker, _body(name, 300))
        await asyncio.wait_for(stream.first.wait(), 120)
        body = {"lora_name": name, "source": {"uri": f"file://{sources[4]}"}}
        r = await client.post(f"{shared_worker.system_url}/v1/loras", json=body, headers=shared_worker.admin_headers())
        assert r.status_code == 200 and "swapped" in r.json()["message"], r.text
        assert not stream.done, "the stream ended before the swap (make it longer)"
        r = await client.post(f"{shared_worker.url}/v1/completions", json=_body(name, 8))
        assert r.status_code == 200 and _ids(r.json()) == expected_b  # new requests: new weights
        await stream.task
    assert stream.token_ids == expected_a  # the in-flight request finished on the old weights
    models = {m["id"]: m["root"] for m in httpx.get(f"{shared_worker.url}/v1/models").json()["data"]}
    assert models[name] == f"file://{sources[4]}"
    shared_worker.unload(name)


async def test_client_disconnect_aborts_the_request(shared_worker: Worker) -> None:
    def aborted() -> float:
        return shared_worker.metrics()["lorafleet_engine_requests_aborted"]

    before = aborted()
    async with httpx.AsyncClient(timeout=300) as client:
        async with client.stream(
            "POST", f"{shared_worker.url}/v1/completions", json=_body("tiny-llama", 1800, stream=True)
        ) as r:
            lines = r.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
        wait_until(lambda: aborted() >= before + 1, 60, "the engine never aborted the disconnected stream")
        with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
            await client.post(f"{shared_worker.url}/v1/completions", json=_body("tiny-llama", 1800), timeout=0.5)
    wait_until(lambda: aborted() >= before + 2, 60, "the engine never aborted the abandoned request")
    wait_until(lambda: shared_worker.metrics()["lorafleet_engine_num_running"] == 0, 60, "requests still running")
