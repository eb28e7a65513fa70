"""Prefix caching bookkeeping: the block pool (ref counts, hashes, LRU of cached free blocks) and the KV cache
manager's lookups as the scheduler admits requests (adapter identity, the last token, prompt logprobs, preemption)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lorafleet_worker.config import ModelConfig
from lorafleet_worker.core.block_pool import ROOT_HASH, BlockPool, hash_block
from lorafleet_worker.core.kv_cache_manager import KVCacheManager
from lorafleet_worker.core.request import SeqStatus, Sequence
from lorafleet_worker.core.scheduler import Output, Scheduler
from lorafleet_worker.core.step import RunnerOutput, StepPlan
from lorafleet_worker.lora.manager import AdapterManager
from lorafleet_worker.sample.params import SampledToken, SamplingParams, TokenOutput

CPU = torch.device("cpu")
BS = 4


def h(i: int) -> bytes:
    return hash_block(ROOT_HASH, [i] * BS, b"")


def test_hash_chains_parent_tokens_and_adapter_identity() -> None:
    first = hash_block(ROOT_HASH, [1, 2, 3, 4], b"")
    assert first == hash_block(ROOT_HASH, [1, 2, 3, 4], b"")
    assert first != hash_block(ROOT_HASH, [1, 2, 3, 5], b"")
    assert first != hash_block(ROOT_HASH, [1, 2, 3, 4], b"a\0" + bytes(32))
    assert hash_block(ROOT_HASH, [1], b"a\0" + bytes(32)) != hash_block(ROOT_HASH, [1], b"a\0" + bytes(31) + b"\1")
    assert hash_block(first, [5, 6, 7, 8], b"") != hash_block(ROOT_HASH, [5, 6, 7, 8], b"")


def test_cached_blocks_are_found_after_release_until_evicted_least_recently_used_first() -> None:
    events: list[tuple[Any, ...]] = []
    pool = BlockPool(4)
    pool.on_event = events.append
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert a is not None and b is not None and pool.num_free == 0
    for i, blk in enumerate(a + b):
        assert pool.cache(blk, h(i), None, [i] * BS, "x")
    assert not pool.cache(a[0], h(9), None, [9] * BS, None)  # already cached under another hash
    pool.release(a)
    pool.release(b)
    assert pool.num_free == 4 and pool.num_cached == 4  # cached blocks nobody holds count as free
    assert pool.lookup([h(0), h(1), h(7)]) == a  # longest cached prefix
    pool.hold(a[:1])  # a[0] is used again: most recently used
    assert pool.num_free == 3
    fresh = pool.allocate(2)  # evicts in LRU order: released last-block-first, so a[1] then b[1]
    assert fresh == [a[1], b[1]] and pool.num_cached == 2 and pool.evictions == 2
    assert pool.lookup([h(0), h(1)]) == [a[0]]
    assert [e[0] for e in events] == ["stored"] * 4 + ["removed"] * 2
    assert events[4] == ("removed", h(1))


def test_free_blocks_without_a_hash_are_handed_out_before_cached_ones() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    assert blocks is not None
    pool.cache(blocks[0], h(0), None, [0] * BS, None)
    pool.release(blocks)
    assert sorted(pool.allocate(2) or []) == sorted(blocks[1:]) and pool.lookup([h(0)]) == [blocks[0]]


def test_shared_blocks_are_freed_by_their_last_holder_and_double_release_fails() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    assert blocks is not None
    pool.cache(blocks[0], h(0), None, [0] * BS, None)
    pool.hold(blocks)
    assert pool.num_unheld(blocks) == 0
    pool.release(blocks)
    assert pool.num_free == 1
    pool.release(blocks)
    assert pool.num_free == 2 and pool.num_unheld(blocks) == 1
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.release(blocks)


def test_reset_forgets_every_hash() -> None:
    events: list[tuple[Any, ...]] = []
    pool = BlockPool(2)
    pool.on_event = events.append
    blocks = pool.allocate(2)
    assert blocks is not None
    pool.cache(blocks[0], h(0), None, [0] * BS, None)
    pool.release(blocks)
    assert pool.reset() == 1 and pool.lookup([h(0)]) == [] and pool.num_free == 2
    assert events[-1] == ("cleared",)


# ------------------------------------------------------------------------------------------- scheduler


@pytest.fixture
def manager(config: ModelConfig, tiny_models: Any, tiny_adapter_factory: Any) -> AdapterManager:
    m = AdapterManager(config, max_loras=2, max_cpu_loras=4, max_lora_rank=64, device=CPU)
    m.load("a", tiny_adapter_factory(tiny_models["llama"], rank=4, seed=1))
    m.load("b", tiny_adapter_factory(tiny_models["llama"], rank=8, seed=2))
    return m


def scheduler(manager: Any = None, num_blocks: int = 32, *, enable_prefix_caching: bool = True, **kw: Any) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=enable_prefix_caching)
    opts: dict[str, Any] = {"max_num_seqs": 8, "max_num_batched_tokens": 64}
    return Scheduler(kv, manager, **{**opts, **kw})


def make_seq(rid: str, prompt: list[int], manager: Any = None, adapter: str | None = None, **params: Any) -> Sequence:
    ref = manager.acquire(adapter) if adapter else None
    p = SamplingParams(**{"max_tokens": 4, **params})
    return Sequence.create(rid, prompt, p, max_len=len(prompt) + p.max_tokens, adapter=adapter, ref=ref)


def step(sched: Scheduler, plan: StepPlan, tokens: dict[str, int] | None = None) -> list[Output]:
    """The step's forward pass as the scheduler sees it: each chunk that generates samples `tokens[id]` (else 0)."""
    tokens = tokens or {}
    sampled = {
        c.seq.request_id: SampledToken(tokens.get(c.seq.request_id, 0), 0.0, None) for c in plan.chunks if c.generates
    }
    return sched.update_from_output(plan, RunnerOutput(sampled=sampled))


