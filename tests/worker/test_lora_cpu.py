"""The CPU LoRA paths: the C++ grouped kernel (`cpu_lora`) and the per-adapter torch fallback, against a dense
reference: mixed ranks, adapters missing some target modules, per-module scalings, base-only rows, prefill
segments beside decode tokens, both B layouts, float32 and bfloat16, no thread-count changes."""

from __future__ import annotations

import pytest
import torch
from lorafleet_worker.lora.adapter import GROUPS, LoRAAdapter, group_shapes
from lorafleet_worker.lora.backends import TorchLoRABackend, get_backend
from lorafleet_worker.lora.backends import cpu as backend_mod
from lorafleet_worker.lora.backends.cpu import SMALL_SEGMENT, CpuLoRABackend, make_plan
from lorafleet_worker.lora.pool import LoRAPool
from lorafleet_worker.ops import cpu_lora

from bench.kernel_inputs import random_proj_weights
from tests.worker.test_lora_backend import CONFIG, MAX_RANK, dense_reference, random_adapter

needs_kernel = pytest.mark.skipif(not cpu_lora.available(), reason="the CPU LoRA kernel does not build here")
PATHS = [pytest.param("cpp", marks=needs_kernel), "torch"]

# slot 0: all seven at rank 64; slot 1: rank 4; slot 2: q/v only (PEFT's default) at ranks 8 and 16;
# slot 3: mixed ranks, k/gate/o not adapted. Scalings differ per adapter (0.5 + seed) and per module below.
ALL7 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANKS = {
    0: dict.fromkeys(ALL7, 64),
    1: dict.fromkeys(ALL7, 4),
    2: {"q_proj": 8, "v_proj": 16},
    3: {"q_proj": 16, "v_proj": 2, "up_proj": 8, "down_proj": 1},
}
LARGE = SMALL_SEGMENT + 3
LAYOUTS = {
    # decode tokens of every adapter, scattered, with base-only rows between them
    "decode": [0, 1, -1, 3, 3, 0, -1, 1, 1, 0, 2, -1, 2],
    # a prefill chunk of slot 1 (consecutive rows, > SMALL_SEGMENT) beside scattered decodes and base rows
    "prefill+decode": [0, -1, 3, *[1] * LARGE, 2, -1, 0, 3],
    # slot 0's tokens are many (a large segment) but not consecutive: gathered, updated, scattered back
    "large-scattered": [0, 2] * LARGE + [-1, 3],
    # exactly SMALL_SEGMENT tokens (small) and SMALL_SEGMENT + 1 (large), consecutive
    "boundary": [2] * SMALL_SEGMENT + [3] * (SMALL_SEGMENT + 1),
    "one-token": [3],
    "base-only": [-1, -1, -1],
}


@pytest.fixture(scope="module")
def pool_and_adapters() -> tuple[LoRAPool, dict[int, LoRAAdapter]]:
    pool = LoRAPool(CONFIG, num_slots=5, max_rank=MAX_RANK)
    adapters = {slot: random_adapter(ranks, seed=slot) for slot, ranks in RANKS.items()}
    # per-module scalings (alpha patterns, rsLoRA's alpha/sqrt(r)): a different one for every module
    for slot, adapter in adapters.items():
        for (layer, _group), mods in adapter.modules.items():
            for s, m in enumerate(mods):
                if m is not None:
                    mods[s] = type(m)(A=m.A, B=m.B, scaling=0.25 + 0.1 * slot + 0.05 * s + 0.01 * layer)
        pool.write_slot(slot, adapter)
    return pool, adapters


def backend_for(path: str) -> TorchLoRABackend:
    backend = CpuLoRABackend() if path == "cpp" else TorchLoRABackend()
    assert backend.grouped == path
    return backend


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_dense_reference(pool_and_adapters, path: str, group: str, layout: str) -> None:
    pool, adapters = pool_and_adapters
    slots = LAYOUTS[layout]
    shape = group_shapes(CONFIG)[group]
    gen = torch.Generator().manual_seed(len(slots))
    x = torch.randn(len(slots), shape.in_dim, generator=gen)
    base = torch.randn(len(slots), shape.slice_offsets[-1], generator=gen)
    out = base.clone()
    backend = backend_for(path)
    backend.apply(x, out, pool.weights(1, group), backend.prepare(torch.tensor(slots, dtype=torch.int32)))
    expected = base.double() + dense_reference(x, slots, adapters, 1, group)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    for t, slot in enumerate(slots):
        if slot < 0 or adapters[slot].modules.get((1, group)) is None:
            assert torch.equal(out[t], base[t]), "a token without this group's adapter must get no delta"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", ["decode", "prefill+decode", "large-scattered"])
