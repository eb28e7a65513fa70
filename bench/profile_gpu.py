"""Where a decode step's time goes on the GPU: torch.profiler over the decode phase of the Llama-3-8B-shaped
end-to-end run (`bench_gpu.py`'s shape run), base and over 1, 16 and 64 rank-16 adapters.

For each case it reports the decode steps in the profiled window, the wall time per step, the kernels
launched per step, the GPU's busy time per step (the sum of kernel times) and so the share of the step the
GPU is idle (waiting for the host to launch work), plus the kernels that take the most time.

    python bench/profile_gpu.py --out bench/gpu-profile.json     # needs CUDA; --cuda-graph-max-bs 64: graphs
    python bench/profile_gpu.py --dry-run     # tiny shape; on CPU under TRITON_INTERPRET=1 (checks the script)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import release_device_memory
from common import CACHE, bench_model, log
from model_shape import DRY_SHAPE, LLAMA3_8B, shape_model_dir, write_peft_adapter


async def profiled_decode(engine: Any, adapters: list[str], num_seqs: int, prompt_len: int, max_tokens: int) -> dict:
    """Run `num_seqs` requests; profile from the moment every request has its first token to the end."""
    import torch
    from lorafleet_worker.sample.params import SamplingParams

    vocab = engine.config.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    started = asyncio.Event()
    first_seen = 0
    counter = time.monotonic_ns()

    async def one(i: int) -> int:
        nonlocal first_seen
        prompt = [(7 * i + 13 * j) % (vocab - 10) + 10 for j in range(prompt_len)]
        name = adapters[i % len(adapters)] if adapters else None
        n = 0
        async for _ in engine.generate(f"prof-{counter}-{i}", prompt, params, adapter=name):
            n += 1
            if n == 1:
                first_seen += 1
                if first_seen == num_seqs:
                    started.set()
        return n

    # Kernels only on the GPU: recording the host's ops too would slow the steps it measures.
    activities = [
        torch.profiler.ProfilerActivity.CUDA if torch.cuda.is_available() else torch.profiler.ProfilerActivity.CPU
    ]
    prof = torch.profiler.profile(activities=activities)
    tasks = [asyncio.create_task(one(i)) for i in range(num_seqs)]
    await started.wait()
    counts_at_start = first_seen
    prof.start()
    t0 = time.perf_counter()
    done = await asyncio.gather(*tasks)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    prof.stop()
    steps = max_tokens - 1  # every sequence had its first token when the window opened
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[ev.name[:90]]
            k[0] += 1
            k[1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    launches = sum(int(v[0]) for v in kernels.values())
    busy_us = sum(v[1] for v in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:15]
    return {
        "requests": counts_at_start,
        "tokens": sum(done),
        "steps": steps,
        "wall_ms_per_step": round(wall * 1e3 / steps, 2),
        "kernels_per_step": round(launches / steps, 1),
        "gpu_busy_ms_per_step": round(busy_us / 1e3 / steps, 2),
        "gpu_idle_pct": round(100 * (1 - busy_us / 1e6 / wall), 1) if wall else None,
        "top_kernels": [
            {"name": n, "per_step": round(c / steps, 1), "ms_per_step": round(t / 1e3 / steps, 3)} for n, (c, t) in top
        ],
    }


async def run(args: argparse.Namespace) -> list[dict]:
    from lorafleet_worker.core.engine import Engine

    shape = DRY_SHAPE if args.dry_run else LLAMA3_8B
    tok_src = bench_model(
        "tokenizer-src", hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=128
    )
    model_dir = shape_model_dir(shape, CACHE / f"{shape.name}-config", tok_src)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    n_max = max(args.adapters)
    paths = [
        write_peft_adapter(CACHE / f"{shape.name}-adapters" / f"r16-{i:03d}", shape, 16, seed=i, device=device)
        for i in range(n_max)
    ]
    engine = Engine(
        model_dir,
        device=device,
        dtype="float32" if args.dry_run else "bfloat16",
        load_format="dummy",
        max_loras=max(1, n_max),
        max_lora_rank=16,
        max_num_seqs=args.num_seqs,
        max_model_len=args.prompt_len + args.max_tokens + 16,
        lora_backend="triton",
        cuda_graph_max_bs=args.cuda_graph_max_bs,
    )
    await engine.start()
    rows = []
    try:
        names = [f"r16-{i:03d}" for i in range(n_max)]
        for name, path in zip(names, paths, strict=True):
            await engine.add_adapter(name, path)
        for n in args.adapters:
            await profiled_decode(engine, names[:n], args.num_seqs, args.prompt_len, 4)  # warm-up (jit)
            row = {
                "adapters": n,
                **await profiled_decode(engine, names[:n], args.num_seqs, args.prompt_len, args.max_tokens),
            }
            log(
                f"adapters={n}: {row['wall_ms_per_step']} ms/step, {row['kernels_per_step']} kernels/step, "
                f"GPU busy {row['gpu_busy_ms_per_step']} ms/step (idle {row['gpu_idle_pct']} %)"
            )
            for k in row["top_kernels"][:8]:
                log(f"    {k['ms_per_step']:8.3f} ms  x{k['per_step']:6.1f}  {k['name']}")
            rows.append(row)
    finally:
        await engine.stop()
        release_device_memory()
    return rows


def main(argv: list[str] | None = None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="tiny shape (on CPU: under TRITON_INTERPRET=1)")
    p.add_argument("--adapters", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 16, 64])
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=33)
    p.add_argument("--cuda-graph-max-bs", type=int, default=0, help="decode steps replayed from CUDA graphs (0: eager)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        p.error("needs a CUDA GPU (--dry-run checks the script on CPU under TRITON_INTERPRET=1)")
    if args.dry_run:
        args.adapters, args.num_seqs, args.prompt_len, args.max_tokens = [0, 1, 2], 4, 16, 5
        if not torch.cuda.is_available():
            args.cuda_graph_max_bs = 0  # CPU: eager only
    rows = asyncio.run(run(args))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
