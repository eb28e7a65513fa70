"""Block allocator, the KV cache manager's allocation and the KV block tensors."""

from __future__ import annotations

import pytest
import torch
from lorafleet_worker.config import ModelConfig
from lorafleet_worker.core.block_pool import BlockPool
from lorafleet_worker.core.kv_cache import PagedKVCache, block_table_tensor
from lorafleet_worker.core.kv_cache_manager import KVCacheManager
from lorafleet_worker.core.request import Sequence
from lorafleet_worker.sample.params import SamplingParams

CONFIG = ModelConfig.from_dict(
    {
        "model_type": "llama",
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
)


def test_allocator_is_all_or_nothing_and_reuses_freed_blocks() -> None:
    alloc = BlockPool(4)
    a = alloc.allocate(3)
    assert a is not None and len(set(a)) == 3 and alloc.num_free == 1
    assert alloc.allocate(2) is None and alloc.num_free == 1  # nothing taken on failure
    alloc.release(a)
    b = alloc.allocate(4)
    assert b is not None and sorted(b) == [0, 1, 2, 3] and alloc.num_free == 0


def test_allocator_rejects_double_free() -> None:
    alloc = BlockPool(2)
    blocks = alloc.allocate(1)
    assert blocks is not None
    alloc.release(blocks)
    with pytest.raises(RuntimeError, match="freed twice"):
        alloc.release(blocks)


def request(rid: str) -> Sequence:
    return Sequence.create(rid, [1, 2, 3], SamplingParams(), max_len=20)


def test_cache_layout() -> None:
    kv = PagedKVCache(CONFIG, num_blocks=5, block_size=4, device=torch.device("cpu"), dtype=torch.float16)
    assert len(kv.k_caches) == len(kv.v_caches) == 3
    assert kv.k_caches[0].shape == (5, 4, 2, 16) and kv.k_caches[0].dtype == torch.float16


def test_manager_allocates_all_or_nothing_and_frees_a_request() -> None:
    kv = KVCacheManager(5, 4)
    a, b = request("a"), request("b")
    assert kv.allocate(a, 1) and len(kv.block_ids(a)) == 1
    assert kv.allocate(a, 4) and len(kv.block_ids(a)) == 1  # still fits in the first block
    assert kv.allocate(a, 5) and len(kv.block_ids(a)) == 2
    assert not kv.allocate(b, 13) and kv.block_ids(b) == []  # needs 4 blocks, 3 free: unchanged
    assert kv.allocate(b, 12) and kv.num_free_blocks == 0
    assert sorted(kv.take_new_blocks()) == sorted([*kv.block_ids(a), *kv.block_ids(b)]) and kv.take_new_blocks() == []
    kv.free(a)
    assert kv.block_ids(a) == [] and kv.num_free_blocks == 2


def test_pool_is_not_filled_up_front_but_handed_out_blocks_are_zeroed() -> None:
    kv = PagedKVCache(CONFIG, num_blocks=6, block_size=4, device=torch.device("cpu"), dtype=torch.float32)
    assert kv.nbytes == 6 * PagedKVCache.bytes_per_block(CONFIG, 4, torch.float32)
    assert all(torch.all(t[0] == 0) for t in (*kv.k_caches, *kv.v_caches))  # block 0 pads block tables
    for t in (*kv.k_caches, *kv.v_caches):  # what uninitialised memory may hold
        t.fill_(float("nan"))
    manager = KVCacheManager(6, 4)
    assert manager.allocate(request("one"), 3)  # one block
    kv.zero(manager.take_new_blocks())
    assert manager.allocate(request("many"), 12)  # three blocks at once
    kv.zero(manager.take_new_blocks())
    handed_out = [*manager.block_ids(request("one")), *manager.block_ids(request("many"))]
    rest = sorted(set(range(6)) - set(handed_out))
    for t in (*kv.k_caches, *kv.v_caches):
        assert torch.all(t[handed_out] == 0)
        assert torch.isnan(t[rest]).all()  # not touched: no pass over the whole pool


def test_block_table_tensor_pads_with_zero() -> None:
    t = block_table_tensor([[3, 1], [2], []], torch.device("cpu"))
    assert t.dtype == torch.int32
    assert t.tolist() == [[3, 1], [2, 0], [0, 0]]
