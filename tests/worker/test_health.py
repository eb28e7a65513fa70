"""Liveness that means something: `/health` fails once the engine loop died or wedged with work queued.

The engine is real (the tiny llama); the tests wedge or kill its step loop by patching one of its
methods in this process (no hook ships in the worker).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from lorafleet_worker.api.inference import build_inference_app
from lorafleet_worker.api.management import build_management_app
from lorafleet_worker.core.errors import EngineUnavailableError
from lorafleet_worker.sample.params import SamplingParams
from lorafleet_worker.service import WorkerService, WorkerSettings

STALL_S = 0.5


class _Killed(BaseException):
    """Not an Exception: the step loop's `except Exception` lets it end the thread, as a fatal error would."""


@pytest.fixture
async def service(tiny_models: Any) -> AsyncIterator[WorkerService]:
    settings = WorkerSettings(
        model_dir=tiny_models["llama"], served_model_name="tiny", stall_timeout_s=STALL_S, max_num_seqs=4
    )
    svc = WorkerService(settings)
    await svc.start()
    try:
        yield svc
    finally:
        await svc.stop()


async def _probe(svc: WorkerService, path: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=build_management_app(svc))
    async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
        return await client.get(path)


async def _until(svc: WorkerService, path: str, status: int, timeout: float = 30.0) -> httpx.Response:
    """Poll `path` until it answers `status` (fail after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        r = await _probe(svc, path)
        if r.status_code == status:
            return r
        if time.monotonic() > deadline:
            pytest.fail(f"{path} still answers {r.status_code} {r.text} after {timeout:.0f}s")
        await asyncio.sleep(0.05)


async def _drain(stream: AsyncIterator[Any]) -> list[Any]:
    return [out async for out in stream]


def _submit(svc: WorkerService, rid: str) -> asyncio.Task[list[Any]]:
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    return asyncio.create_task(_drain(svc.engine.generate(rid, [5, 17, 42], params)))


def _patch_step(svc: WorkerService, monkeypatch: pytest.MonkeyPatch, before: Callable[[], None]) -> None:
    engine = svc.engine
    real_step = engine._step

    def step(plan: Any) -> None:
        before()
        real_step(plan)

    monkeypatch.setattr(engine, "_step", step)


async def test_idle_engine_is_healthy_and_ready_long_after_its_last_step(service: WorkerService) -> None:
    service.engine.progress_at -= 10 * STALL_S  # idle for long: nothing is pending, so that is no stall
    assert (await _probe(service, "/health")).json() == {"status": "healthy"}
    assert (await _probe(service, "/ready")).status_code == 200
    assert len(await _submit(service, "idle-then-busy")) == 4  # a new request measures its stall from now
    assert (await _probe(service, "/health")).status_code == 200


async def test_wedged_step_fails_health_and_ready_until_it_moves(
    service: WorkerService, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    _patch_step(service, monkeypatch, lambda: release.wait(60))
    assert (await _probe(service, "/health")).status_code == 200
    task = _submit(service, "wedged")

    r = await _until(service, "/health", 503)
    assert "no progress" in r.json()["message"] and "1 requests pending" in r.json()["message"]
    ready = await _probe(service, "/ready")
    assert ready.status_code == 503 and "no progress" in ready.json()["message"]
    assert not task.done()

    release.set()  # the step moves again: the request ends and both probes recover
    assert len(await asyncio.wait_for(task, 30)) == 4
    assert (await _probe(service, "/health")).status_code == 200
    assert (await _probe(service, "/ready")).status_code == 200


async def test_stall_check_can_be_turned_off(service: WorkerService, monkeypatch: pytest.MonkeyPatch) -> None:
    service.settings.stall_timeout_s = 0
    release = threading.Event()
    entered = threading.Event()

    def wedge() -> None:
        entered.set()
        release.wait(60)

    _patch_step(service, monkeypatch, wedge)
    task = _submit(service, "wedged-unchecked")
    assert await asyncio.to_thread(entered.wait, 30)
    service.engine.progress_at -= 100 * STALL_S  # as if wedged for long
    assert (await _probe(service, "/health")).status_code == 200  # only a dead loop fails it now
    release.set()
    assert len(await asyncio.wait_for(task, 30)) == 4


def _kill_loop(svc: WorkerService, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next step ends the engine thread (the test build of a fatal error in the step loop)."""

    def die() -> None:
        raise _Killed("engine thread killed by the test")

    _patch_step(svc, monkeypatch, die)


async def test_dead_engine_loop_fails_health_and_ready(service: WorkerService, monkeypatch: pytest.MonkeyPatch) -> None:
    _kill_loop(service, monkeypatch)
    task = _submit(service, "killed")
    with pytest.raises(EngineUnavailableError, match="_Killed: engine thread killed by the test"):
        await asyncio.wait_for(task, 30)  # the request in flight fails at once instead of hanging
    r = await _until(service, "/health", 503)
    assert r.json()["message"] == "the engine loop has stopped"
    ready = await _probe(service, "/ready")
    assert ready.status_code == 503 and ready.json()["message"] == "the engine loop has stopped"


async def test_dead_engine_answers_503_so_the_router_retries(
    service: WorkerService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request in flight when the loop dies and every later one, streamed or not, get a 503
    (not a 500: the router retries 404/503 on another holder), before any byte of an answer."""
    _kill_loop(service, monkeypatch)
    transport = httpx.ASGITransport(app=build_inference_app(service))
    body = {"model": "tiny", "prompt": [5, 17, 42], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(transport=transport, base_url="http://worker", timeout=30) as client:
        in_flight = await client.post("/v1/completions", json=body)
        assert in_flight.status_code == 503, in_flight.text
        assert in_flight.json()["error"]["code"] == "engine_unavailable"
        assert "the engine loop died" in in_flight.json()["error"]["message"]
        for stream in (False, True):
            later = await client.post("/v1/completions", json={**body, "stream": stream})
            assert later.status_code == 503, (stream, later.text)
            assert later.json()["error"]["code"] == "engine_unavailable"
