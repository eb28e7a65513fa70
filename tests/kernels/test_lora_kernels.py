"""Triton multi-LoRA shrink/expand vs the torch backend and an fp64 dense reference."""

from __future__ import annotations

import os

import pytest
import torch
from lorafleet_worker.kernels.lora import Segments, lora_expand, lora_shrink
from lorafleet_worker.lora.backends import TorchLoRABackend
from lorafleet_worker.lora.backends.triton import TritonLoRABackend
from lorafleet_worker.lora.batch import build_batch_info
from lorafleet_worker.lora.weights import LoRAProjWeights
from torch import Tensor

from bench.kernel_inputs import random_proj_weights

TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 6e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LAYOUTS = {"segmented": 0, "gathered": 1 << 30, "auto": None}

# qkv of a GQA layer: q 48 wide, k/v 16 wide; in_dim 40 is not a multiple of any block size.
QKV_WIDTHS = (48, 16, 16)
# slot 0 rank 1, slot 1 rank 64, slot 2 has an unadapted slice (rank 0), slot 3 mixed ranks, slot 4 unused.
QKV_RANKS = [[1, 1, 1], [64, 64, 64], [8, 0, 8], [33, 17, 5], [16, 16, 16]]
# ragged: slot 1 x 9, slot 3 x 4, slot 2 x 3, slot 0 x 1 (one token), 5 base-only tokens, slot 4 absent.
TOKEN_SLOTS = [1, -1, 3, 1, 1, 2, -1, 0, 1, 3, 1, -1, 2, 1, 3, 1, -1, 2, 1, 3, 1, -1]


def dense_reference(x: Tensor, out: Tensor, w: LoRAProjWeights, token_slots: list[int]) -> Tensor:
    """out + LoRA delta in float64, straight from the definition in docs/DESIGN.md."""
    ref = out.double().clone()
    offs = w.slice_offsets
    for t, slot in enumerate(token_slots):
        for s in range(w.n_slices):
            r = int(w.ranks[slot, s]) if slot >= 0 else 0
            if r == 0:
                continue
            a = w.A[slot, s, :r].double()
            b = w.B[slot, offs[s] : offs[s + 1], :r].double()
            ref[t, offs[s] : offs[s + 1]] += float(w.scalings[slot, s]) * (b @ (a @ x[t].double()))
    return ref


def run_backend(backend: object, x: Tensor, out0: Tensor, w: LoRAProjWeights, token_slots: list[int]) -> Tensor:
    out = out0.clone()
    info = backend.prepare(torch.tensor(token_slots, dtype=torch.int32, device=x.device))  # type: ignore[attr-defined]
    backend.apply(x, out, w, info)  # type: ignore[attr-defined]
    return out


def inputs(
    num_tokens: int, in_dim: int, out_total: int, dtype: torch.dtype, device: torch.device, seed: int = 1
) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, in_dim, generator=gen).to(device, dtype)
    out0 = torch.randn(num_tokens, out_total, generator=gen).to(device, dtype)
    return x, out0


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_qkv_mixed_ranks_matches_torch_backend(dtype: torch.dtype, layout: str, device: torch.device) -> None:
    w = random_proj_weights(in_dim=40, widths=QKV_WIDTHS, ranks=QKV_RANKS, max_rank=64, dtype=dtype, device=device)
    x, out0 = inputs(len(TOKEN_SLOTS), 40, w.slice_offsets[-1], dtype, device)
    limit = LAYOUTS[layout]
    backend = (
        TritonLoRABackend() if limit is None else TritonLoRABackend(gathered_max_seg_len=limit, gathered_max_tokens=0)
    )
    got = run_backend(backend, x, out0, w, TOKEN_SLOTS)
    expected = run_backend(TorchLoRABackend(device), x, out0, w, TOKEN_SLOTS)
    truth = dense_reference(x, out0, w, TOKEN_SLOTS)

    assert torch.isfinite(got).all(), "the kernel read weights beyond an adapter's rank"
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), truth, atol=tol, rtol=tol)
    torch.testing.assert_close(got.float(), expected.float(), atol=2 * tol, rtol=2 * tol)
    base_rows = [t for t, s in enumerate(TOKEN_SLOTS) if s < 0]
    assert torch.equal(got[base_rows], out0[base_rows]), "base-only tokens must get no delta"
    # slot 2 does not adapt the k slice: its k columns are untouched
    k_cols = slice(w.slice_offsets[1], w.slice_offsets[2])
    slot2_rows = [t for t, s in enumerate(TOKEN_SLOTS) if s == 2]
    assert torch.equal(got[slot2_rows, k_cols], out0[slot2_rows, k_cols])
    assert not torch.equal(got[slot2_rows], out0[slot2_rows])


