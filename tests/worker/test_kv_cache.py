"""Block allocator and paged KV cache bookkeeping."""

from __future__ import annotations

import pytest
import torch
from lorafleet_worker.config import ModelConfig
from lorafleet_worker.core.kv_cache import BlockPool, PagedKVCache, block_table_tensor

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


def test_cache_layout_and_grow_release() -> None:
    kv = PagedKVCache(CONFIG, num_blocks=5, block_size=4, device=torch.device("cpu"), dtype=torch.float16)
    assert len(kv.k_caches) == len(kv.v_caches) == 3
    assert kv.k_caches[0].shape == (5, 4, 2, 16) and kv.k_caches[0].dtype == torch.float16
    blocks: list[int] = []
    assert kv.grow(blocks, 1) and len(blocks) == 1
    assert kv.grow(blocks, 4) and len(blocks) == 1  # still fits in the first block
    assert kv.grow(blocks, 5) and len(blocks) == 2
    other: list[int] = []
    assert not kv.grow(other, 13) and other == []  # needs 4 blocks, 3 free: unchanged
    assert kv.grow(other, 12) and kv.pool.num_free == 0
    kv.release(blocks)
    assert blocks == [] and kv.pool.num_free == 2


def test_pool_is_not_filled_up_front_but_handed_out_blocks_are_zeroed() -> None:
    kv = PagedKVCache(CONFIG, num_blocks=6, block_size=4, device=torch.device("cpu"), dtype=torch.float32)
    assert kv.nbytes == 6 * PagedKVCache.bytes_per_block(CONFIG, 4, torch.float32)
    assert all(torch.all(t[0] == 0) for t in (*kv.k_caches, *kv.v_caches))  # block 0 pads block tables
    for t in (*kv.k_caches, *kv.v_caches):  # what uninitialised memory may hold
        t.fill_(float("nan"))
    one: list[int] = []
    assert kv.grow(one, 3)  # one block
    many: list[int] = []
    assert kv.grow(many, 12)  # three blocks at once
    handed_out = [*one, *many]
    rest = sorted(set(range(6)) - set(handed_out))
    for t in (*kv.k_caches, *kv.v_caches):
        assert torch.all(t[handed_out] == 0)
        assert torch.isnan(t[rest]).all()  # not touched: no pass over the whole pool


def test_block_table_tensor_pads_with_zero() -> None:
    t = block_table_tensor([[3, 1], [2], []], torch.device("cpu"))
    assert t.dtype == torch.int32
    assert t.tolist() == [[3, 1], [2, 0], [0, 0]]
