"""Micro-benchmark: one decode step's base linears on CPU, per weight layout, at several batch sizes.

The 121 linears of SmolLM2-135M (30 layers x qkv, o, gate_up, down, and the 49,152-row lm_head; random
weights of the real shapes), each layout in turn, interleaved rounds, best round per (layout, M):

  onednn f32   oneDNN's prepacked float32 linear (`LORAFLEET_CPU_LINEAR=onednn`)
  onednn bf16  oneDNN's prepacked bfloat16 linear (AMX where the CPU has it: what PyTorch-based peers run)
  panel f32    the panel kernel (`model/cpu_gemm.py`), float32 weights
  panel bf16   bfloat16 weights and activations
  panel int8   int8 weights, a float32 scale per output channel (`--quantization int8`), bfloat16 activations
  int8pack     PyTorch's `_weight_int8pack_mm` (the int8 path the panel kernel replaced on CPU)
  read floor   the float32 weights' bytes over the machine's read bandwidth (a sum over them, best round)

    python bench/micro_linear.py [--threads 2] [--rows 1 4 32 128] [--rounds 5]   # writes bench/micro_linear.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT_DIR, log, machine

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def _best_ms(fn: Callable[[], object], rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _run_panels(packed: list[Any], xs: dict[int, torch.Tensor]) -> object:
    return [p.matmul(xs[p.panels.shape[1]]) for p in packed]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32, 128])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=OUT_DIR / "micro_linear.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from lorafleet_worker.ops import cpu_gemm

    torch.manual_seed(0)
    weights = [torch.randn(o, i) * 0.02 for o, i in SHAPES]
    scales = [w.abs().amax(1) / 127 for w in weights]
    int8 = [torch.round(w / s[:, None]).to(torch.int8) for w, s in zip(weights, scales, strict=True)]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    onednn_bf16 = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), None) for w in weights]
    panels = {
        "panel f32": [cpu_gemm.pack(w) for w in weights],
        "panel bf16": [cpu_gemm.pack(w.bfloat16()) for w in weights],
        "panel int8": [cpu_gemm.pack(q, s) for q, s in zip(int8, scales, strict=True)],
    }
    rows_out = []
    for m in args.rows:
        xs = {k: torch.randn(m, k) for k in (576, 1536)}
        xb = {k: v.bfloat16() for k, v in xs.items()}

        def run_onednn(xs: dict[int, torch.Tensor], prepacked: list[torch.Tensor]) -> object:
            return [
                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                for w, p in zip(weights, prepacked, strict=True)
            ]

        def run_int8pack(xb: dict[int, torch.Tensor] = xb) -> object:
            return [
                torch.ops.aten._weight_int8pack_mm(xb[q.shape[1]], q, s.bfloat16())
                for q, s in zip(int8, scales, strict=True)
            ]

        cases: dict[str, Callable[[], object]] = {
            "onednn f32": functools.partial(run_onednn, xs, onednn),
            "onednn bf16": functools.partial(run_onednn, xb, onednn_bf16),
        }
        for name, packed in panels.items():
            x = xs if name == "panel f32" else xb
            cases[name] = functools.partial(_run_panels, packed, x)
        cases["int8pack"] = run_int8pack
        cases["read floor"] = lambda: [w.sum() for w in weights]
        best = {name: float("inf") for name in cases}
        for _ in range(args.rounds):  # interleaved: each round times every case once
            for name, fn in cases.items():
                best[name] = min(best[name], _best_ms(fn, 1))
        flops = 2 * m * sum(o * i for o, i in SHAPES)
        row = {"rows": m, "ms": best, "gflops": {k: flops / v / 1e6 for k, v in best.items() if k != "read floor"}}
        rows_out.append(row)
        log(f"M={m}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in best.items()))
    nbytes = sum(w.numel() * 4 for w in weights)
    payload = {"machine": machine(), "threads": args.threads, "weight_mb_f32": nbytes / 1e6, "rows": rows_out}
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
