"""Adapter reads from disk never stall decoding: running requests keep getting tokens while a load blocks."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

from lorafleet_worker.core.engine import Engine
from lorafleet_worker.lora.adapter import LoRAAdapter
from lorafleet_worker.sample.params import SamplingParams, TokenOutput

PROMPT = [5, 17, 42, 99, 3]


async def _tokens(engine: Engine, rid: str, params: SamplingParams, adapter: str | None = None) -> list[int]:
    return [o.token_id async for o in engine.generate(rid, PROMPT, params, adapter)]


async def _wait_for(cond: Any, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def test_a_blocked_adapter_read_does_not_stall_running_requests(
    tiny_models: Any, tiny_adapter_factory: Any
) -> None:
    base = tiny_models["llama"]
    slow_dir = tiny_adapter_factory(base, rank=8, seed=21)
    other_dir = tiny_adapter_factory(base, rank=8, seed=22)
    engine = Engine(base, max_loras=2, max_cpu_loras=1, max_model_len=512, block_size=4)
    assert engine.manager is not None
    await engine.start()
    try:
        short = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        await engine.add_adapter("slow", slow_dir)
        want = await _tokens(engine, "warm", short, "slow")
        await engine.add_adapter("other", other_dir)  # "slow" leaves the CPU tier: the next use reads the disk
        await _tokens(engine, "use-other", short, "other")
        await engine.add_adapter("filler", other_dir)
        await _tokens(engine, "use-filler", short, "filler")  # takes the slot of "slow", used least recently
        assert engine.manager.slot_of("slow") is None

        reading, release = threading.Event(), threading.Event()
        plain_read = engine.manager._read

        def blocked_read(path: Path) -> LoRAAdapter:
            if path == slow_dir:
                reading.set()
                release.wait(120)
            return plain_read(path)

        engine.manager._read = blocked_read  # type: ignore[method-assign]
        running: list[TokenOutput] = []

        async def long_request(adapter: str | None) -> None:
            params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
            async for out in engine.generate(f"long-{adapter}", PROMPT, params, adapter):
                running.append(out)

        long_task = asyncio.create_task(long_request("other"))
        await _wait_for(lambda: len(running) >= 2, "the running request to decode")
        slow_task = asyncio.create_task(_tokens(engine, "needs-a-read", short, "slow"))
        await _wait_for(reading.is_set, "the adapter read to start")
        at_block = len(running)
        # While the read is blocked, the running request keeps decoding (and the event loop keeps serving).
        await _wait_for(lambda: len(running) >= at_block + 30, "tokens while the read is blocked")
        assert not slow_task.done() and reading.is_set() and not release.is_set()
        assert engine.stats.num_running == 1
        release.set()
        assert await asyncio.wait_for(slow_task, 120) == want  # the weights read back are the same
        assert not long_task.done()  # the slow request finished first: its wait cost the others nothing
        long_task.cancel()
    finally:
        await engine.stop()
