"""GPU benchmark of the Triton kernels and of multi-LoRA decode end to end (`make bench-gpu`).

Kernels, per shape (Llama-3-8B projection widths, bf16):
  lora        shrink + expand of one projection group (qkv, gate_up, down) for decode with 64 distinct
              adapters (gathered layout), decode with 8 shared adapters and a 2048-token prefill
              (segmented layout); uniform rank 16 and mixed ranks 8/16/32/64
  attention   paged-attention decode, batch 1/16/64, context 1k-4k, GQA 1/4/8
Each is timed against its torch reference (`TorchLoRABackend`, gather + SDPA attention), and reported as
achieved bandwidth (the minimum bytes the op must move / time) and FLOP/s, also as a share of the device's
peak (table `PEAKS`, matched by device name).

End to end: `Engine` decode tokens/s with 64 concurrent requests over 1, 16 and 64 adapters vs base only,
for the triton and the torch LoRA backends, on a ~100M-parameter model.

End to end on the shape people serve (Llama-3-8B, `bench/model_shape.py`): random bf16 weights built on the
device (`--load-format dummy`), 64 sequences of 512 prompt and 128 output tokens, base and over 1, 16 and 64
adapters of rank 16 and 16 and 64 of mixed ranks 8-64 (all seven projections); decode tokens/s, step time, the
bytes a step must move and the share of the measured copy bandwidth that achieves, prefill time and its share
of the measured bf16 matmul rate.

    python bench/bench_gpu.py                        # needs CUDA; writes bench/gpu.json and bench/gpu.md
    python bench/bench_gpu.py --dry-run              # CPU, Triton interpreter, tiny shapes (checks the script)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root (bench.kernel_inputs)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CACHE, MIXED_RANKS, OUT_DIR, bench_adapter, bench_model, log, machine
from model_shape import (
    DRY_SHAPE,
    LLAMA3_8B,
    Shape,
    decode_step_bytes,
    prefill_flops,
    shape_model_dir,
    write_peft_adapter,
)

# device name substring -> (HBM GB/s, dense fp16/bf16 tensor-core TFLOP/s); first match wins
PEAKS: list[tuple[str, float, float]] = [
    ("H200", 4800.0, 989.0),
    ("H100 PCIe", 2000.0, 756.0),
    ("H100 NVL", 3900.0, 835.0),
    ("H100", 3350.0, 989.0),
    ("A100-SXM4-80GB", 2039.0, 312.0),
    ("A100 80GB PCIe", 1935.0, 312.0),
    ("A100", 1555.0, 312.0),
]


def device_peak(name: str | None) -> tuple[float, float] | None:
    """(GB/s, TFLOP/s) peaks of the named device, or None when it is not in `PEAKS`."""
    for key, gbps, tflops in PEAKS:
        if name and key in name:
            return gbps, tflops
    return None


@dataclass(frozen=True)
class LoRAShape:
    group: str
    in_dim: int
    widths: tuple[int, ...]
    num_tokens: int
    num_adapters: int
    ranks: tuple[int, ...]  # cycled over the adapters


@dataclass(frozen=True)
class AttnShape:
    batch: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16


GROUPS = {"qkv": (4096, (4096, 1024, 1024)), "gate_up": (4096, (14336, 14336)), "down": (14336, (4096,))}
TOKENS = [(64, 64), (64, 8), (2048, 8)]  # (tokens, adapters): decode distinct, decode shared, prefill
LORA_SHAPES = [
    LoRAShape(g, i, w, t, a, r) for g, (i, w) in GROUPS.items() for t, a in TOKENS for r in ((16,), MIXED_RANKS)
]
ATTN_SHAPES = [
    AttnShape(1, 4096, 32, 8, 128),
    AttnShape(16, 2048, 32, 8, 128),
    AttnShape(64, 1024, 32, 8, 128),
    AttnShape(64, 4096, 32, 8, 128),
    AttnShape(16, 2048, 32, 32, 128),
    AttnShape(16, 2048, 64, 8, 128),
]
DRY_LORA_SHAPES = [LoRAShape("qkv", 40, (48, 16, 16), 8, 4, MIXED_RANKS), LoRAShape("down", 72, (40,), 300, 2, (16,))]
DRY_ATTN_SHAPES = [AttnShape(2, 40, 4, 1, 16)]
E2E_ADAPTERS = (0, 1, 16, 64)


def timer_for(device: Any) -> Callable[[Callable[[], Any]], float]:
    """Seconds per call: triton's do_bench on CUDA; one timed call under the interpreter."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100) / 1e3

    def once(fn: Callable[[], Any]) -> float:
        fn()  # first call jits / rewrites
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return once