def test_backend_picks_layout_by_batch_shape() -> None:
    backend = TritonLoRABackend()
    decode = build_batch_info(torch.tensor([0, 1, 2, 3, -1, 0], dtype=torch.int32))
    shared_decode = build_batch_info(torch.full((64,), 3, dtype=torch.int32))  # 64 sequences, one adapter
    prefill = build_batch_info(torch.tensor([0] * 300 + [1], dtype=torch.int32))
    assert backend.use_gathered(decode)
    assert backend.use_gathered(shared_decode), "a decode batch of one adapter must not run a handful of programs"
    assert not backend.use_gathered(prefill)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_gate_up_long_segments_several_tiles(dtype: torch.dtype, device: torch.device) -> None:
    """Prefill-like: two adapters with 70 and 5 tokens (several BLOCK_M tiles), in_dim 200 (several K blocks)."""
    ranks = [[64, 64], [7, 7]]
    w = random_proj_weights(in_dim=200, widths=(72, 72), ranks=ranks, max_rank=64, dtype=dtype, device=device, seed=3)
    slots = [0] * 35 + [1] * 5 + [-1] * 3 + [0] * 35
    x, out0 = inputs(len(slots), 200, 144, dtype, device, seed=4)
    got = run_backend(TritonLoRABackend(gathered_max_seg_len=0, gathered_max_tokens=0), x, out0, w, slots)
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), dense_reference(x, out0, w, slots), atol=tol, rtol=tol)


def test_empty_segments_and_rank_blocks_are_skipped(device: torch.device) -> None:
    """Kernel level: an empty segment writes nothing; rank blocks beyond a rank are never written or read."""
    ranks = [[20, 3], [0, 0], [1, 64]]
    w = random_proj_weights(in_dim=33, widths=(24, 40), ranks=ranks, max_rank=64, dtype=torch.float32, device=device)
    slots = [2, 0, 0, 2, 0]
    # segments: slot 1 (empty), slot 0 = tokens 1, 2, 4, slot 2 = tokens 0, 3; slot 1's ranks are 0 anyway
    seg = Segments(
        sorted_token_ids=torch.tensor([1, 2, 4, 0, 3], dtype=torch.int32, device=device),
        seg_indptr=torch.tensor([0, 0, 3, 5], dtype=torch.int32, device=device),
        seg_slots=torch.tensor([1, 0, 2], dtype=torch.int32, device=device),
        max_seg_len=3,
    )
    x, out0 = inputs(len(slots), 33, 64, torch.float32, device, seed=5)
    offsets = torch.tensor(w.slice_offsets, dtype=torch.int32, device=device)
    for layout in ({"segments": seg}, {"token_slots": torch.tensor(slots, dtype=torch.int32, device=device)}):
        xa = torch.full((len(slots), 2, 64), float("nan"), device=device)
        lora_shrink(x, w.A, w.ranks, xa, **layout)
        written = ~torch.isnan(xa.cpu())
        for t, slot in enumerate(slots):
            for s in range(2):
                r = ranks[slot][s]
                assert written[t, s, :r].all()
                assert not written[t, s, r:].any(), "nothing past the adapter's rank is written"
        out = out0.clone()
        lora_expand(xa, w.B, w.ranks, w.scalings, offsets, 40, out, **layout)
        torch.testing.assert_close(out.double(), dense_reference(x, out0, w, slots), atol=1e-4, rtol=1e-4)


