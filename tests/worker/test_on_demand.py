"""Adapters on demand through a real worker: the catalogue (`PUT/GET /v1/loras/catalog`), a request naming a
catalogued adapter loads it (once however many requests wait), `--max-loaded-loras` evicts the least recently
used idle adapter loaded on demand and never a pinned one nor one with a request in flight, an unknown name is
a 404, and a load that outlasts `--lora-load-timeout` is a 503 naming the adapter.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from lorafleet_worker_dev.launch import free_port

from tests.worker.conftest import Worker, start_worker, stop_worker, use_local_s3

STORE_HOST = "127.0.0.1"
MAX_LOADED = 2
LOAD_TIMEOUT_S = 3
FETCH_DEADLINE_S = 6  # the stuck store's fetch fails after this, so the worker stops cleanly
PROMPT = "Once upon a time"
LOADS = 'lorafleet_lora_on_demand_loads_total{outcome="success"}'
EVICTIONS = "lorafleet_lora_on_demand_evictions_total"


@pytest.fixture(scope="module")
def store_port() -> int:
    """The worker's S3 endpoint; `silent_store` listens there and never answers."""
    return free_port(STORE_HOST)


@pytest.fixture(scope="module")
def adapters(tiny_models: Any, tiny_adapter_factory: Any) -> dict[str, Path]:
    """Distinct tiny llama adapters, by name."""
    return {f"od-{i}": tiny_adapter_factory(tiny_models["llama"], rank=4, seed=400 + i) for i in range(6)}


@pytest.fixture(scope="module")
def worker(
    tiny_models: Any, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, store_port: int
) -> Iterator[Worker]:
    with pytest.MonkeyPatch.context() as env:
        use_local_s3(env, f"http://{STORE_HOST}:{store_port}", FETCH_DEADLINE_S)
        env.setenv("LORAFLEET_LORA_LOAD_TIMEOUT", str(LOAD_TIMEOUT_S))  # the variable, not the flag
        w = start_worker(
            tiny_models["llama"],
            tmp_path_factory.mktemp("on_demand"),
            name="tiny-od",
            file_root=next(iter(adapters.values())).parent,
            args=["--max-loaded-loras", str(MAX_LOADED), "--max-loras", "2"],
        )
    yield w
    stop_worker(w)
    assert w.proc.returncode == 0, f"worker did not exit cleanly:\n{w.log_tail()}"


@pytest.fixture(autouse=True)
def empty(worker: Worker) -> Iterator[None]:
    """Each test starts with no adapter held and an empty catalogue."""
    for name in worker.loras():
        worker.unload(name)
    put_catalog(worker, {})
    yield
    assert worker.proc.poll() is None, worker.log_tail()


def put_catalog(worker: Worker, entries: dict[str, str], *, expect: int = 200) -> dict[str, Any]:
    body = {"adapters": [{"lora_name": name, "source": {"uri": uri}} for name, uri in entries.items()]}
    r = httpx.put(f"{worker.system_url}/v1/loras/catalog", json=body, headers=worker.admin_headers(), timeout=30)
    assert r.status_code == expect, r.text
    out: dict[str, Any] = r.json()
    return out


def catalogue(worker: Worker, adapters: dict[str, Path], *names: str) -> None:
    assert put_catalog(worker, {n: f"file://{adapters[n]}" for n in names}) == {
        "status": "success",
        "count": len(names),
    }


def listing(worker: Worker) -> dict[str, Any]:
    r = httpx.get(f"{worker.system_url}/v1/loras", headers=worker.admin_headers(), timeout=30)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def complete(worker: Worker, model: str, max_tokens: int = 8) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{worker.url}/v1/completions", json=body, timeout=120)


