"""Weight-only int8 / int4 base linears on CUDA (`--quantization`, model/quantization.py).

On CUDA the packed weights are served by PyTorch's `_weight_int8pack_mm` and `_weight_int4pack_mm`
(tinygemm). Checked here: the matmul is x times the dequantized weight, and the CUDA packing quantizes to
the same grid as the CPU one. The engine with quantized weights and LoRA through the Triton kernels is
`test_engine_triton.py::test_quantized_triton_engine_on_cuda_matches_torch`. Without CUDA every test is
skipped, never passed.
"""

from __future__ import annotations

import pytest
import torch
from lorafleet_worker.model import quantization
from lorafleet_worker.model.quantization import quantize

from tests.kernels.test_engine_triton import needs_cuda

pytestmark = needs_cuda


CUDA_METHODS = [m for m in quantization.METHODS if m != "w8a8_int8"]  # w8a8_int8 is CPU-only (refused on CUDA)


@pytest.mark.parametrize("method", CUDA_METHODS)
@pytest.mark.parametrize("rows", [1, 8, 33])
def test_cuda_matmul_is_x_times_the_dequantized_weight(method: str, rows: int) -> None:
    torch.manual_seed(0)
    w = torch.randn(96, 256, dtype=torch.bfloat16)
    qw = quantize(w.cuda(), method)
    assert qw.qweight.is_cuda and not qw.panels and qw.matmul_2d is None
    dense = qw.to_dense()
    assert dense.shape == w.shape and dense.dtype == torch.bfloat16
    # the CUDA packing lands on the CPU packing's grid; a rare element rounds to the neighbouring step, where
    # CUDA's division (a multiply by the reciprocal) lands on the other side of a tie
    diff = (dense.float().cpu() - quantize(w, method).to_dense().float()).abs()
    step = quantization_step(w.float(), method)
    # on CUDA int8's scales are bfloat16 (the kernel's): up to a quarter step off, plus the value's rounding
    assert (diff <= step * 1.01 + w.float().abs() * 2**-7).all()
    assert (diff > step * 0.75).float().mean().item() < 0.01
    x = torch.randn(rows, 256, dtype=torch.bfloat16, device="cuda")
    got = qw.matmul(x)
    ref = x.float() @ dense.float().T
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    assert (got.float() - ref).abs().max().item() < 2e-2 * ref.abs().max().item()


def test_int4_on_cuda_needs_bf16() -> None:
    with pytest.raises(ValueError, match="bfloat16"):
        quantization.check_supported("int4", torch.device("cuda"), torch.float32)


def test_w8a8_int8_is_refused_on_cuda() -> None:
    with pytest.raises(ValueError, match="not on a CUDA device; use int8"):
        quantization.check_supported("w8a8_int8", torch.device("cuda"), torch.bfloat16)
    with pytest.raises(ValueError, match="w8a8_int8 needs the CPU panel kernel"):
        quantize(torch.randn(16, 64, dtype=torch.bfloat16, device="cuda"), "w8a8_int8")


def quantization_step(w: torch.Tensor, method: str) -> torch.Tensor:
    """The quantization grid's step for each element of a float32 [out, in] weight."""
    if method == "int8":
        return (w.abs().amax(1, keepdim=True) / 127).expand_as(w)
    g = w.reshape(w.shape[0], -1, quantization.INT4_GROUP)
    return ((g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 15).expand_as(g).reshape(w.shape)