def rates(nbytes: float, flops: float, seconds: float, peak: tuple[float, float] | None, prefix: str) -> dict[str, Any]:
    gbps, tflops = nbytes / seconds / 1e9, flops / seconds / 1e12
    out = {
        f"{prefix}_us": round(seconds * 1e6, 2),
        f"{prefix}_GBps": round(gbps, 1),
        f"{prefix}_TFLOPs": round(tflops, 3),
    }
    if peak is not None:
        out[f"{prefix}_pct_peak_bw"] = round(100 * gbps / peak[0], 1)
        out[f"{prefix}_pct_peak_flops"] = round(100 * tflops / peak[1], 2)
    return out


def bench_lora(
    shape: LoRAShape, dtype: Any, device: Any, timer: Callable, peak: tuple[float, float] | None
) -> dict[str, Any]:
    import torch
    from lorafleet_worker.lora.backends import TorchLoRABackend
    from lorafleet_worker.lora.backends.triton import TritonLoRABackend

    from bench.kernel_inputs import random_proj_weights

    adapter_ranks = [shape.ranks[i % len(shape.ranks)] for i in range(shape.num_adapters)]
    n_slices = len(shape.widths)
    w = random_proj_weights(
        in_dim=shape.in_dim,
        widths=shape.widths,
        ranks=[[r] * n_slices for r in adapter_ranks],
        max_rank=max(adapter_ranks),
        dtype=dtype,
        device=device,
        poison=False,
    )
    slots = torch.tensor([i % shape.num_adapters for i in range(shape.num_tokens)], dtype=torch.int32, device=device)
    x = torch.randn(shape.num_tokens, shape.in_dim, device=device, dtype=dtype)
    out = torch.zeros(shape.num_tokens, sum(shape.widths), device=device, dtype=dtype)
    triton_backend, torch_backend = TritonLoRABackend(), TorchLoRABackend(device)
    info = triton_backend.prepare(slots)
    elem = x.element_size()
    out_total = sum(shape.widths)
    tok_rank = sum(adapter_ranks[i % shape.num_adapters] for i in range(shape.num_tokens))
    nbytes = (
        shape.num_tokens * shape.in_dim * elem  # x
        + sum(r * (shape.in_dim * n_slices + out_total) for r in adapter_ranks) * elem  # A and B of each adapter
        + 2 * shape.num_tokens * out_total * elem  # out read + write
        + 2 * tok_rank * n_slices * 4  # fp32 intermediate write + read
    )
    flops = 2 * tok_rank * (shape.in_dim * n_slices + out_total)
    t_triton = timer(lambda: triton_backend.apply(x, out, w, info))
    t_torch = timer(lambda: torch_backend.apply(x, out, w, info))
    return {
        "kernel": "lora_shrink_expand",
        **asdict(shape),
        "layout": "gathered" if triton_backend.use_gathered(info) else "segmented",
        "bytes": nbytes,
        "flops": flops,
        **rates(nbytes, flops, t_triton, peak, "triton"),
        **rates(nbytes, flops, t_torch, peak, "torch"),
        "speedup_vs_torch": round(t_torch / t_triton, 2),
    }


# Tile candidates of the gathered (decode) kernels, timed one by one at decode shapes (`tile_sweep`)
SHRINK_TILES = [(k, w) for k in (128, 256, 512, 1024) for w in (4, 8)]  # (BLOCK_K, num_warps)
EXPAND_TILES = [(n, w) for n in (64, 128, 256) for w in (4, 8)]  # (BLOCK_N, num_warps)
DRY_SHRINK_TILES, DRY_EXPAND_TILES = [(16, 4), (32, 4)], [(16, 4)]


