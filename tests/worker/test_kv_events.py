"""KV events in vLLM's format, read by a real ZMQ subscriber: BlockStored with the adapter's name and the
block chain, BlockRemoved on eviction, replay from a sequence number; and the config's validation."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from aiohttp.test_utils import unused_port
from lorafleet_sync.ids import lora_id
from lorafleet_worker.core.engine import Engine
from lorafleet_worker.core.kv_events import END_SEQ, KVEventsConfig
from lorafleet_worker.sample.params import SamplingParams

BLOCK = 4
PARAMS = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


def test_config_is_parsed_like_vllms_and_bad_fields_are_named() -> None:
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", "topic": "kv"}')
    assert config.active and config.endpoint == "tcp://*:6000" and config.publisher == "zmq"
    assert not KVEventsConfig.parse("{}").active
    with pytest.raises(ValueError, match="unknown field 'endpont'"):
        KVEventsConfig.parse('{"endpont": "tcp://*:1"}')
    with pytest.raises(ValueError, match="hwm must be a int"):
        KVEventsConfig.parse('{"hwm": "many"}')
    with pytest.raises(ValueError, match="publisher 'kafka'"):
        KVEventsConfig.parse('{"publisher": "kafka"}')


def replay(ctx: zmq.Context[Any], endpoint: str, start: int) -> list[tuple[int, Any]]:
    """Ask the replay socket for every batch from `start` (a DEALER: the answer is several messages)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert dealer.poll(10_000), "no replay answer"
            _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
    finally:
        dealer.close(linger=0)


async def test_subscriber_sees_stored_and_removed_blocks_with_the_adapter(
    tiny_models: Any, tiny_adapter_factory: Callable[..., Path]
) -> None:
    pub, rep = unused_port(), unused_port()
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://*:{pub}",
        replay_endpoint=f"tcp://*:{rep}",
        topic="kv-events",
    )
    engine = Engine(
        tiny_models["llama"], max_loras=1, block_size=BLOCK, num_kv_blocks=8, max_model_len=32, kv_events=config
    )
    await engine.start()
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{pub}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    try:
        await engine.add_adapter("tenant", tiny_adapter_factory(tiny_models["llama"], rank=4, seed=5))
        prompt = list(range(10, 19))  # 9 tokens: two full blocks
        await _run(engine, "a", prompt, "tenant")
        batches = replay(ctx, f"tcp://127.0.0.1:{rep}", 0)
        assert [seq for seq, _ in batches] == list(range(len(batches))) and batches
        events = [e for _, batch in batches for e in batch[1]]
        stored = [e for e in events if e["type"] == "BlockStored"]
        assert stored[0]["lora_name"] == "tenant" and stored[0]["lora_id"] == lora_id("tenant")
        assert stored[0]["token_ids"][: 2 * BLOCK] == prompt[: 2 * BLOCK] and stored[0]["parent_block_hash"] is None
        assert stored[0]["block_size"] == BLOCK and len(stored[0]["block_hashes"]) >= 2
        assert all(isinstance(h, int) and 0 <= h < 2**64 for h in stored[0]["block_hashes"])
        # the pool holds 8 blocks: other prompts evict these, and the subscriber is told
        for i in range(4):
            await _run(engine, f"b{i}", list(range(100 + 20 * i, 113 + 20 * i)), None)
        removed = set()
        for _, batch in replay(ctx, f"tcp://127.0.0.1:{rep}", len(batches)):
            for e in batch[1]:
                if e["type"] == "BlockRemoved":
                    removed.update(e["block_hashes"])
        assert set(stored[0]["block_hashes"][:2]) <= removed
        # live: once the subscription is through, a new prompt's batch arrives on the PUB socket
        received = None
        for i in range(50):
            await _run(engine, f"live{i}", list(range(200 + 9 * i, 209 + 9 * i)), None)
            if sub.poll(200):
                received = sub.recv_multipart()
                break
        assert received is not None and received[0] == b"kv-events" and len(received) == 3
        ts, events, rank = msgpack.unpackb(received[2])
        assert ts > 0 and rank == 0 and events
    finally:
        sub.close(linger=0)
        await engine.stop()


async def _run(engine: Engine, rid: str, prompt: list[int], adapter: str | None) -> None:
    async with asyncio.timeout(60):
        async for _ in engine.generate(rid, prompt, PARAMS, adapter):
            pass
