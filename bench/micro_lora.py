"""Micro-benchmark: the torch LoRA backend on one decode step at concurrency 32, vs its floors.

Two cases, each 16 adapters in a `LoRAPool` laid out as the engine's (CPU: rank-major B), 2 decode
tokens per adapter, the adapters' tokens consecutive as the scheduler orders them:

  mixed16   the random 97M bench model (14 layers), ranks 8/16/32/64 on all seven projections
  qv16      SmolLM2-135M's shapes (30 layers), ranks 8/8/8/16 on q_proj and v_proj (real-qv16)

Per case, over every layer and projection group of one step:

  cpp          `CpuLoRABackend`: the C++ grouped kernel (`lora/cpu_lora.py`, the CPU default)
  torch        `TorchLoRABackend` without it (`LORAFLEET_CPU_LORA=torch`): one mm + one addmm_ per
               (adapter, slice), in place, on torch's threads (the previous backend forced one thread)
  mm-only      just those 2 matmuls per (adapter, slice) on prepared views, on ONE thread (the floor of
               any per-adapter torch implementation; the old backend switched to one thread for them)
  base         the base model's 4 fused GEMMs per layer for the same tokens (the work LoRA adds to)

    python bench/micro_lora.py [--tokens 32] [--repeats 7] [--cases mixed16 qv16]   # writes bench/micro_lora.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from lorafleet_worker.config import ModelConfig
from lorafleet_worker.lora.adapter import GROUPS, LoRAAdapter, LoRAModuleWeights, group_shapes
from lorafleet_worker.lora.backends import TorchLoRABackend
from lorafleet_worker.lora.backends.cpu import CpuLoRABackend
from lorafleet_worker.lora.pool import LoRAPool
from lorafleet_worker.ops import cpu_lora

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH_MODEL, MIXED_RANKS, log, machine, write_json

NUM_ADAPTERS = 16
ALL7 = tuple(name for names in GROUPS.values() for name in names)
SMOLLM2 = dict(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, intermediate_size=1536, vocab_size=49152)
CASES = {
    "mixed16": (BENCH_MODEL, MIXED_RANKS, ALL7),
    "qv16": (SMOLLM2, (8, 8, 8, 16), ("q_proj", "v_proj")),
}


def config_of(shape: dict[str, int]) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "model_type": "llama",
            "vocab_size": shape["vocab_size"],
            "hidden_size": shape["hidden_size"],
            "intermediate_size": shape["intermediate_size"],
            "num_hidden_layers": shape["num_layers"],
            "num_attention_heads": shape["num_heads"],
            "num_key_value_heads": shape["num_kv_heads"],
        }
    )


def random_adapter(config: ModelConfig, rank: int, targets: tuple[str, ...], gen: torch.Generator) -> LoRAAdapter:
    shapes = group_shapes(config)
    modules: dict[tuple[int, str], list[LoRAModuleWeights | None]] = {}
    for layer in range(config.num_hidden_layers):
        for group, names in GROUPS.items():
            shape = shapes[group]
            slices: list[LoRAModuleWeights | None] = [
                LoRAModuleWeights(
                    A=torch.randn(rank, shape.in_dim, generator=gen) * 0.02,
                    B=torch.randn(width, rank, generator=gen) * 0.02,
                    scaling=2.0,
                )
                if name in targets
                else None
                for name, width in zip(names, shape.slice_widths, strict=True)
            ]
            if any(slices):
                modules[(layer, group)] = slices
    return LoRAAdapter(path=Path("/random"), modules=modules, max_rank=rank)


def timed(fn: Callable[[], None], repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1000


def run_case(name: str, tokens: int, repeats: int) -> dict[str, float]:
    shape, ranks, targets = CASES[name]
    config = config_of(shape)
    gen = torch.Generator().manual_seed(0)
    pool = LoRAPool(config, num_slots=NUM_ADAPTERS, max_rank=64)
    for i in range(NUM_ADAPTERS):
        pool.write_slot(i, random_adapter(config, ranks[i % len(ranks)], targets, gen))
    layers = config.num_hidden_layers
    shapes = group_shapes(config)
    xs = {g: torch.randn(tokens, s.in_dim, generator=gen) for g, s in shapes.items()}
    outs = {g: torch.zeros(tokens, s.slice_offsets[-1]) for g, s in shapes.items()}
    base_w = {g: torch.randn(s.slice_offsets[-1], s.in_dim, generator=gen) * 0.02 for g, s in shapes.items()}
    slots = torch.arange(tokens, dtype=torch.int32) * NUM_ADAPTERS // tokens  # decodes grouped by adapter

    def backend_run(backend: TorchLoRABackend) -> Callable[[], None]:
        batch = backend.prepare(slots)

        def run() -> None:
            for layer in range(layers):
                for g in shapes:
                    backend.apply(xs[g], outs[g], pool.weights(layer, g), batch)

        return run

    views = []
    batch = TorchLoRABackend().prepare(slots)
    for layer in range(layers):
        for g in shapes:
            w = pool.weights(layer, g)
            r_host, _ = w.host_meta()
            offs = w.slice_offsets
            for slot, start, end in batch.segments:
                for s, r in enumerate(r_host[slot]):
                    if r:
                        views.append((xs[g][start:end], w.A[slot, s, :r].t(), w.B[slot, offs[s] : offs[s + 1], :r].t()))

    threads = torch.get_num_threads()

    def run_mm_only() -> None:
        torch.set_num_threads(1)
        for x, a_t, b_t in views:
            torch.mm(torch.mm(x, a_t), b_t)
        torch.set_num_threads(threads)

    def run_base() -> None:
        for _ in range(layers):
            for g in shapes:
                torch.nn.functional.linear(xs[g], base_w[g])

    runs: dict[str, Callable[[], None]] = {}
    if cpu_lora.available():
        runs["cpp"] = backend_run(CpuLoRABackend())
    runs["torch"] = backend_run(TorchLoRABackend())
    runs["mm-only"] = run_mm_only
    runs["base"] = run_base
    results = {k: round(timed(fn, repeats), 2) for k, fn in runs.items()}
    nbytes = sum(v[1].nbytes + v[2].nbytes for v in views)
    log(f"{name}: {tokens} decode tokens, {NUM_ADAPTERS} adapters, {layers} layers; median of {repeats}; "
        f"adapter weights read per step {nbytes / 2**20:.1f} MiB")  # fmt: skip
    for k, ms in results.items():
        print(f"{name:<8} {k:<12} {ms:8.2f} ms per step")
    results["adapter_mib"] = round(nbytes / 2**20, 1)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens in the step (2 per adapter at 32)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = ap.parse_args()
    results = {case: run_case(case, args.tokens, args.repeats) for case in args.cases}
    write_json(
        "micro_lora",
        {
            "machine": machine(),
            "tokens": args.tokens,
            "adapters": NUM_ADAPTERS,
            "threads": torch.get_num_threads(),
            "ms_per_step": results,
        },
    )


if __name__ == "__main__":
    main()