def tile_sweep(shape: LoRAShape, dtype: Any, device: Any, timer: Callable, dry_run: bool) -> list[dict[str, Any]]:
    """The gathered shrink and expand of one decode shape alone, with each candidate tile (the default marked):
    the data for choosing `shrink_blocks` / `expand_blocks` on the device at hand."""
    import torch
    from lorafleet_worker.kernels.lora import ExpandBlocks, ShrinkBlocks, expand_blocks, lora_expand, lora_shrink
    from lorafleet_worker.kernels.lora import shrink_blocks as default_shrink

    from bench.kernel_inputs import random_proj_weights

    adapter_ranks = [shape.ranks[i % len(shape.ranks)] for i in range(shape.num_adapters)]
    n_slices, out_total = len(shape.widths), sum(shape.widths)
    max_rank = max(adapter_ranks)
    w = random_proj_weights(
        in_dim=shape.in_dim,
        widths=shape.widths,
        ranks=[[r] * n_slices for r in adapter_ranks],
        max_rank=max_rank,
        dtype=dtype,
        device=device,
        poison=False,
    )
    slots = torch.tensor([i % shape.num_adapters for i in range(shape.num_tokens)], dtype=torch.int32, device=device)
    x = torch.randn(shape.num_tokens, shape.in_dim, device=device, dtype=dtype)
    out = torch.zeros(shape.num_tokens, out_total, device=device, dtype=dtype)
    xa = torch.zeros(shape.num_tokens, n_slices, max_rank, device=device, dtype=torch.float32)
    offs = torch.tensor(w.slice_offsets, dtype=torch.int32, device=device)
    max_width = max(b - a for a, b in zip(w.slice_offsets, w.slice_offsets[1:], strict=False))
    elem, rank_sum = x.element_size(), sum(adapter_ranks)
    shrink_bytes = x.numel() * elem + rank_sum * n_slices * shape.in_dim * elem + xa.numel() * 4
    expand_bytes = rank_sum * out_total * elem + xa.numel() * 4 + 2 * out.numel() * elem
    default_s = default_shrink(in_dim=shape.in_dim, max_seg_len=1, dtype=dtype, gathered=True)
    default_e = expand_blocks(max_width=max_width, max_seg_len=1, dtype=dtype, gathered=True)
    rows = []
    for block_k, warps in DRY_SHRINK_TILES if dry_run else SHRINK_TILES:
        blk = ShrinkBlocks(1, 16, block_k, warps)
        t = timer(lambda blk=blk: lora_shrink(x, w.A, w.ranks, xa, token_slots=slots, blocks=blk))
        rows.append({"group": shape.group, "kernel": "shrink", "tile": block_k, "num_warps": warps,
                     "default": blk == default_s, "us": round(t * 1e6, 2),
                     "GBps": round(shrink_bytes / t / 1e9, 1)})  # fmt: skip
    for block_n, warps in DRY_EXPAND_TILES if dry_run else EXPAND_TILES:
        blk_e = ExpandBlocks(1, 16, block_n, warps)
        t = timer(
            lambda blk_e=blk_e: lora_expand(
                xa, w.B, w.ranks, w.scalings, offs, max_width, out, token_slots=slots, blocks=blk_e
            )
        )
        rows.append({"group": shape.group, "kernel": "expand", "tile": block_n, "num_warps": warps,
                     "default": blk_e == default_e, "us": round(t * 1e6, 2),
                     "GBps": round(expand_bytes / t / 1e9, 1)})  # fmt: skip
    return rows


