"""LoRA batch info and the torch backend against a dense per-token reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lorafleet_worker.config import ModelConfig
from lorafleet_worker.lora.adapter import GROUPS, LoRAAdapter, LoRAModuleWeights, group_shapes
from lorafleet_worker.lora.backends import TorchLoRABackend, get_backend
from lorafleet_worker.lora.batch import build_batch_info
from lorafleet_worker.lora.pool import LoRAPool
from lorafleet_worker.lora.weights import LoRAProjWeights

CONFIG = ModelConfig.from_dict(
    {
        "model_type": "llama",
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,  # GQA: q slice 64 wide, k and v slices 16 wide
    }
)
MAX_RANK = 64


def random_adapter(ranks: dict[str, int], seed: int, config: ModelConfig = CONFIG) -> LoRAAdapter:
    """An adapter with the given rank per module name (missing names are not adapted)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = group_shapes(config)
    modules: dict[tuple[int, str], list[LoRAModuleWeights | None]] = {}
    for layer in range(config.num_hidden_layers):
        for group, names in GROUPS.items():
            shape = shapes[group]
            slices: list[LoRAModuleWeights | None] = []
            for name, width in zip(names, shape.slice_widths, strict=True):
                r = ranks.get(name, 0)
                a = torch.randn(r, shape.in_dim, generator=gen) / shape.in_dim**0.5
                b = torch.randn(width, r, generator=gen)
                slices.append(LoRAModuleWeights(A=a, B=b, scaling=0.5 + seed) if r else None)
            if any(slices):
                modules[(layer, group)] = slices
    return LoRAAdapter(path=Path(f"/adapters/{seed}"), modules=modules, max_rank=max(ranks.values()))


def dense_reference(x: torch.Tensor, slots: list[int], adapters: dict[int, LoRAAdapter], layer: int, group: str):
    """Per token: x @ (scaling * B @ A).T for each adapted slice of its slot's adapter."""
    shape = group_shapes(CONFIG)[group]
    offs = shape.slice_offsets
    out = torch.zeros(x.shape[0], offs[-1], dtype=torch.float64)
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        for s, m in enumerate(adapters[slot].modules.get((layer, group), [None] * len(shape.slice_widths))):
            if m is not None:
                w = m.scaling * (m.B.double() @ m.A.double())
                out[t, offs[s] : offs[s + 1]] = x[t].double() @ w.T
    return out


def test_batch_info_groups_tokens_stably() -> None:
    info = build_batch_info(torch.tensor([2, -1, 0, 2, 0, -1, 1, 2], dtype=torch.int32))
    assert info.sorted_token_ids.tolist() == [1, 5, 2, 4, 6, 0, 3, 7]
    assert info.seg_slots.tolist() == [0, 1, 2]
    assert info.seg_indptr.tolist() == [2, 4, 5, 8]
    assert info.segments == ((0, 2, 4), (1, 4, 5), (2, 5, 8))
    assert info.segment_rows == (-1, 6, -1)  # only slot 1's tokens are consecutive rows
    prefills = build_batch_info(torch.tensor([1, 1, 1, 0, 0, -1], dtype=torch.int32))
    assert prefills.segments == ((0, 1, 3), (1, 3, 6)) and prefills.segment_rows == (3, 0)
    assert (info.max_seg_len, info.num_tokens, info.has_lora) == (3, 8, True)
    assert info.sorted_token_ids.dtype == info.seg_indptr.dtype == info.seg_slots.dtype == torch.int32


def test_batch_info_without_adapters() -> None:
    info = build_batch_info(torch.full((5,), -1, dtype=torch.int32))
    assert not info.has_lora
    assert info.seg_indptr.tolist() == [0]
    assert info.seg_slots.numel() == 0 and info.max_seg_len == 0 and info.segments == ()
    empty = build_batch_info(torch.empty(0, dtype=torch.int32))
    assert (empty.num_tokens, empty.has_lora) == (0, False)


@pytest.fixture(scope="module")
def pool_and_adapters() -> tuple[LoRAPool, dict[int, LoRAAdapter]]:
    pool = LoRAPool(CONFIG, num_slots=4, max_rank=MAX_RANK)
    all7 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapters = {
        0: random_adapter(dict.fromkeys(all7, 64), seed=0),
        1: random_adapter(dict.fromkeys(all7, 4), seed=1),
        # mixed ranks inside one group; k and gate not adapted
        3: random_adapter({"q_proj": 16, "v_proj": 2, "up_proj": 8, "down_proj": 1}, seed=3),
    }
    for slot, adapter in adapters.items():
        pool.write_slot(slot, adapter)
    return pool, adapters