def tokens(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    text: str = response.json()["choices"][0]["text"]
    return text


@contextmanager
def streaming(worker: Worker, model: str) -> Iterator[Iterator[str]]:
    """A long streaming completion for `model`, open once its first chunk arrived (its request is in flight)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1800, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{worker.url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        next(lines)
        yield lines


def running_adapters(worker: Worker) -> list[str]:
    r = httpx.get(f"{worker.url}/metrics", timeout=30)
    m = re.search(r'^vllm:lora_requests_info\{[^}]*running_lora_adapters="([^"]*)"', r.text, re.M)
    assert m, r.text
    return [a for a in m[1].split(",") if a]


# --- the catalogue -----------------------------------------------------------------------------------------


def test_catalog_put_get_and_bad_entries(worker: Worker, adapters: dict[str, Path]) -> None:
    entries = {"od-0": f"file://{adapters['od-0']}", "team/od-1": "s3://bucket/od-1/v1/", "od-2": "hf://org/repo"}
    assert put_catalog(worker, entries) == {"status": "success", "count": 3}
    r = httpx.get(f"{worker.system_url}/v1/loras/catalog", headers=worker.admin_headers(), timeout=30)
    assert r.status_code == 200
    got = r.json()
    assert got["status"] == "success" and got["count"] == 3
    assert {a["lora_name"]: a["source"]["uri"] for a in got["adapters"]} == entries
    assert worker.loras() == {}  # catalogued is not loaded

    bad = [
        ({"bad name!": "s3://bucket/x"}, "bad name!"),
        ({"od-3": "ftp://host/x"}, "ftp://host/x"),
        ({"tiny-od": "s3://bucket/x"}, "base model"),
    ]
    for entries_bad, named in bad:
        body = put_catalog(worker, {"od-4": "s3://bucket/ok", **entries_bad}, expect=400)
        assert body["status"] == "error" and named in body["message"], body
    duplicate = {"adapters": [{"lora_name": "od-4", "source": {"uri": "s3://bucket/x"}}] * 2}
    r = httpx.put(f"{worker.system_url}/v1/loras/catalog", json=duplicate, timeout=30)
    assert r.status_code == 400 and "more than once" in r.json()["message"], r.text
    r = httpx.put(f"{worker.system_url}/v1/loras/catalog", json={"adapters": [{"lora_name": "x"}]}, timeout=30)
    assert r.status_code == 400, r.text
    # none of the bad catalogues changed anything
    got = httpx.get(f"{worker.system_url}/v1/loras/catalog", timeout=30).json()
    assert {a["lora_name"]: a["source"]["uri"] for a in got["adapters"]} == entries


# --- loading on demand -------------------------------------------------------------------------------------


def test_request_for_a_catalogued_adapter_loads_it_unpinned(worker: Worker, adapters: dict[str, Path]) -> None:
    catalogue(worker, adapters, "od-0")
    before = worker.metrics().get(LOADS, 0.0)
    on_demand = tokens(complete(worker, "od-0"))
    assert worker.metrics()[LOADS] == before + 1
    listed = listing(worker)
    assert set(listed["loras"]) == {"od-0"} and listed["pinned"] == {"od-0": False}
    # the same weights placed by the management API answer the same; the base model answers otherwise
    worker.load("od-0-placed", adapters["od-0"])
    assert tokens(complete(worker, "od-0-placed")) == on_demand
    assert tokens(complete(worker, "tiny-od")) != on_demand
    # a management load of the on-demand adapter pins it, without loading it again
    manager_loads = worker.metrics()["lorafleet_lora_manager_loads"]
    body = worker.load("od-0", adapters["od-0"])
    assert "already loaded" in body["message"], body
    assert listing(worker)["pinned"] == {"od-0": True, "od-0-placed": True}
    assert worker.metrics()["lorafleet_lora_manager_loads"] == manager_loads
    assert "adapter od-0 loaded on demand" in worker.log_path.read_text()


def test_concurrent_requests_share_one_load(worker: Worker, adapters: dict[str, Path]) -> None:
    catalogue(worker, adapters, "od-1")
    before = worker.metrics().get(LOADS, 0.0)

    async def burst() -> list[httpx.Response]:
        body = {"model": "od-1", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(f"{worker.url}/v1/completions", json=body) for _ in range(8)))

    responses = asyncio.run(burst())
    texts = {tokens(r) for r in responses}
    assert len(texts) == 1  # greedy: every request saw the same adapter
    assert worker.metrics()[LOADS] == before + 1


def test_unknown_name_is_404_naming_it(worker: Worker, adapters: dict[str, Path]) -> None:
    catalogue(worker, adapters, "od-0")
    r = complete(worker, "not-catalogued")
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert "`not-catalogued`" in error["message"] and error["code"] == "model_not_found"


# --- capacity ----------------------------------------------------------------------------------------------


def test_pinned_adapters_are_never_evicted(worker: Worker, adapters: dict[str, Path]) -> None:
    worker.load("od-0", adapters["od-0"])
    worker.load("od-1", adapters["od-1"])
    catalogue(worker, adapters, "od-2")
    r = complete(worker, "od-2")
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["type"] == "capacity" and "'od-2'" in error["message"], error
    assert set(worker.loras()) == {"od-0", "od-1"}


def test_the_least_recently_used_idle_adapter_is_evicted(worker: Worker, adapters: dict[str, Path]) -> None:
    catalogue(worker, adapters, "od-0", "od-1", "od-2")
    tokens(complete(worker, "od-0"))
    tokens(complete(worker, "od-1"))
    tokens(complete(worker, "od-0"))  # od-1 is now the least recently used
    evictions = worker.metrics().get(EVICTIONS, 0.0)
    tokens(complete(worker, "od-2"))
    assert set(worker.loras()) == {"od-0", "od-2"}
    assert worker.metrics()[EVICTIONS] == evictions + 1
    assert "adapter od-1 evicted to make room for od-2" in worker.log_path.read_text()
    # od-1 is still catalogued: asked again, it comes back (evicting od-0, now the least recently used)
    tokens(complete(worker, "od-1"))
    assert set(worker.loras()) == {"od-1", "od-2"}


def test_an_adapter_with_a_request_in_flight_is_not_evicted(worker: Worker, adapters: dict[str, Path]) -> None:
    catalogue(worker, adapters, "od-0", "od-1", "od-2", "od-3")
    tokens(complete(worker, "od-0"))
    with streaming(worker, "od-0"):
        tokens(complete(worker, "od-1"))  # od-0 is the least recently used, but in flight
        tokens(complete(worker, "od-2"))
        assert set(worker.loras()) == {"od-0", "od-2"}
        assert running_adapters(worker) == ["od-0"]  # still in flight after the eviction
        # the other place holds od-2, idle: evicted; now both hold requests in flight or none is evictable
        with streaming(worker, "od-2"):
            r = complete(worker, "od-3")
            assert r.status_code == 503 and r.json()["error"]["type"] == "capacity", r.text
        assert set(worker.loras()) == {"od-0", "od-2"}


# --- a load that outlasts the timeout ----------------------------------------------------------------------


@contextmanager
def silent_store(port: int) -> Iterator[None]:
    """A TCP server on `port` that accepts connections and never answers."""
    server = socket.create_server((STORE_HOST, port))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        server.close()


def test_a_load_past_the_timeout_is_503_naming_the_adapter(worker: Worker, store_port: int) -> None:
    assert put_catalog(worker, {"od-stuck": "s3://adapters/stuck/v1/"})["count"] == 1
    with silent_store(store_port):
        r = complete(worker, "od-stuck")
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert "'od-stuck'" in error["message"] and f"{LOAD_TIMEOUT_S}s" in error["message"], error
        assert "od-stuck" not in worker.loras()
