"""What `auto` means on this machine: the compute dtype and the LoRA backend (each with the reason why).

- `--lora-backend auto`: `triton` on CUDA (the Triton LoRA kernels and the paged-attention decode kernel),
  `torch` on CPU.
- `--dtype auto`, like vLLM: the checkpoint's `torch_dtype` (config.json). On CUDA a float32 checkpoint is
  served in bfloat16 (float16 where the GPU has no bf16), as vLLM does. On CPU a 16-bit checkpoint is served
  in bfloat16 only where the CPU multiplies bf16 in hardware (AMX or AVX512-BF16); elsewhere bf16 is emulated
  and slower than float32, so float32 is used. A float32 checkpoint stays float32 on CPU (ask for
  `--dtype bfloat16` to trade exactness for speed).

The CPU rule follows what `make bench-dtype` measures (`bench/bench_engine.py --dtype float32 bfloat16`:
both systems in both dtypes, back to back in one run); should a bf16-capable CPU ever measure bf16 slower for
the engine, the rule has to change with it. Without either flag bf16 is emulated and fp32 is kept.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
HALF_DTYPES = ("bfloat16", "float16")
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of hardware bf16 matmul


@functools.cache
def cpu_bf16_flag(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The CPU flag that makes bf16 matmuls fast here (`amx_bf16`, `avx512_bf16`), or None."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        text = ""
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
            break
    found = next((f for f in CPU_BF16_FLAGS if f in flags), None)
    if found is None and torch.backends.cpu.get_cpu_capability() == "AVX512_BF16":  # no /proc (not Linux)
        found = "avx512_bf16"
    return found


def resolve_dtype(requested: str, checkpoint_dtype: str | None, device: torch.device) -> tuple[str, str]:
    """(dtype name, why) for `--dtype requested` on `device`; aliases (bf16, fp32, ...) are normalised."""
    requested = DTYPE_ALIASES.get(requested, requested)
    if requested != "auto":
        return requested, "as requested"
    stored = DTYPE_ALIASES.get(checkpoint_dtype or "", checkpoint_dtype or "")
    if device.type == "cuda":
        if stored in HALF_DTYPES:
            return stored, f"the checkpoint's torch_dtype ({stored})"
        half = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        return half, f"the checkpoint is {stored or 'of unknown dtype'}; auto serves it in 16 bits on GPU, like vLLM"
    if stored not in HALF_DTYPES:
        return "float32", f"the checkpoint's torch_dtype ({stored or 'unknown'}) on CPU"
    flag = cpu_bf16_flag()
    if flag is not None:
        return "bfloat16", f"the checkpoint is {stored} and this CPU multiplies bf16 in hardware ({flag})"
    return "float32", f"the checkpoint is {stored}, but this CPU has no AMX/AVX512-BF16 (bf16 would be emulated)"


def resolve_lora_backend(requested: str, device: torch.device) -> tuple[str, str]:
    """(backend name, why) for `--lora-backend requested`: auto is triton on CUDA, torch elsewhere."""
    if requested != "auto":
        return requested, "as requested"
    if device.type == "cuda":
        return "triton", "CUDA: Triton LoRA kernels and paged-attention kernel"
    return "torch", f"{device.type}: the Triton kernels need CUDA"
