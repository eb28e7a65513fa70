"""The KV block pool: block ids with reference counts and the prefix cache's hash index (vLLM's block pool).

Only the KV cache manager (kv_cache_manager.py) uses it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

ROOT_HASH = bytes(32)  # parent of a sequence's first block: fixed, so hashes are stable across restarts


def hash_block(parent: bytes, tokens: Sequence[int], extra: bytes) -> bytes:
    """The hash of one full block: its parent's hash, its token ids and `extra` (the adapter's identity).

    Chained through `parent`, a block's hash names its whole prefix, so equal hashes mean equal KV.
    """
    h = hashlib.sha256(parent)
    h.update(len(extra).to_bytes(4, "little"))
    h.update(extra)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockPool:
    """KV block ids with reference counts and a prefix cache (vLLM's block pool).

    A block is held while its reference count is above 0. A full block whose KV was computed can be
    `cache`d under its hash; once no sequence holds it, it waits in an LRU of cached free blocks and a
    `lookup` of its hash finds it again until `allocate` needs it (then it is evicted: hash dropped).
    Free blocks without a hash are handed out first. `num_free` counts both kinds of free blocks.
    `on_event`, when set, receives ("stored", block_hash, parent_hash, token_ids, adapter_name),
    ("removed", block_hash) and ("cleared",) as they happen (KV events).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._plain = list(range(num_blocks - 1, -1, -1))  # free, no hash: a stack, handed out first
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # free with a hash, least recently used first
        self._by_hash: dict[bytes, int] = {}
        self.evictions = 0
        self.on_event: Callable[[tuple[Any, ...]], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._plain) + len(self._cached_free)

    @property
    def num_cached(self) -> int:
        """Blocks that a lookup can find (held or free)."""
        return len(self._by_hash)

    def allocate(self, n: int) -> list[int] | None:
        """`n` fresh blocks held once each, or None (nothing allocated) if fewer than `n` are free."""
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            if self._plain:
                b = self._plain.pop()
            else:
                b, _ = self._cached_free.popitem(last=False)
                self._evict(b)
            self._refs[b] = 1
            out.append(b)
        return out

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The blocks cached under the longest prefix of `hashes` (not held: `hold` them to use them)."""
        out = []
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def hold(self, blocks: Sequence[int]) -> None:
        """Take one more reference on each of `blocks` (cached blocks found by `lookup`)."""
        for b in blocks:
            if self._refs[b] == 0:
                del self._cached_free[b]
            self._refs[b] += 1

    def num_unheld(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` are free now (holding them takes that many free blocks)."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each of `blocks`; a block nobody holds becomes free (cached ones stay findable).

        The last blocks of a sequence are released first, so they are evicted before its prefix.
        """
        for b in reversed(blocks):
            if self._refs[b] <= 0:
                raise RuntimeError(f"block {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if self._hash[b] is None:
                    self._plain.append(b)
                else:
                    self._cached_free[b] = None

    def cache(
        self, block: int, block_hash: bytes, parent: bytes | None, tokens: Sequence[int], adapter: str | None
    ) -> bool:
        """Make the full, computed, held `block` findable under `block_hash`; False when another block already is.

        `parent` (the previous block's hash), `tokens` and `adapter` (name) only go into the KV event.
        """
        if self._hash[block] is not None or block_hash in self._by_hash:
            return False
        self._hash[block] = block_hash
        self._by_hash[block_hash] = block
        if self.on_event is not None:
            self.on_event(("stored", block_hash, parent, list(tokens), adapter))
        return True

    def reset(self) -> int:
        """Forget every cached hash (e.g. when weights that cached KV depends on change); how many were dropped."""
        dropped = len(self._by_hash)
        for b in list(self._by_hash.values()):
            self._hash[b] = None
        self._by_hash.clear()
        self._plain.extend(self._cached_free)
        self._cached_free.clear()
        if self.on_event is not None:
            self.on_event(("cleared",))
        return dropped

    def _evict(self, b: int) -> None:
        h = self._hash[b]
        assert h is not None
        self._hash[b] = None
        del self._by_hash[h]
        self.evictions += 1
        if self.on_event is not None:
            self.on_event(("removed", h))