def torch_decode_attention(q: Any, k_cache: Any, v_cache: Any, block_tables: Any, seq_lens: Any, scale: float) -> Any:
    """The torch decode path of model/attention.py: gather every block of the table, masked SDPA."""
    import torch
    import torch.nn.functional as F

    b, max_blocks = block_tables.shape
    bs, kvh, d = k_cache.shape[1:]
    k = k_cache[block_tables].view(b, max_blocks * bs, kvh, d).transpose(1, 2)
    v = v_cache[block_tables].view(b, max_blocks * bs, kvh, d).transpose(1, 2)
    mask = (torch.arange(max_blocks * bs, device=q.device)[None, :] < seq_lens[:, None])[:, None, None, :]
    o = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[:, :, 0, :]


def bench_attention(
    shape: AttnShape, dtype: Any, device: Any, timer: Callable, peak: tuple[float, float] | None
) -> dict[str, Any]:
    import torch
    from lorafleet_worker.kernels.paged_attention import default_num_splits, paged_attention_decode

    from bench.kernel_inputs import random_paged_kv

    kv = random_paged_kv(
        [shape.context] * shape.batch,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        block_size=shape.block_size,
        dtype=dtype,
        device=device,
        poison=False,
    )
    q = torch.randn(shape.batch, shape.num_heads, shape.head_dim, device=device, dtype=dtype)
    scale = shape.head_dim**-0.5
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale)
    elem = q.element_size()
    nbytes = 2 * shape.batch * shape.context * shape.num_kv_heads * shape.head_dim * elem
    nbytes += 2 * q.numel() * elem + kv.block_tables.numel() * 4
    flops = 4 * shape.batch * shape.num_heads * shape.context * shape.head_dim
    t_triton = timer(lambda: paged_attention_decode(*args))
    t_torch = timer(lambda: torch_decode_attention(*args))
    return {
        "kernel": "paged_attention_decode",
        **asdict(shape),
        "gqa": shape.num_heads // shape.num_kv_heads,
        "num_splits": default_num_splits(shape.batch, shape.num_kv_heads, shape.context, q.device),
        "bytes": nbytes,
        "flops": flops,
        **rates(nbytes, flops, t_triton, peak, "triton"),
        **rates(nbytes, flops, t_torch, peak, "torch"),
        "speedup_vs_torch": round(t_torch / t_triton, 2),
    }


async def _decode_run(
    engine: Any, adapters: list[str], num_seqs: int, prompt_len: int, max_tokens: int
) -> dict[str, Any]:
    from lorafleet_worker.sample.params import SamplingParams

    vocab = engine.config.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    counter = int(time.monotonic_ns())

    async def one(i: int) -> tuple[int, float]:
        prompt = [(7 * i + 13 * j) % (vocab - 10) + 10 for j in range(prompt_len)]
        name = adapters[i % len(adapters)] if adapters else None
        n, first = 0, 0.0
        async for _ in engine.generate(f"bench-{counter}-{i}", prompt, params, adapter=name):
            n += 1
            if n == 1:
                first = time.perf_counter()
        return n, first

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(num_seqs)))
    end = time.perf_counter()
    decode_start = max(first for _, first in results)  # every request is past its prefill
    decode_tokens = sum(n - 1 for n, _ in results)
    return {
        "tokens": sum(n for n, _ in results),
        "seconds": round(end - t0, 3),
        "prefill_s": round(decode_start - t0, 3),
        "tokens_per_s": round(sum(n for n, _ in results) / (end - t0), 1),
        "decode_tokens_per_s": round(decode_tokens / max(end - decode_start, 1e-9), 1) if decode_start < end else None,
    }


async def bench_e2e(
    model: Path,
    adapter_dirs: list[Path],
    backend: str,
    device: str,
    dtype: str,
    num_seqs: int,
    prompt_len: int,
    max_tokens: int,
    quantization: str | None = None,
) -> list[dict[str, Any]]:
    from lorafleet_worker.core.engine import Engine

    max_loras = max(1, len(adapter_dirs))
    engine = Engine(
        model,
        device=device,
        dtype=dtype,
        max_loras=max_loras,
        max_num_seqs=num_seqs,
        lora_backend=backend,
        max_lora_rank=64,
        quantization=quantization,
    )
    label = backend if quantization is None else f"{backend} {quantization}"
    await engine.start()
    try:
        names = [f"a{i:03d}" for i in range(len(adapter_dirs))]
        for name, path in zip(names, adapter_dirs, strict=True):
            await engine.add_adapter(name, path)
        await _decode_run(engine, names[:1], min(4, num_seqs), prompt_len, 2)  # warm-up: jit, slots
        rows = []
        for n in E2E_ADAPTERS:
            if n > len(names):
                continue
            res = await _decode_run(engine, names[:n], num_seqs, prompt_len, max_tokens)
            rows.append({"backend": label, "quantization": quantization, "adapters": n, "num_seqs": num_seqs, **res})
            log(f"e2e {label} adapters={n}: {res['decode_tokens_per_s']} decode tok/s")
        return rows
    finally:
        await engine.stop()


