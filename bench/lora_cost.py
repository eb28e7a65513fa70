"""Where one adapter's cost goes at one user: the step with the adapter, without its kernel, without any of its
per-projection work, against the base model; and the CPU LoRA kernel alone with its rows in cache and after the
caches were swept (as the base weights sweep them between two calls in a step).

    OMP_NUM_THREADS=1 python bench/lora_cost.py --precision int8 --rounds 10

One in-process engine on the real model with a random adapter of the demo's `french` recipe (the shape of
`bench/one_adapter.py`'s trained one). The four step variants run interleaved, round after round:
- base: no adapter;
- one: the adapter, as served;
- no-kernel: the adapter with the C++ kernel call replaced by a no-op (the batch preparation, the Python of
  each projection's call and the argument passing remain);
- no-apply: the adapter with each projection's LoRA call a no-op (only the step's batch preparation remains).
Their ITL p50 against base's splits the adapter's cost into preparation, per-call Python and kernel. The
variants patch the worker's modules from here; the worker has no switch for them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_engine import one_pass, requests_for
from common import bench_adapter, log, machine, real_model, write_json
from one_adapter import PRECISIONS

VARIANTS = ("base", "one", "no-kernel", "no-apply")
GROUP_ORDER = ("qkv", "o", "gate_up", "down")


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    """The worker with `name`'s part of the LoRA work made a no-op, for the duration of one pass."""
    from lorafleet_worker.model import forward_batch
    from lorafleet_worker.ops import cpu_lora

    kernel, apply = cpu_lora.kernel, forward_batch.LoRAContext.apply
    if name == "no-kernel":
        cpu_lora.kernel = lambda: lambda *args: None
    elif name == "no-apply":
        forward_batch.LoRAContext.apply = lambda self, *args: None
    try:
        yield
    finally:
        cpu_lora.kernel, forward_batch.LoRAContext.apply = kernel, apply


def kernel_alone(pool: Any, repeats: int = 20) -> dict[str, Any]:
    """Every adapted (layer, group) of slot 0 in forward order, one token each: per token, with the rows in cache
    (hot) and after a 64 MiB sweep (cold); bytes of A and B rows read per token."""
    import torch
    from lorafleet_worker.ops import cpu_lora

    table = pool.kernel_table()
    keys = sorted((k for k in table if table[k][5][0]), key=lambda k: (k[0], GROUP_ORDER.index(k[1])))
    kernel = cpu_lora.kernel()
    rows, segs = torch.zeros(1, dtype=torch.int32), torch.tensor([[0, 0, 1]], dtype=torch.int64)
    xs = {k: torch.randn(1, table[k][0].shape[3], dtype=table[k][0].dtype) for k in keys}
    outs = {k: torch.zeros(1, table[k][4][-1], dtype=table[k][0].dtype) for k in keys}
    nbytes = 0
    for k in keys:
        A, _, ranks, _, offsets, _ = table[k]
        nbytes += (int(ranks[0].sum()) * A.shape[3] + int(ranks[0].max()) * offsets[-1]) * A.element_size()
    sweep = torch.ones(64 << 20, dtype=torch.uint8)
    out: dict[str, Any] = {"calls_per_token": len(keys), "adapter_mb_per_token": round(nbytes / 1e6, 2)}
    for mode in ("hot", "cold"):
        times = []
        for _ in range(repeats):
            if mode == "cold":
                sweep.add_(1)
            t0 = time.perf_counter()
            for k in keys:
                A, B, ranks, scalings, offsets, _ = table[k]
                kernel(xs[k], outs[k], A, B, ranks, scalings, offsets, rows, segs)
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        out[mode] = {"ms_per_token": round(t * 1e3, 3), "gb_per_s": round(nbytes / t / 1e9, 1)}
    return out


def run(precision: str, rounds: int) -> dict[str, Any]:
    from lorafleet_worker.core.engine import Engine
    from lorafleet_worker.sample.params import SamplingParams

    from demo.train_adapters import RECIPES

    model = real_model()
    recipe = RECIPES["french"]
    adapter = bench_adapter(model, 200, recipe.rank, tuple(recipe.targets))
    engine = Engine(model, max_loras=1, max_cpu_loras=64, max_lora_rank=64, max_num_seqs=32,
                    max_model_len=208, **PRECISIONS[precision])  # fmt: skip
    itl: dict[str, list[float]] = {v: [] for v in VARIANTS}

    async def passes() -> None:
        await engine.start()
        await engine.add_adapter("one", adapter)
        reqs = {"base": requests_for(1, [], engine.config.vocab_size),
                "one": requests_for(1, ["one"], engine.config.vocab_size)}  # fmt: skip
        for name in ("base", "one"):  # warm-up: the adapter into its slot, kernels built
            await one_pass(engine, SamplingParams, reqs[name][:1], 1)
        for rnd in range(rounds):
            for name in VARIANTS if rnd % 2 == 0 else VARIANTS[::-1]:
                with variant(name):
                    got = await one_pass(engine, SamplingParams, reqs["base" if name == "base" else "one"][:1], 1)
                itl[name].append(got["itl_p50_ms"])
        await engine.stop()

    asyncio.run(passes())
    base = statistics.median(itl["base"])
    steps = {v: {"itl_p50_ms": round(statistics.median(xs), 2), "vs_base": round(statistics.median(xs) / base, 3),
                 "passes": xs} for v, xs in itl.items()}  # fmt: skip
    return {"steps": steps, "kernel_alone": kernel_alone(engine.core.runner.lora_pool)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", default="int8", choices=list(PRECISIONS))
    parser.add_argument("--rounds", type=int, default=10, help="interleaved passes of each variant")
    parser.add_argument("--out", default="lora_cost", help="bench/<out>.json")
    args = parser.parse_args()
    result = run(args.precision, args.rounds)
    for name, step in result["steps"].items():
        log(f"{name}: ITL p50 {step['itl_p50_ms']} ms, {step['vs_base']} x base")
    log(f"kernel alone: {result['kernel_alone']}")
    cmd = "python bench/lora_cost.py " + " ".join(sys.argv[1:])
    write_json(args.out, {"machine": machine(), "command": cmd, "precision": args.precision, **result})


if __name__ == "__main__":
    main()
