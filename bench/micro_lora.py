"""Micro-benchmark: the torch LoRA backend on one decode step of the mixed16 scenario, vs its floor.

The engine benchmark's mixed16 step at concurrency 32 holds 16 adapters (ranks 8/16/32/64 on all
seven projections) and 2 decode tokens per adapter. This times, on the same pool layout:

  backend   `TorchLoRABackend.apply` over 14 layers x 4 projection groups (what the engine runs)
  mm-only   just the 2 matmuls per (adapter, slice) on prepared views: no gather, scatter, loops
            over metadata or scaling. No torch-level implementation of per-adapter matmuls can beat it.
  base      the base model's 4 fused GEMMs per layer for the same tokens (the work LoRA adds to)

    python bench/micro_lora.py [--tokens 32] [--repeats 5]    # writes bench/micro_lora.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from lorafleet_worker.lora.backend import LoRAProjWeights, TorchLoRABackend
from lorafleet_worker.lora.batch import LoRABatchInfo, build_batch_info

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH_MODEL, MIXED_RANKS, log, machine, write_json

LAYERS = BENCH_MODEL["num_layers"]
NUM_ADAPTERS = 16


Group = tuple[torch.Tensor, torch.Tensor, LoRAProjWeights]


def build(tokens: int) -> tuple[dict[str, Group], LoRABatchInfo, dict[str, torch.Tensor]]:
    """Per group: (x, out, weights) with 16 random adapters in a pool; the batch info; base weights."""
    h, kv, f = BENCH_MODEL["hidden_size"], BENCH_MODEL["hidden_size"] // 3, BENCH_MODEL["intermediate_size"]
    groups = {"qkv": (h, [h, kv, kv]), "o": (h, [h]), "gate_up": (h, [f, f]), "down": (f, [h])}
    ranks = [MIXED_RANKS[i % len(MIXED_RANKS)] for i in range(NUM_ADAPTERS)]
    gen = torch.Generator().manual_seed(0)
    data, base = {}, {}
    for name, (in_dim, outs) in groups.items():
        offs = [0]
        for o in outs:
            offs.append(offs[-1] + o)
        a = torch.zeros(NUM_ADAPTERS, len(outs), max(MIXED_RANKS), in_dim)
        b = torch.zeros(NUM_ADAPTERS, offs[-1], max(MIXED_RANKS))
        for i, r in enumerate(ranks):
            a[i, :, :r] = torch.randn(len(outs), r, in_dim, generator=gen) * 0.02
            b[i, :, :r] = torch.randn(offs[-1], r, generator=gen) * 0.02
        rk = torch.tensor([[r] * len(outs) for r in ranks], dtype=torch.int32)
        sc = torch.full((NUM_ADAPTERS, len(outs)), 0.5)
        w = LoRAProjWeights(a, b, rk, sc, tuple(offs), rk.clone(), sc.clone())
        data[name] = (torch.randn(tokens, in_dim, generator=gen), torch.zeros(tokens, offs[-1]), w)
        base[name] = torch.randn(offs[-1], in_dim, generator=gen) * 0.02
    # decodes grouped by adapter, as the scheduler orders them
    slots = torch.arange(tokens, dtype=torch.int32) * NUM_ADAPTERS // tokens
    return data, build_batch_info(slots), base


def timed(fn: Callable[[], None], repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens in the step (2 per adapter at 32)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    data, batch, base = build(args.tokens)
    backend = TorchLoRABackend()

    def run_backend() -> None:
        for _ in range(LAYERS):
            for x, out, w in data.values():
                backend.apply(x, out, w, batch)

    views = []
    for x, _, w in data.values():
        ranks, _ = w.host_meta()
        offs = w.slice_offsets
        for slot, start, end in batch.segments:
            for s, r in enumerate(ranks[slot]):
                a_t = w.A[slot, s, :r].t()
                b_t = w.B[slot, offs[s] : offs[s + 1], :r].t()
                views.append((x[start:end], a_t, b_t))

    def run_mm_only() -> None:
        torch.set_num_threads(1)
        for _ in range(LAYERS):
            for x, a_t, b_t in views:
                torch.mm(torch.mm(x, a_t), b_t)

    threads = torch.get_num_threads()

    def run_base() -> None:
        torch.set_num_threads(threads)
        for _ in range(LAYERS):
            for name, (x, _, _) in data.items():
                torch.nn.functional.linear(x, base[name])

    results = {
        "backend": timed(run_backend, args.repeats),
        "mm-only": timed(run_mm_only, args.repeats),
        "base": timed(run_base, args.repeats),
    }
    torch.set_num_threads(threads)
    log(f"{args.tokens} decode tokens, {NUM_ADAPTERS} adapters, {LAYERS} layers; median of {args.repeats}")
    for name, ms in results.items():
        print(f"{name:<8} {ms:8.1f} ms per step")
    print(f"backend ÷ mm-only floor: {results['backend'] / results['mm-only']:.2f}")
    rounded = {k: round(v, 2) for k, v in results.items()}
    write_json(
        "micro_lora", {"machine": machine(), "tokens": args.tokens, "adapters": NUM_ADAPTERS, "ms_per_step": rounded}
    )


if __name__ == "__main__":
    main()
