"""KV events in vLLM's format over ZMQ, for external prefix-aware routers (llm-d, Dynamo). Opt-in.

Configured as vLLM's `--kv-events-config`, a JSON object, e.g.
`{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv-events"}`.
Each engine step that cached or evicted blocks publishes one batch as a ZMQ multipart message
(topic, 8-byte big-endian sequence number, msgpack payload). The payload is `[ts, [event, ...], 0]`
(the data-parallel rank is always 0); each event is a map tagged by `type`, as vLLM writes them since
its events became named maps: `BlockStored` {block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, lora_name}, `BlockRemoved` {block_hashes, medium} and `AllBlocksCleared` {}. Block
hashes are the low 64 bits of the worker's block hashes (kv_cache.hash_block), as unsigned integers.
With `replay_endpoint`, a ROUTER socket answers a request holding a start sequence number (8 bytes,
big-endian) with every buffered batch from there, then (-1, b"").
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Any

import msgpack
import zmq
from lorafleet_sync.ids import lora_id

log = logging.getLogger(__name__)

MEDIUM = "CPU_OR_GPU"  # where the engine's KV blocks live (vLLM names its own "GPU")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_FIELD_TYPES: dict[str, type] = {"enable_kv_cache_events": bool, "buffer_steps": int, "hwm": int, "max_queue_size": int}


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig fields (only the ZMQ publisher is implemented)."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        """From `--kv-events-config` JSON; ValueError naming the field that is wrong."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-events-config is not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        for key, value in raw.items():
            if key not in known:
                raise ValueError(f"--kv-events-config: unknown field {key!r} (known: {', '.join(sorted(known))})")
            want = _FIELD_TYPES.get(key, str)
            optional = key == "replay_endpoint" and value is None
            if not optional and (not isinstance(value, want) or (want is int and isinstance(value, bool))):
                raise ValueError(f"--kv-events-config: {key} must be a {want.__name__}")
        config = cls(**raw)
        if config.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher {config.publisher!r} is not supported (zmq or null)")
        return config

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def external_hash(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[-8:], "big")


class KVEventStream:
    """Turns the block pool's events (`record`, on the engine thread) into one published batch per step
    (`flush`); a background thread owns the ZMQ sockets."""

    def __init__(self, config: KVEventsConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self._pending: list[dict[str, Any]] = []
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        endpoint = config.endpoint
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(endpoint)  # vLLM's convention: a wildcard binds, an address connects
        else:
            self._pub.connect(endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self._thread = threading.Thread(target=self._publish_loop, name="kv-events", daemon=True)
        self._thread.start()
        log.info("KV events: publishing on %s (topic %r)", endpoint, config.topic)

    def record(self, event: tuple[Any, ...]) -> None:
        """One block-pool event (kv_cache.BlockPool.on_event); stored blocks of one chain merge into one event."""
        kind = event[0]
        if kind == "stored":
            _, block_hash, parent, tokens, adapter = event
            last = self._pending[-1] if self._pending else None
            h, p = external_hash(block_hash), external_hash(parent) if parent is not None else None
            if (
                last is not None
                and last["type"] == "BlockStored"
                and last["lora_name"] == adapter
                and p is not None
                and last["block_hashes"][-1] == p
            ):
                last["block_hashes"].append(h)
                last["token_ids"].extend(tokens)
                return
            self._pending.append(
                {
                    "type": "BlockStored",
                    "block_hashes": [h],
                    "parent_block_hash": p,
                    "token_ids": list(tokens),
                    "block_size": self.block_size,
                    "lora_id": lora_id(adapter) if adapter else None,
                    "medium": MEDIUM,
                    "lora_name": adapter,
                }
            )
        elif kind == "removed":
            h = external_hash(event[1])
            last = self._pending[-1] if self._pending else None
            if last is not None and last["type"] == "BlockRemoved":
                last["block_hashes"].append(h)
            else:
                self._pending.append({"type": "BlockRemoved", "block_hashes": [h], "medium": MEDIUM})
        elif kind == "cleared":
            self._pending.append({"type": "AllBlocksCleared"})

    def flush(self) -> None:
        """Publish what was recorded since the last flush (nothing when nothing was)."""
        if not self._pending:
            return
        payload = msgpack.packb([time.time(), self._pending, 0])
        self._pending = []
        try:
            self._queue.put_nowait(payload)
        except queue.Full:
            log.warning("KV events: the publish queue is full; a batch was dropped")

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _publish_loop(self) -> None:
        topic, seq = self.config.topic.encode(), 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                payload = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if payload is None:
                return
            self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            seq += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events: malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
