"""Paged KV cache: per-layer block tensors plus a block pool with a prefix cache.

Layout per layer (read by the Triton paged-attention kernel too):
`k_cache`, `v_cache`: `[num_blocks, block_size, num_kv_heads, head_dim]`. A sequence owns a list
of block ids; token `p` of the sequence lives at `blocks[p // block_size]`, offset `p % block_size`.

The pool is allocated with `torch.empty` (no up-front fill of what may be many GiB). Attention masks the
positions of a block beyond a sequence's length, but a masked weight of 0 times a NaN left in uninitialised
memory is still NaN, so a block is zeroed when it is handed out (`grow`), and block 0, which pads block
tables, is zeroed at start. What a sequence can read is then always finite: zeros or K/V it wrote.
A block found again through the prefix cache (`BlockPool.lookup`) is not zeroed: it holds the K/V
computed for exactly that prefix, tokens and adapter.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lorafleet_worker.config import ModelConfig

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


class PagedKVCache:
    """K/V block tensors of every layer and the block pool that hands out their blocks."""

    def __init__(
        self, config: ModelConfig, *, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self._k = torch.empty(shape, device=device, dtype=dtype)  # every layer's blocks, zeroed when handed out
        self._v = torch.empty(shape, device=device, dtype=dtype)
        self.k_caches = list(self._k.unbind(0))  # contiguous per-layer views
        self.v_caches = list(self._v.unbind(0))
        self.pool = BlockPool(num_blocks)
        self._zero([0])  # block 0 pads block tables

    @property
    def nbytes(self) -> int:
        return self._k.nbytes + self._v.nbytes

    def _zero(self, blocks: list[int]) -> None:
        """Zero `blocks` of every layer (one op for K and one for V)."""
        if len(blocks) == 1:
            self._k[:, blocks[0]].zero_()
            self._v[:, blocks[0]].zero_()
            return
        ids = torch.tensor(blocks, dtype=torch.int64).to(self._k.device, non_blocking=True)
        self._k.index_fill_(1, ids, 0)
        self._v.index_fill_(1, ids, 0)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def grow(self, blocks: list[int], num_tokens: int) -> bool:
        """Extend `blocks` in place so that it holds `num_tokens` tokens; False (unchanged) if out of blocks."""
        need = self.blocks_for(num_tokens) - len(blocks)
        if need <= 0:
            return True
        new = self.pool.allocate(need)
        if new is None:
            return False
        self._zero(new)
        blocks.extend(new)
        return True

    def release(self, blocks: list[int]) -> None:
        """Drop the hold on every block of `blocks` and empty the list."""
        self.pool.release(blocks)
        blocks.clear()

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * block_size * config.kv_size * elem


def block_table_tensor(tables: list[list[int]], device: torch.device) -> Tensor:
    """Pad block-id lists with 0 into an int32 `[len(tables), max_len]` tensor."""
    width = max((len(t) for t in tables), default=0) or 1
    padded = [t + [0] * (width - len(t)) for t in tables]
    return torch.tensor(padded, dtype=torch.int32).to(device, non_blocking=True)