def test_base_only_batch_is_untouched(device: torch.device) -> None:
    w = random_proj_weights(in_dim=16, widths=(16,), ranks=[[4]], max_rank=16, dtype=torch.float16, device=device)
    x, out0 = inputs(6, 16, 16, torch.float16, device)
    slots = [-1] * 6
    for limit in (0, 1 << 30):
        assert torch.equal(run_backend(TritonLoRABackend(limit, 0), x, out0, w, slots), out0)
    xa = torch.empty(6, 1, 16, device=device)
    out = out0.clone()
    token_slots = torch.tensor(slots, dtype=torch.int32, device=device)
    lora_shrink(x, w.A, w.ranks, xa, token_slots=token_slots)
    lora_expand(
        xa,
        w.B,
        w.ranks,
        w.scalings,
        torch.tensor([0, 16], dtype=torch.int32, device=device),
        16,
        out,
        token_slots=token_slots,
    )
    assert torch.equal(out, out0)


def test_activations_in_another_dtype_than_the_pool(device: torch.device) -> None:
    """fp32 activations and output over an fp16 slot pool: converted, delta added in the output's dtype."""
    w = random_proj_weights(
        in_dim=24, widths=(16, 16), ranks=[[4, 2], [16, 0]], max_rank=16, dtype=torch.float16, device=device
    )
    slots = [0, 1, -1, 1, 0]
    x, out0 = inputs(len(slots), 24, 32, torch.float32, device)
    got = run_backend(TritonLoRABackend(), x, out0, w, slots)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), dense_reference(x, out0, w, slots), atol=1e-2, rtol=1e-2)


def test_bad_inputs_are_rejected(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    w = random_proj_weights(in_dim=16, widths=(16,), ranks=[[4]], max_rank=16, dtype=torch.float16, device=device)
    slots = torch.zeros(2, dtype=torch.int32, device=device)
    xa = torch.empty(2, 1, 16, device=device)
    with pytest.raises(ValueError, match="same dtype"):
        lora_shrink(torch.zeros(2, 16, device=device), w.A, w.ranks, xa, token_slots=slots)
    with pytest.raises(ValueError, match=r"\[T, 16\]"):
        lora_shrink(torch.zeros(2, 17, dtype=torch.float16, device=device), w.A, w.ranks, xa, token_slots=slots)
    with pytest.raises(ValueError, match="exactly one"):
        lora_shrink(torch.zeros(2, 16, dtype=torch.float16, device=device), w.A, w.ranks, xa)
    cpu = random_proj_weights(in_dim=16, widths=(16,), ranks=[[4]], max_rank=16, dtype=torch.float16)
    monkeypatch.setitem(os.environ, "TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        lora_shrink(
            torch.zeros(2, 16, dtype=torch.float16),
            cpu.A,
            cpu.ranks,
            torch.empty(2, 1, 16),
            token_slots=torch.zeros(2, dtype=torch.int32),
        )


@pytest.mark.gpu_large
@pytest.mark.parametrize("num_tokens", [64, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_llama_sized_qkv(dtype: torch.dtype, num_tokens: int, device: torch.device) -> None:
    ranks = [[64 if i % 2 else 8] * 3 for i in range(16)]
    w = random_proj_weights(
        in_dim=4096, widths=(4096, 1024, 1024), ranks=ranks, max_rank=64, dtype=dtype, device=device
    )
    gen = torch.Generator().manual_seed(0)
    slots = torch.randint(-1, 16, (num_tokens,), generator=gen).tolist()
    x, out0 = inputs(num_tokens, 4096, 6144, dtype, device)
    got = run_backend(TritonLoRABackend(), x, out0, w, slots)
    expected = run_backend(TorchLoRABackend(device), x, out0, w, slots)
    torch.testing.assert_close(got.float(), expected.float(), atol=2 * TOL[dtype], rtol=2 * TOL[dtype])
