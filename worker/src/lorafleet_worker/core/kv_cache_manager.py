"""The KV cache manager: the one owner of every request's KV blocks and of the prefix cache.

It alone hashes blocks (adapter-aware), looks prefixes up, holds, allocates, caches and frees blocks,
keeps the block pool's reference counts, counts prefix-cache queries and hits, and publishes KV events.
The scheduler asks it whether and where a request fits; the model runner reads a request's block ids
and zeroes the blocks handed out since the last step before its forward pass.

Prefix caching (`enable_prefix_caching`): after each step `cache_blocks` caches every block a request
filled, under a hash chained over the tokens of its prefix and the adapter's identity (name and weights'
content hash, `AdapterRef.identity`); a request being admitted (new, or preempted) starts from the longest
run of its full blocks that the pool still has. At least its last token is always computed (it gives the
logits to sample from); a request for prompt logprobs computes its whole prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lorafleet_worker.core.block_pool import ROOT_HASH, BlockPool, hash_block
from lorafleet_worker.core.kv_events import KVEventsConfig, KVEventStream
from lorafleet_worker.core.request import Sequence


@dataclass
class _Blocks:
    """One request's blocks, its block hashes (computed once, extended as it grows) and how many are cached."""

    key: bytes  # the adapter's identity in block hashes
    ids: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    num_cached: int = 0  # leading blocks of `ids` that are in the prefix cache


class KVCacheManager:
    """Hands out KV block ids to requests and finds cached prefixes again."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        kv_events: KVEventsConfig | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.prefix_cache_queries = 0  # prompt tokens of requests that looked the cache up (vLLM's counters)
        self.prefix_cache_hits = 0  # of those, tokens found in the cache
        self._reqs: dict[str, _Blocks] = {}
        self._new: list[int] = []  # blocks handed out since `take_new_blocks`
        self._events = KVEventStream(kv_events, block_size) if kv_events is not None and kv_events.active else None
        if self._events is not None:
            self.pool.on_event = self._events.record

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they are reclaimed on demand)."""
        return self.pool.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _of(self, seq: Sequence) -> _Blocks:
        st = self._reqs.get(seq.request_id)
        if st is None:
            st = self._reqs[seq.request_id] = _Blocks(seq.ref.identity if seq.ref is not None else b"")
        return st

    def block_ids(self, seq: Sequence) -> list[int]:
        """The blocks `seq` holds, in token order (read-only for the caller)."""
        st = self._reqs.get(seq.request_id)
        return st.ids if st is not None else []

    def num_cached_blocks(self, seq: Sequence) -> int:
        st = self._reqs.get(seq.request_id)
        return st.num_cached if st is not None else 0

    # ------------------------------------------------------------------ admission

    def lookup(self, seq: Sequence) -> list[int]:
        """Cached blocks that `seq` can start from (its last token is always computed); not held yet."""
        if not self._looks_up(seq):
            return []
        usable = (len(seq.tokens) - 1) // self.block_size
        return self.pool.lookup(self._hashes(seq, usable))

    def num_blocks_needed(self, seq: Sequence, hits: list[int], num_tokens: int) -> int:
        """Free blocks that admitting `seq` with the cached `hits` for `num_tokens` tokens in all would take."""
        held = len(self.block_ids(seq))
        return self.blocks_for(num_tokens) - held - len(hits) + self.pool.num_unheld(hits)

    def admit(self, seq: Sequence, hits: list[int], num_tokens: int) -> None:
        """Hold the cached `hits` for `seq` and grow its blocks to `num_tokens` (checked to fit beforehand)."""
        if self._looks_up(seq):
            self.prefix_cache_queries += len(seq.tokens)
            self.prefix_cache_hits += len(hits) * self.block_size
        st = self._of(seq)
        self.pool.hold(hits)
        st.ids.extend(hits)
        st.num_cached = len(hits)
        grown = self.allocate(seq, num_tokens)
        assert grown, "free blocks were checked before admitting"

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow `seq`'s blocks so that they hold `num_tokens` tokens; False (unchanged) if out of blocks."""
        st = self._of(seq)
        need = self.blocks_for(num_tokens) - len(st.ids)
        if need <= 0:
            return True
        new = self.pool.allocate(need)
        if new is None:
            return False
        st.ids.extend(new)
        self._new.extend(new)
        return True

    def take_new_blocks(self) -> list[int]:
        """The blocks handed out since the last call (to be zeroed before a forward pass reads them)."""
        new, self._new = self._new, []
        return new

    def free(self, seq: Sequence) -> None:
        """Release every block `seq` holds (preemption keeps its hashes: they are the same when it returns)."""
        st = self._reqs.get(seq.request_id)
        if st is None:
            return
        self.pool.release(st.ids)
        st.ids.clear()
        st.num_cached = 0

    def remove(self, seq: Sequence) -> None:
        """Forget `seq` (it ended): release its blocks and drop its hashes."""
        self.free(seq)
        self._reqs.pop(seq.request_id, None)

    # ------------------------------------------------------------------ prefix cache

    def _looks_up(self, seq: Sequence) -> bool:
        """Whether `seq` may start from cached blocks: caching on, nothing held, no prompt logprobs wanted
        (they need the logits of every prompt position)."""
        return (
            self.enable_prefix_caching
            and seq.num_computed == 0
            and not self.block_ids(seq)
            and seq.params.prompt_logprobs is None
        )

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The hashes of `seq`'s first `num_blocks` full blocks (computed once, extended as it grows)."""
        st = self._of(seq)
        bs, hashes = self.block_size, st.hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(hash_block(parent, seq.tokens[i * bs : (i + 1) * bs], st.key))
        return hashes[:num_blocks]

    def cache_blocks(self, seq: Sequence) -> None:
        """Cache the blocks of `seq` that are full and computed and not cached yet."""
        if not self.enable_prefix_caching:
            return
        st = self._reqs.get(seq.request_id)
        full = seq.num_computed // self.block_size
        if st is None or full <= st.num_cached:
            return
        hashes = self._hashes(seq, full)
        bs = self.block_size
        for i in range(st.num_cached, full):
            tokens = seq.tokens[i * bs : (i + 1) * bs]
            self.pool.cache(st.ids[i], hashes[i], hashes[i - 1] if i else None, tokens, seq.adapter)
        st.num_cached = full

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash; how many were dropped."""
        return self.pool.reset()

    # ------------------------------------------------------------------ events

    def flush_events(self) -> None:
        """Publish the KV events of the step that just ended (a no-op without a KV event stream)."""
        if self._events is not None:
            self._events.flush()

    def close(self) -> None:
        if self._events is not None:
            self._events.close()
            self._events = None