def measured_rates(device: Any, timer: Callable, dry_run: bool) -> dict[str, float]:
    """The device's bandwidth (a device-to-device copy) and bf16 matmul rate, measured: the roofline's bars."""
    import torch

    n = 1 << (20 if dry_run else 30)
    src = torch.empty(n, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    t_copy = timer(lambda: dst.copy_(src))
    m = 256 if dry_run else 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    t_mm = timer(lambda: a @ b)
    return {"copy_GBps": 2 * src.nbytes / t_copy / 1e9, "matmul_TFLOPs": 2 * m**3 / t_mm / 1e12}


async def bench_shape(
    shape: Shape,
    model_dir: Path,
    families: dict[str, list[tuple[Path, int]]],
    counts: dict[str, tuple[int, ...]],
    graph_sizes: tuple[int, ...] = (0,),
    **run: Any,
) -> list[dict[str, Any]]:
    """Decode and prefill of `num_seqs` sequences on a model of `shape` (random weights on the device), base
    and over each family's first n adapters, set against the measured bandwidth and matmul rate; eagerly and
    with the decode steps replayed from CUDA graphs (`graph_sizes`: the engine's `cuda_graph_max_bs`, 0 = eager).
    `run`: `_shape_family`'s keywords (device, dtype, num_seqs, prompt_len, max_tokens, rates)."""
    rows = []
    for family, adapters in families.items():
        for graphs in graph_sizes:
            rows += await _shape_family(shape, model_dir, family, adapters, counts[family], graphs, **run)
    return rows


async def _shape_family(
    shape: Shape,
    model_dir: Path,
    family: str,
    adapters: list[tuple[Path, int]],
    counts: tuple[int, ...],
    graphs: int,
    *,
    device: str,
    dtype: str,
    num_seqs: int,
    prompt_len: int,
    max_tokens: int,
    rates: dict[str, float],
) -> list[dict[str, Any]]:
    """`bench_shape`'s rows of one adapter family on one engine (`graphs`: its cuda_graph_max_bs)."""
    from lorafleet_worker.core.engine import Engine

    elem = 4 if dtype == "float32" else 2
    rows = []
    engine = Engine(
        model_dir,
        device=device,
        dtype=dtype,
        load_format="dummy",
        max_loras=max(1, len(adapters)),
        max_lora_rank=max(r for _, r in adapters),
        max_num_seqs=num_seqs,
        max_model_len=prompt_len + max_tokens + 16,
        lora_backend="triton",
        cuda_graph_max_bs=graphs,
    )
    await engine.start()
    try:
        names = [f"{family}-{i:03d}" for i in range(len(adapters))]
        for name, (path, _) in zip(names, adapters, strict=True):
            await engine.add_adapter(name, path)
        for n in counts:
            await _decode_run(engine, names[:n], num_seqs, prompt_len, 4)  # warm-up at the timed shapes (jit), slots
            res = await _decode_run(engine, names[:n], num_seqs, prompt_len, max_tokens)
            ranks = [r for _, r in adapters[:n]]
            need = decode_step_bytes(
                shape, num_seqs=num_seqs, context=prompt_len + max_tokens / 2, elem=elem, adapter_ranks=ranks
            )
            step_s = num_seqs / res["decode_tokens_per_s"] if res["decode_tokens_per_s"] else None
            flops = prefill_flops(shape, num_seqs=num_seqs, prompt_len=prompt_len)
            row: dict[str, Any] = {
                "shape": shape.name,
                "family": "base" if n == 0 else family,
                "cuda_graphs": graphs,
                "adapters": n,
                "ranks": sorted(set(ranks)),
                "num_seqs": num_seqs,
                "prompt_len": prompt_len,
                "max_tokens": max_tokens,
                **res,
                "step_ms": round(step_s * 1e3, 2) if step_s else None,
                "step_bytes": need,
                "step_GBps": round(need["total"] / step_s / 1e9, 1) if step_s else None,
                "pct_measured_bw": round(100 * need["total"] / step_s / 1e9 / rates["copy_GBps"], 1)
                if step_s
                else None,
                "prefill_flops": flops,
                "prefill_TFLOPs": round(flops / res["prefill_s"] / 1e12, 2) if res["prefill_s"] > 0 else None,
            }
            if row["prefill_TFLOPs"] is not None:
                row["pct_measured_matmul"] = round(100 * row["prefill_TFLOPs"] / rates["matmul_TFLOPs"], 1)
            rows.append(row)
            log(
                f"{shape.name} {row['family']} adapters={n} graphs={graphs}: "
                f"{res['decode_tokens_per_s']} decode tok/s, "
                f"step {row['step_ms']} ms ({row['pct_measured_bw']} % of measured bandwidth), "
                f"prefill {res['prefill_s']} s"
            )
    finally:
        await engine.stop()
        del engine
        release_device_memory()
    return rows


def release_device_memory() -> None:
    """Give the finished engine's memory back to the device, so that the next engine's plan sees it free."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def shape_run(args: argparse.Namespace, device: Any, timer: Callable) -> dict[str, Any]:
    """The end-to-end roofline on a served model's shape: the model directory (config + tokenizer only), the
    adapters (uniform rank 16 and mixed ranks, on all seven projections), the measured rates, the runs."""
    shape = DRY_SHAPE if args.dry_run else LLAMA3_8B
    tok_src = bench_model(
        "tokenizer-src", hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=128
    )
    model_dir = shape_model_dir(shape, CACHE / f"{shape.name}-config", tok_src)
    n = 2 if args.dry_run else 64
    log(f"writing {2 * n} random PEFT adapters of the {shape.name} shape")
    families = {
        "rank16": [
            (
                write_peft_adapter(CACHE / f"{shape.name}-adapters" / f"r16-{i:03d}", shape, 16, seed=i, device=device),
                16,
            )
            for i in range(n)
        ],
        "mixed": [
            (
                write_peft_adapter(
                    CACHE / f"{shape.name}-adapters" / f"mixed-{i:03d}",
                    shape,
                    MIXED_RANKS[i % len(MIXED_RANKS)],
                    seed=1000 + i,
                    device=device,
                ),
                MIXED_RANKS[i % len(MIXED_RANKS)],
            )
            for i in range(n)
        ],
    }
    counts: dict[str, tuple[int, ...]] = {
        "rank16": (0, 1, 2) if args.dry_run else (0, 1, 16, 64),
        "mixed": (2,) if args.dry_run else (16, 64),
    }
    rates = measured_rates(device, timer, args.dry_run)
    log(f"measured: copy {rates['copy_GBps']:.1f} GB/s, bf16 matmul {rates['matmul_TFLOPs']:.1f} TFLOP/s")
    rows = asyncio.run(
        bench_shape(
            shape,
            model_dir,
            families,
            counts,
            device=device.type,
            dtype="float32" if args.dry_run else "bfloat16",
            num_seqs=args.num_seqs,
            prompt_len=args.shape_prompt_len,
            max_tokens=args.max_tokens,
            rates=rates,
            graph_sizes=(0,) if args.dry_run or not args.cuda_graph_max_bs else (0, args.cuda_graph_max_bs),
        )
    )
    return {"shape": shape.name, "measured": rates, "runs": rows}


def markdown(payload: dict[str, Any]) -> str:
    lines = [f"# GPU benchmark ({payload['device'] or 'no GPU'}, {payload['dtype']})", ""]
    if payload["dry_run"]:
        lines += ["Dry run: Triton interpreter on CPU, tiny shapes; the figures mean nothing.", ""]
    pct = payload["peak"] is not None
    head = "| shape | layout | triton µs | GB/s | TFLOP/s | % peak BW | torch µs | speedup |"
    for kind, title in (("lora_shrink_expand", "LoRA shrink + expand"), ("paged_attention_decode", "Paged attention")):
        lines += [f"## {title}", "", head, "|---|---|---|---|---|---|---|---|"]
        for r in payload["kernels"]:
            if r["kernel"] != kind:
                continue
            if kind == "lora_shrink_expand":
                shape = f"{r['group']} T={r['num_tokens']} adapters={r['num_adapters']} ranks={r['ranks']}"
                layout = r["layout"]
            else:
                shape = f"B={r['batch']} ctx={r['context']} H={r['num_heads']} GQA={r['gqa']} D={r['head_dim']}"
                layout = f"splits={r['num_splits']}"
            bw = r.get("triton_pct_peak_bw", "-") if pct else "-"
            lines.append(
                f"| {shape} | {layout} | {r['triton_us']} | {r['triton_GBps']} | {r['triton_TFLOPs']} | {bw} | "
                f"{r['torch_us']} | {r['speedup_vs_torch']}x |"
            )
        lines.append("")
    if payload.get("tile_sweep"):
        lines += [
            "## Gathered LoRA kernels by tile (decode, 64 tokens of 64 adapters)",
            "",
            "| group | kernel | BLOCK_K / BLOCK_N | warps | µs | GB/s | default |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in payload["tile_sweep"]:
            mark = "yes" if r["default"] else ""
            lines.append(
                f"| {r['group']} | {r['kernel']} | {r['tile']} | {r['num_warps']} | {r['us']} | {r['GBps']} | {mark} |"
            )
        lines.append("")
    if payload["e2e"]:
        lines += [
            "## End-to-end decode",
            "",
            "| backend | adapters | seqs | decode tok/s | vs base |",
            "|---|---|---|---|---|",
        ]
        base = {r["backend"]: r["decode_tokens_per_s"] for r in payload["e2e"] if r["adapters"] == 0}
        for r in payload["e2e"]:
            b, v = base.get(r["backend"]), r["decode_tokens_per_s"]
            rel = f"{v / b:.2f}" if b and v else "-"
            lines.append(f"| {r['backend']} | {r['adapters']} | {r['num_seqs']} | {v} | {rel} |")
        lines.append("")
    if payload.get("model_shape"):
        ms = payload["model_shape"]
        m = ms["measured"]
        lines += [
            f"## End to end on the {ms['shape']} shape (random weights built on the device, Triton LoRA)",
            "",
            f"Measured: device-to-device copy {m['copy_GBps']:.0f} GB/s, bf16 matmul {m['matmul_TFLOPs']:.0f} TFLOP/s. "
            "A decode step must read the weights, each sequence's KV and each distinct adapter once.",
            "",
            "| CUDA graphs | adapters | ranks | seqs | prompt | decode tok/s | vs base | step ms | GB/step | "
            "% measured BW | prefill s | prefill TFLOP/s | % measured matmul |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        bases = {r.get("cuda_graphs", 0): r["decode_tokens_per_s"] for r in ms["runs"] if r["adapters"] == 0}
        for r in ms["runs"]:
            graphs = r.get("cuda_graphs", 0)
            v, base = r["decode_tokens_per_s"], bases.get(graphs)
            rel = f"{v / base:.2f}" if base and v else "-"
            lines.append(
                f"| {graphs or 'eager'} | {r['adapters']} | {r['ranks'] or '-'} | {r['num_seqs']} | "
                f"{r['prompt_len']} | {v} | {rel} | "
                f"{r['step_ms']} | {r['step_bytes']['total'] / 1e9:.2f} | {r['pct_measured_bw']} | {r['prefill_s']} | "
                f"{r['prefill_TFLOPs']} | {r.get('pct_measured_matmul', '-')} |"
            )
        lines.append("")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU + Triton interpreter, tiny shapes, one timed call")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--backends", default="triton,torch", help="LoRA backends for the end-to-end run")
    p.add_argument(
        "--quantizations",
        default="int8,int4",
        help="weight-only quantizations (--quantization) also run end to end with the first backend; '' for none",
    )
    p.add_argument("--skip-shape", action="store_true", help="skip the end-to-end run on the Llama-3-8B shape")
    p.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=64,
        help="the Llama-3-8B-shape run also with decode steps replayed from CUDA graphs (0: eager only)",
    )
    p.add_argument("--shape-prompt-len", type=int, default=512, help="prompt tokens of the Llama-3-8B-shape run")
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--out", type=Path, default=None, help="JSON output (default bench/gpu.json; dry run: $TMPDIR/gpu.dry-run.json)"
    )
    p.add_argument("--markdown", type=Path, default=None, help="markdown table (default: the JSON path with .md)")
    args = p.parse_args(argv)
    args.out = args.out or (Path(tempfile.gettempdir()) / "gpu.dry-run.json" if args.dry_run else OUT_DIR / "gpu.json")
    args.markdown = args.markdown or args.out.with_suffix(".md")
    if args.dry_run:
        args.num_seqs, args.prompt_len, args.max_tokens, args.shape_prompt_len = (
            min(args.num_seqs, 2),
            min(args.prompt_len, 8),
            min(args.max_tokens, 2),
            min(args.shape_prompt_len, 8),
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        log("no CUDA device: run on a GPU machine, or use --dry-run to check the script on CPU")
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else None
    peak = device_peak(name)
    timer = timer_for(device)
    payload: dict[str, Any] = {
        "device": name,
        "dtype": args.dtype,
        "dry_run": args.dry_run,
        "peak": {"GBps": peak[0], "TFLOPs": peak[1]} if peak else None,
        "machine": machine(),
        "kernels": [],
        "tile_sweep": [],
        "e2e": [],
        "model_shape": None,
    }
    if not args.skip_kernels:
        for lshape in DRY_LORA_SHAPES if args.dry_run else LORA_SHAPES:
            payload["kernels"].append(row := bench_lora(lshape, dtype, device, timer, peak))
            log(f"lora {lshape}: {row['triton_us']} us ({row['speedup_vs_torch']}x torch)")
        decode = [s for s in LORA_SHAPES if s.num_adapters == 64 and s.ranks == (16,)]
        for lshape in DRY_LORA_SHAPES[:1] if args.dry_run else decode:
            payload["tile_sweep"] += tile_sweep(lshape, dtype, device, timer, args.dry_run)
        for ashape in DRY_ATTN_SHAPES if args.dry_run else ATTN_SHAPES:
            payload["kernels"].append(row := bench_attention(ashape, dtype, device, timer, peak))
            log(f"attention {ashape}: {row['triton_us']} us ({row['speedup_vs_torch']}x torch)")
    if not args.skip_e2e:
        if args.dry_run:
            model = bench_model(
                "tiny-dry-run", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128
            )
            adapters = [bench_adapter(model, i, MIXED_RANKS[i % len(MIXED_RANKS)]) for i in range(1)]
        else:
            model = bench_model()
            adapters = [bench_adapter(model, i, MIXED_RANKS[i % len(MIXED_RANKS)]) for i in range(max(E2E_ADAPTERS))]
        e2e_dtype = "float32" if args.dry_run else args.dtype
        backends = args.backends.split(",")
        runs = [(b, None) for b in backends] + [(backends[0], q) for q in args.quantizations.split(",") if q]
        for backend, quant in runs:
            payload["e2e"] += asyncio.run(
                bench_e2e(
                    model,
                    adapters,
                    backend,
                    device.type,
                    e2e_dtype,
                    args.num_seqs,
                    args.prompt_len,
                    args.max_tokens,
                    quantization=quant,
                )
            )
    if not args.skip_shape:
        payload["model_shape"] = shape_run(args, device, timer)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    args.markdown.write_text(markdown(payload))
    log(f"wrote {args.out} and {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