@pytest.mark.parametrize("bf16_units", [True, False], ids=["bf16-matmul", "no-bf16-matmul"])
def test_bfloat16(pool_and_adapters, path: str, layout: str, bf16_units: bool, monkeypatch) -> None:
    """Without bfloat16 matmul units the kernel takes the large segments too (no per-adapter matmul)."""
    monkeypatch.setattr(backend_mod, "cpu_bf16_flag", lambda: "avx512_bf16" if bf16_units else None)
    per_adapter = []
    original = TorchLoRABackend._per_adapter
    monkeypatch.setattr(TorchLoRABackend, "_per_adapter", lambda self, *a: per_adapter.append(1) or original(self, *a))
    _, adapters = pool_and_adapters
    pool = LoRAPool(CONFIG, num_slots=5, max_rank=MAX_RANK, dtype=torch.bfloat16)
    for slot, adapter in adapters.items():
        pool.write_slot(slot, adapter)
    slots = LAYOUTS[layout]
    x = torch.randn(len(slots), 64, generator=torch.Generator().manual_seed(3))
    out = torch.zeros(len(slots), 96, dtype=torch.bfloat16)
    backend = backend_for(path)
    backend.apply(x.bfloat16(), out, pool.weights(0, "qkv"), backend.prepare(torch.tensor(slots)))
    ref = dense_reference(x, slots, adapters, 0, "qkv")
    torch.testing.assert_close(out.double(), ref, rtol=5e-2, atol=5e-2 * float(ref.abs().max()))
    large = layout != "decode"
    assert bool(per_adapter) == (path == "torch" or (large and bf16_units)), per_adapter  # torch: every segment


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_reads_either_b_layout_and_nothing_past_a_rank(dtype: torch.dtype) -> None:
    """Stacked weights as the Triton tests build them (B [slot, out, rank], entries past each rank NaN) and the
    same weights in the CPU pool's rank-major layout give the per-adapter result, and no NaN."""
    ranks = [[1, 1, 1], [64, 64, 64], [8, 0, 8], [33, 17, 5]]
    w = random_proj_weights(in_dim=40, widths=(48, 16, 16), ranks=ranks, max_rank=64, dtype=dtype)
    rank_major = type(w)(**{**w.__dict__, "B": w.B.transpose(1, 2).contiguous().transpose(1, 2)})
    assert rank_major.B.stride(1) == 1 and w.B.stride(2) == 1
    slots = [1, -1, 3, 1, 1, 2, -1, 0, 1, 3, 1, -1, 2, 1, 3, 1, -1, 2, 1, 3, 1, -1]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(len(slots), 40, generator=gen).to(dtype)
    out0 = torch.randn(len(slots), 80, generator=gen).to(dtype)
    info = torch.tensor(slots, dtype=torch.int32)
    results = []
    for weights, path in ((w, "cpp"), (rank_major, "cpp"), (w, "torch")):
        out = out0.clone()
        backend = backend_for(path)
        backend.apply(x, out, weights, backend.prepare(info))
        assert torch.isfinite(out).all(), f"{path} read entries past an adapter's rank"
        results.append(out.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(results[0], results[2], rtol=tol, atol=tol * float(results[2].abs().max()))
    torch.testing.assert_close(results[1], results[2], rtol=tol, atol=tol * float(results[2].abs().max()))


def per_adapter_reference(x: torch.Tensor, w, slots: list[int]) -> torch.Tensor:
    """Every token's LoRA delta in float64 from the stacked weights (ranks and scalings read per slot/slice)."""
    ref = torch.zeros(x.shape[0], w.slice_offsets[-1], dtype=torch.float64)
    for t, slot in enumerate(slots):
        for s in range(w.n_slices):
            r, lo, hi = int(w.ranks[slot, s]), w.slice_offsets[s], w.slice_offsets[s + 1]
            if slot >= 0 and r:
                a, b = w.A[slot, s, :r].double(), w.B[slot, lo:hi, :r].double()
                ref[t, lo:hi] = float(w.scalings[slot, s]) * (b @ (a @ x[t].double()))
    return ref


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("in_dim", [64, 40, 44], ids=["inputs-by-32", "inputs-by-8", "inputs-with-a-tail"])
def test_kernel_tiles_and_their_edges(dtype: torch.dtype, in_dim: int) -> None:
    """The kernel's register tiles and the loops around them: segments of 1-9 tokens (blocks of 1-4), a
    119-token prompt chunk (items of 64 and 55 tokens), odd ranks (a tile's second row past the rank),
    slices 40 and 24 wide (column tails past the 16-column tiles), inputs a multiple of 32 (bfloat16 pairs
    with AVX512-BF16) or of 8 (float tiles) or neither (the portable shrink), both B layouts: all equal the
    float64 per-adapter result, rows without an adapter untouched."""
    ranks = [[1, 3], [64, 0], [7, 33], [16, 16]]
    w = random_proj_weights(in_dim=in_dim, widths=(40, 24), ranks=ranks, max_rank=64, dtype=dtype, seed=2)
    rank_major = type(w)(**{**w.__dict__, "B": w.B.transpose(1, 2).contiguous().transpose(1, 2)})
    slots = [0] * 3 + [-1] + [1] * 9 + [2] * 119 + [3] + [-1] * 2 + [3] * 6 + [1] * 2 + [0] * 4
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(len(slots), in_dim, generator=gen).to(dtype)
    base = torch.randn(len(slots), 64, generator=gen).to(dtype)
    expected = base.double() + per_adapter_reference(x, w, slots)
    for weights in (w, rank_major):
        out = base.clone()
        backend = backend_for("cpp")
        info = backend.prepare(torch.tensor(slots, dtype=torch.int32))
        assert not info.host_plan.large  # every segment (at most SMALL_SEGMENT tokens) goes to the kernel
        backend.apply(x, out, weights, info)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol * float(expected.abs().max()))
        assert torch.equal(out[3], base[3]) and torch.equal(out[133:135], base[133:135])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("in_dim", [64, 40, 44], ids=["inputs-by-32", "inputs-by-8", "inputs-with-a-tail"])