def run_to_end(sched: Scheduler, seq: Sequence) -> None:
    """Schedule and update until `seq` ends (every sampled token is 0)."""
    sched.add_request(seq)
    while seq.status is not SeqStatus.FINISHED:
        step(sched, sched.schedule())


def first_chunk(sched: Scheduler, seq: Sequence) -> tuple[int, int]:
    """(tokens found in the cache, tokens scheduled) when `seq` is admitted."""
    if seq.request_id not in sched.requests:
        sched.add_request(seq)
    plan = sched.schedule()
    chunk = next(c for c in plan.chunks if c.seq is seq)
    return seq.num_computed, chunk.num_tokens


PROMPT = list(range(1, 15))  # 14 tokens: three full blocks and two tokens


def test_update_owns_sequence_state_and_caches_filled_blocks() -> None:
    sched = scheduler(eos_token_ids=[7])
    seq = make_seq("s", PROMPT, max_tokens=3)
    sched.add_request(seq)
    out = step(sched, sched.schedule(), {"s": 5})
    assert out == [("s", TokenOutput(5, 0.0, None, None))]
    assert sched.stats.prompt_tokens == 14 and seq.num_computed == 14 and seq.tokens[-1] == 5
    assert sched.kv_cache.num_cached_blocks(seq) == 3 and sched.kv_cache.pool.num_cached == 3
    out = step(sched, sched.schedule(), {"s": 7})  # eos
    assert out == [("s", TokenOutput(7, 0.0, None, "stop"))]
    assert seq.status is SeqStatus.FINISHED and seq.finish_reason == "stop" and sched.stats.requests_finished == 1
    assert sched.kv_cache.num_free_blocks == 32


def test_a_second_request_starts_from_the_cached_prefix_of_its_own_adapter_only(
    config: ModelConfig, manager: AdapterManager
) -> None:
    sched = scheduler(manager)
    run_to_end(sched, make_seq("first", PROMPT, manager, "a"))
    assert first_chunk(sched, make_seq("same", PROMPT, manager, "a")) == (12, 2)
    assert first_chunk(sched, make_seq("other-adapter", PROMPT, manager, "b")) == (0, 14)
    assert first_chunk(sched, make_seq("base", PROMPT)) == (0, 14)
    assert sched.kv_cache.prefix_cache_queries == 4 * 14 and sched.kv_cache.prefix_cache_hits == 12


def test_the_last_token_is_always_computed() -> None:
    sched = scheduler()
    prompt = list(range(1, 13))  # exactly three blocks
    run_to_end(sched, make_seq("first", prompt))
    assert first_chunk(sched, make_seq("again", prompt)) == (8, 4)  # the third block is recomputed


def test_prompt_logprobs_requests_compute_the_whole_prompt() -> None:
    sched = scheduler()
    run_to_end(sched, make_seq("first", PROMPT))
    assert first_chunk(sched, make_seq("echo", PROMPT, prompt_logprobs=0)) == (0, 14)


def test_disabled_caching_finds_nothing() -> None:
    sched = scheduler(enable_prefix_caching=False)
    run_to_end(sched, make_seq("first", PROMPT))
    assert first_chunk(sched, make_seq("again", PROMPT)) == (0, 14)
    assert sched.kv_cache.pool.num_cached == 0 and sched.kv_cache.prefix_cache_queries == 0


def test_a_preempted_sequence_finds_its_blocks_again() -> None:
    sched = scheduler(num_blocks=8)
    sched.watermark_blocks = 0
    old, new = make_seq("old", list(range(1, 17)), max_tokens=40), make_seq("new", list(range(50, 62)), max_tokens=40)
    sched.add_request(old)
    sched.add_request(new)
    step(sched, sched.schedule())  # 4 + 3 blocks
    assert sched.kv_cache.num_cached_blocks(new) == 3
    while new.status is SeqStatus.RUNNING:  # old grows until new is preempted
        step(sched, sched.schedule())
    assert sched.num_preemptions == 1 and new.num_computed == 0
    sched.finish_requests(["old"], "stop")
    computed, scheduled = first_chunk(sched, new)
    assert computed >= 12 and computed + scheduled == len(new.tokens)  # the prompt's blocks were kept
