"""Every kernel compiles for a real GPU (sm_90 cubin via ptxas) — the interpreter does not check that.

No GPU is needed: Triton lowers to PTX and runs ptxas for the target. Block sizes are the ones the
launchers pick for Llama-3-8B shapes. ptxas's resource report (`-v`) must show no register spills: a spill
goes to local memory and costs far more than the kernel's own loads.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from lorafleet_worker.kernels import LazyKernel
from lorafleet_worker.kernels import lora as L
from lorafleet_worker.kernels import paged_attention as P
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.runtime.interpreter import InterpretedFunction

FP32_PTRS = {"xa_ptr", "scalings_ptr", "m_ptr", "l_ptr", "part_ptr"}
I32_PTRS = {
    "ranks_ptr",
    "sorted_ids_ptr",
    "seg_indptr_ptr",
    "seg_slots_ptr",
    "token_slots_ptr",
    "slice_off_ptr",
    "block_tables_ptr",
    "seq_lens_ptr",
}


def lora_case(name: str, kernel: LazyKernel, dtype: torch.dtype, gathered: bool, shrink: bool) -> tuple:
    if shrink:
        blk: object = L.shrink_blocks(in_dim=4096, max_seg_len=512, dtype=dtype, gathered=gathered)
    else:
        blk = L.expand_blocks(max_width=4096, max_seg_len=512, dtype=dtype, gathered=gathered)
    consts = {k: v for k, v in vars(blk).items() if k != "num_warps" and not (gathered and k == "BLOCK_M")}
    if not gathered:
        consts["DOT_FP32"] = False
    return name, kernel, consts, TYPES[dtype], vars(blk)["num_warps"]


def attn_case(name: str, head_dim: int, dtype: torch.dtype, split: bool) -> tuple:
    block_n, warps = P.attention_blocks(head_dim, dtype, chunk=4096)
    block_d = max(16, triton.next_power_of_2(head_dim))
    consts = dict(GROUP=4, BLOCK_G=16, BLOCK_N=block_n, BLOCK_D=block_d, SPLIT=split, DOT_FP32=False)
    return name, P.attn_decode_kernel, consts, TYPES[dtype], warps


TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
CASES = [
    lora_case("shrink_segmented", L.shrink_segmented_kernel, torch.bfloat16, False, True),
    lora_case("shrink_segmented_fp32", L.shrink_segmented_kernel, torch.float32, False, True),
    lora_case("expand_segmented", L.expand_segmented_kernel, torch.bfloat16, False, False),
    lora_case("shrink_gathered", L.shrink_gathered_kernel, torch.bfloat16, True, True),
    lora_case("expand_gathered", L.expand_gathered_kernel, torch.bfloat16, True, False),
    attn_case("attention_d128", 128, torch.bfloat16, False),
    attn_case("attention_d64_split_fp16", 64, torch.float16, True),
    ("attention_combine", P.attn_combine_kernel, {"BLOCK_S": 16, "BLOCK_D": 128}, "bf16", 4),
]


def signature(fn: triton.JITFunction, consts: dict[str, object], dtype: str) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in FP32_PTRS or (name == "o_ptr" and consts.get("SPLIT")):
            sig[name] = "*fp32"
        elif name in I32_PTRS:
            sig[name] = "*i32"
        elif name.endswith("_ptr"):
            sig[name] = f"*{dtype}"
        else:
            sig[name] = "fp32" if name == "qk_scale" else "i32"
    return sig


def ptxas_usage(ptx: str, arch: str = "sm_90a") -> tuple[int, int, int]:
    """(registers per thread, spill store bytes, spill load bytes) that ptxas reports for `ptx`."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        cmd = [get_ptxas(90).path, "-v", "--regAllocOptLevel=2", f"--gpu-name={arch}", str(src), "-o", f"{src}.o"]
        report = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert regs and spills, report
    return int(regs[1]), int(spills[1]), int(spills[2])


@pytest.mark.parametrize(("name", "kernel", "consts", "dtype", "num_warps"), CASES, ids=[c[0] for c in CASES])
def test_compiles_for_sm90(
    name: str,
    kernel: LazyKernel,
    consts: dict[str, object],
    dtype: str,
    num_warps: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if isinstance(tl.standard._sum_combine, InterpretedFunction):
        pytest.skip("triton itself was imported in interpreter mode (TRITON_INTERPRET=1 set before the run)")
    monkeypatch.delitem(os.environ, "TRITON_INTERPRET", raising=False)
    monkeypatch.setitem(os.environ, "TRITON_DEFAULT_FP_FUSION", "1")  # today's default, without the warning
    fn = triton.jit(kernel.fn)
    assert isinstance(fn, triton.JITFunction)
    if "PRECISION" in fn.arg_names:
        consts = {**consts, "PRECISION": "ieee" if dtype == "fp32" else "tf32"}
    src = triton.compiler.ASTSource(fn=fn, signature=signature(fn, consts, dtype), constexprs=consts)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    assert compiled.asm["cubin"], f"{name}: no cubin"
    regs, spill_stores, spill_loads = ptxas_usage(compiled.asm["ptx"])
    assert (spill_stores, spill_loads) == (0, 0), f"{name}: {regs} registers, spills {spill_stores}/{spill_loads} B"