@pytest.mark.parametrize("slots", [[2], [1, -1, 3, 0, 2], [-1, 3, -1]], ids=["one-user", "one-token-each", "base-rows"])
def test_kernel_one_token_segments(dtype: torch.dtype, in_dim: int, slots: list[int]) -> None:
    """Steps whose every segment is one token (one user's decode, each adapter's single decode row) take the
    kernel's one-token path: odd ranks (a shrink tile past the rank; an expand pair past it in bfloat16 with
    AVX512-BF16), rank 0 slices, slices 77 and 19 wide (64-column and 8-column expand chunks, or 128- and 32-column
    blocks in bfloat16 pairs, then single columns), both B layouts: equal to the float64
    per-adapter result, rows without an adapter untouched."""
    ranks = [[1, 3], [64, 0], [7, 33], [16, 16]]
    w = random_proj_weights(in_dim=in_dim, widths=(77, 19), ranks=ranks, max_rank=64, dtype=dtype, seed=3)
    rank_major = type(w)(**{**w.__dict__, "B": w.B.transpose(1, 2).contiguous().transpose(1, 2)})
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(len(slots), in_dim, generator=gen).to(dtype)
    base = torch.randn(len(slots), 96, generator=gen).to(dtype)
    expected = base.double() + per_adapter_reference(x, w, slots)
    for weights in (w, rank_major):
        out = base.clone()
        backend = backend_for("cpp")
        backend.apply(x, out, weights, backend.prepare(torch.tensor(slots, dtype=torch.int32)))
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol * float(expected.abs().max()))
        for t, slot in enumerate(slots):
            if slot < 0:
                assert torch.equal(out[t], base[t])