@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize(
    "slots",
    [
        [0, 1, -1, 3, 3, 0, -1, 1, 1, 0],  # mixed adapters and base-only tokens
        [3],  # one decode token
        [-1, -1, -1],  # base only: nothing added
        [1] * 7 + [0] * 5,  # prefill-like segments
    ],
)
def test_apply_matches_dense_reference(pool_and_adapters, group: str, slots: list[int]) -> None:
    pool, adapters = pool_and_adapters
    layer = 1
    w = pool.weights(layer, group)
    shape = group_shapes(CONFIG)[group]
    gen = torch.Generator().manual_seed(len(slots))
    x = torch.randn(len(slots), shape.in_dim, generator=gen)
    base = torch.randn(len(slots), shape.slice_offsets[-1], generator=gen)
    out = base.clone()
    backend = TorchLoRABackend()
    backend.apply(x, out, w, backend.prepare(torch.tensor(slots, dtype=torch.int32)))
    expected = base.double() + dense_reference(x, slots, adapters, layer, group)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    for t, slot in enumerate(slots):
        if slot < 0:
            assert torch.equal(out[t], base[t])


def test_apply_uses_only_each_adapters_rank(pool_and_adapters) -> None:
    """Entries past an adapter's rank are never read: poison them and the result is unchanged."""
    _, adapters = pool_and_adapters
    pool = LoRAPool(CONFIG, num_slots=4, max_rank=MAX_RANK)
    for slot, adapter in adapters.items():
        pool.write_slot(slot, adapter)
    w = pool.weights(0, "qkv")
    w.A[1, :, 4:] = float("nan")
    w.B[1, :, 4:] = float("nan")
    w.A[3, 1] = float("nan")  # k slice of slot 3 is not adapted (rank 0)
    slots = [1, 3, 1, -1]
    x = torch.randn(4, 64)
    out = torch.zeros(4, w.slice_offsets[-1])
    backend = TorchLoRABackend()
    backend.apply(x, out, w, backend.prepare(torch.tensor(slots)))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), dense_reference(x, slots, adapters, 0, "qkv"), rtol=1e-5, atol=1e-5)


def test_apply_in_bfloat16(pool_and_adapters) -> None:
    _, adapters = pool_and_adapters
    pool = LoRAPool(CONFIG, num_slots=4, max_rank=MAX_RANK, dtype=torch.bfloat16)
    for slot, adapter in adapters.items():
        pool.write_slot(slot, adapter)
    slots = [0, 3, -1, 1]
    x = torch.randn(4, 64)
    out = torch.zeros(4, 96, dtype=torch.bfloat16)
    backend = TorchLoRABackend()
    backend.apply(x.bfloat16(), out, pool.weights(0, "qkv"), backend.prepare(torch.tensor(slots)))
    ref = dense_reference(x, slots, adapters, 0, "qkv")
    torch.testing.assert_close(out.double(), ref, rtol=5e-2, atol=5e-2 * float(ref.abs().max()))


def test_proj_weights_layout(pool_and_adapters) -> None:
    pool, _ = pool_and_adapters
    w: LoRAProjWeights = pool.weights(0, "qkv")
    assert w.slice_offsets == (0, 64, 80, 96)
    assert tuple(w.A.shape) == (4, 3, MAX_RANK, 64)
    assert tuple(w.B.shape) == (4, 96, MAX_RANK)
    assert w.ranks.dtype == torch.int32 and w.scalings.dtype == torch.float32
    assert w.ranks.tolist() == [[64, 64, 64], [4, 4, 4], [0, 0, 0], [16, 0, 2]]
    assert pool.weights(1, "gate_up").slice_offsets == (0, 96, 192)
    assert pool.weights(1, "down").A.shape[-1] == 96


def test_get_backend() -> None:
    assert isinstance(get_backend("torch"), TorchLoRABackend)
    with pytest.raises(ValueError, match="unknown LoRA backend 'cuda'"):
        get_backend("cuda")