def test_cpu_pool_is_rank_major(pool_and_adapters) -> None:
    pool, _ = pool_and_adapters
    w = pool.weights(0, "gate_up")
    assert tuple(w.B.shape) == (5, 192, MAX_RANK) and w.B.stride(1) == 1 and w.B.transpose(1, 2).is_contiguous()
    assert w.slot_adapted == [True, True, False, True, False]  # slot 2 is q/v only, slot 4 empty
    assert pool.weights(0, "qkv").slot_adapted == [True, True, True, True, False]
    pool.write_slot(4, None)
    assert w.slot_adapted is not None and not w.slot_adapted[4]


def test_plan_splits_at_small_segment() -> None:
    info = TorchLoRABackend().prepare(torch.tensor(LAYOUTS["prefill+decode"], dtype=torch.int32))
    assert not make_plan(info, 0).small and len(make_plan(info, 0).large) == 4  # 0: every segment per adapter
    plan = make_plan(info)
    assert [s[0] for s in plan.large] == [1] and [s[0] for s in plan.small] == [0, 2, 3]
    assert plan.small_rows.tolist() == [0, LARGE + 5, LARGE + 3, 2, LARGE + 6]  # rows of slots 0, 2, 3
    assert plan.small_segs.tolist() == [[0, 0, 2], [2, 2, 3], [3, 3, 5]]


@pytest.mark.parametrize("path", PATHS)
def test_no_thread_count_change_on_the_hot_path(pool_and_adapters, path: str, monkeypatch) -> None:
    pool, _ = pool_and_adapters

    def refuse(n: int) -> None:
        raise AssertionError("the LoRA backend must not change torch's thread count")

    monkeypatch.setattr(torch, "set_num_threads", refuse)
    backend = backend_for(path)
    info = backend.prepare(torch.tensor(LAYOUTS["prefill+decode"], dtype=torch.int32))
    for group, shape in group_shapes(CONFIG).items():
        x = torch.randn(info.num_tokens, shape.in_dim)
        backend.apply(x, torch.zeros(info.num_tokens, shape.slice_offsets[-1]), pool.weights(0, group), info)


def test_env_selects_the_torch_path(monkeypatch) -> None:
    monkeypatch.setenv(cpu_lora.ENV, "torch")
    assert not cpu_lora.available()
    assert get_backend("torch").grouped == "torch"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="not available"):
        CpuLoRABackend()
    monkeypatch.delenv(cpu_lora.ENV)
    if cpu_lora.available():
        assert get_backend("torch").grouped == "cpp"  # type: ignore[attr-defined]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["decode", "one-token", "base-only", "prefill+decode"])
def test_step_runner_matches_apply(pool_and_adapters, dtype: torch.dtype, layout: str) -> None:
    """The decode fast path (`step_runner`, through `LoRAContext`) gives `apply`'s result bit for bit on every
    layer and group; a step with a prefill segment, or no adapter, gets no runner (`apply` serves it)."""
    from lorafleet_worker.model.forward_batch import LoRAContext

    _, adapters = pool_and_adapters
    pool = LoRAPool(CONFIG, num_slots=5, max_rank=MAX_RANK, dtype=dtype)
    for slot, adapter in adapters.items():
        pool.write_slot(slot, adapter)
    backend = backend_for("cpp")
    info = backend.prepare(torch.tensor(LAYOUTS[layout], dtype=torch.int32))
    ctx = LoRAContext(backend, pool, info)
    assert (ctx.run is not None) == (layout in ("decode", "one-token"))
    gen = torch.Generator().manual_seed(7)
    for layer in range(CONFIG.num_hidden_layers):
        for group, shape in group_shapes(CONFIG).items():
            x = torch.randn(info.num_tokens, shape.in_dim, generator=gen).to(dtype)
            base = torch.randn(info.num_tokens, shape.slice_offsets[-1], generator=gen).to(dtype)
            got, want = base.clone(), base.clone()
            ctx.apply(layer, group, x, got)
            backend.apply(x, want, pool.weights(layer, group), info)
            assert torch.equal(got, want), (layer, group)
            strided = torch.randn(info.num_tokens, 2 * shape.in_dim, generator=gen).to(dtype)[:, ::2]
            got, want = base.clone(), base.clone()  # rows the kernel does not take as they are go through apply
            ctx.apply(layer, group, strided, got)
            backend.apply(strided, want, pool.weights(layer, group), info)
            assert torch.equal(got, want), (layer, group)
