"""The panel GEMM of the CPU base linears (`ops/cpu_gemm.py`) against F.linear, and where `cpu_linear` uses it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lorafleet_worker.model import cpu_linear
from lorafleet_worker.ops import cpu_gemm, loader

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="the panel kernel could not be built here")


@pytest.mark.parametrize("weight", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 32, 48, 49, 130])
def test_panel_linear_matches_f_linear(weight: str, act: torch.dtype, rows: int) -> None:
    """Every tile height (1-6 rows), more than one 48-row block, a 37-wide tail panel, K = 302 (two K slices,
    the second partial and not a multiple of the one-row tile's 4-step unroll), with bias; int8 against the
    dequantized weight."""
    torch.manual_seed(rows)
    w = torch.randn(37, 302) * 0.1
    bias = torch.randn(37)
    if weight == "int8":
        scales = w.abs().amax(1) / 127
        q = torch.round(w / scales[:, None]).to(torch.int8)
        packed, dense = cpu_gemm.pack(q, scales), q.float() * scales[:, None]
    else:
        dt = getattr(torch, weight)
        packed, dense = cpu_gemm.pack(w.to(dt)), w.to(dt).float()
    x = torch.randn(rows, 302).to(act)
    got = packed.matmul(x, bias.to(act))
    ref = F.linear(x.float(), dense, bias.to(act).float())
    assert got.dtype == act and got.shape == (rows, 37)
    tol = 1e-5 if act == torch.float32 else 1e-2  # bf16: the output's rounding
    assert (got.float() - ref).abs().max().item() <= tol * ref.abs().max().item()
    assert torch.allclose(packed.to_dense().float(), dense)
    assert torch.equal(packed.matmul_2d(x, bias.to(act)), got)  # the decoder layer's direct call: the same op
    assert torch.equal(packed.matmul_2d(x, None), packed.matmul(x))


@pytest.mark.parametrize("rows", [7, 32, 49, 130])
@pytest.mark.parametrize("k", [301, 302, 600])
def test_int8_weights_times_bf16_rows_in_int16(rows: int, k: int) -> None:
    """int8 panels times more than one tile of bfloat16 rows take the integer kernel: each row rounded to int16
    by its own scale, pairs of k multiplied by `vpmaddwd`. Against that rounding done here exactly, the output
    differs by the bfloat16 output's rounding alone; odd K (a last k paired with zeros), K over two slices, a
    zero row and a row with one large outlier."""
    torch.manual_seed(k + rows)
    w = torch.randn(37, k) * 0.1
    scales = w.abs().amax(1) / 127
    q = torch.round(w / scales[:, None]).to(torch.int8)
    x = torch.randn(rows, k).bfloat16()
    x[1] = 0
    x[2, k // 3] = 300.0
    got = cpu_gemm.pack(q, scales).matmul(x).float()
    xf = x.double()
    step = (xf.abs().amax(1, keepdim=True) / 32767).clamp_min(1e-30)
    x16 = torch.round(xf / step) * step  # the kernel's int16 rows
    ref = x16 @ (q.double() * scales.double()[:, None]).T
    assert torch.equal(got[1], torch.zeros(37))
    # the bfloat16 output's rounding (half an ulp is 2^-9 relative), plus float32 sums' rounding on the scale of
    # the terms (a result near 0 from large terms of both signs)
    dense = q.double() * scales.double()[:, None]
    bound = ref.abs() * 2**-8 + (x16.abs() @ dense.abs().T) * 2**-18
    assert ((got.double() - ref).abs() <= bound).all()


def int8_blocks(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x [M, K] rounded to int8 per `block` inputs of a row (scale max|x| / 127), as `panel_linear_w8a8` rounds it
    (x * (127 / max) in float32, halves to even), back in float32."""
    m, k = x.shape
    xb = torch.nn.functional.pad(x.float(), (0, -k % block)).view(m, -1, block)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, 0.0)  # (`127 / t` is 127 * (1 / t) in torch)
    return (torch.round(xb * inv) * (amax / 127.0)).view(m, -1)[:, :k]


@pytest.mark.skipif(not cpu_gemm.has_w8a8(), reason="the kernel has no AVX512-VNNI path on this CPU")
@pytest.mark.parametrize("rows", [7, 32, 49, 130])
@pytest.mark.parametrize("k", [301, 320, 600])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_int8_weights_times_8bit_rows_with_vnni(rows: int, k: int, act: torch.dtype) -> None:
    """`--quantization w8a8_int8`: more than one tile of rows is rounded to int8 per 32 inputs and multiplied
    in bytes (`vpdpbusd`, the weights offset by 128 and the offset taken off). Against that rounding done here,
    the output differs by float32 sums' rounding (and bfloat16's own): K not a multiple of 4 or 32, K over
    several slices, a zero row, an outlier, a bias; one tile's rows keep x as it is."""
    torch.manual_seed(k + rows)
    w = torch.randn(37, k) * 0.1
    scales = w.abs().amax(1) / 127
    q = torch.round(w / scales[:, None]).to(torch.int8)
    x = torch.randn(rows, k).to(act)
    x[1] = 0
    x[2, k // 3] = 300.0
    bias = torch.randn(37)
    packed = cpu_gemm.pack(q, scales)
    got = cpu_gemm.linear(x, packed.panels, 37, packed.scales, bias.to(act), w8a8=True).float()
    x8 = int8_blocks(x).double()
    dense = q.double() * scales.double()[:, None]
    ref = x8 @ dense.T + bias.to(act).double()
    assert torch.allclose(got[1], bias.to(act).float())
    out_rounding = 2**-8 if act == torch.bfloat16 else 2**-22
    bound = ref.abs() * out_rounding + (x8.abs() @ dense.abs().T + bias.abs().double()) * 2**-18
    assert ((got.double() - ref).abs() <= bound).all()
    assert (got.double() - x.double() @ dense.T - bias.to(act).double()).abs().max() > 1e-3  # really 8-bit x
    few = x[:6]  # one tile: memory-bound, x as it is (the int8 kernel's float tile)
    assert torch.equal(cpu_gemm.linear(few, packed.panels, 37, packed.scales, None, w8a8=True), packed.matmul(few))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_split_weight_takes_panels_for_few_rows_and_onednn_for_more(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`split` mode: the same results as F.linear both sides of PANEL_MAX_ROWS, each side through its kernel."""
    monkeypatch.setenv(cpu_linear.ENV, "split")
    if dtype == torch.bfloat16 and cpu_linear.mode(dtype) != "split":
        pytest.skip("oneDNN has no bfloat16 linear on this CPU")
    torch.manual_seed(0)
    w, b = torch.randn(40, 70).to(dtype), torch.randn(40).to(dtype)
    split = cpu_linear.pack(w)
    assert isinstance(split, cpu_linear.SplitWeight)
    assert split.nbytes >= 2 * w.numel() * w.element_size() and torch.equal(split.to_dense(), w)
    calls: list[str] = []

    def onednn(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        calls.append("onednn")
        return F.linear(x, w, bias)

    monkeypatch.setattr(cpu_linear, "_onednn_linear", onednn)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for rows in (1, cpu_linear.PANEL_MAX_ROWS, cpu_linear.PANEL_MAX_ROWS + 1, 33):
        x = torch.randn(rows, 70).to(dtype)
        ref = F.linear(x.float(), w.float(), b.float())
        for got in (split.matmul(x, b), split.matmul_2d(x, b), cpu_linear.linear(x, w.new_empty(0), b, split)):
            assert (got.float() - ref).abs().max() <= tol * ref.abs().max()
        assert calls == (["onednn"] * 3 if rows > cpu_linear.PANEL_MAX_ROWS else [])
        calls.clear()


def test_leading_dimensions_strides_and_bad_weights() -> None:
    w = torch.randn(20, 24)
    packed = cpu_gemm.pack(w)
    x = torch.randn(3, 2, 48)[..., ::2]  # not contiguous, two leading dimensions
    assert torch.allclose(packed.matmul(x), F.linear(x, w), atol=1e-5)
    assert packed.nbytes == 2 * 16 * 24 * 4  # two panels, the second padded
    with pytest.raises(ValueError, match="2-D"):
        cpu_gemm.pack(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="scales"):
        cpu_gemm.pack(torch.zeros(4, 4, dtype=torch.int8))
    with pytest.raises(ValueError, match="float64"):
        cpu_gemm.pack(torch.randn(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="25 input features, the weight 24"):
        packed.matmul(torch.randn(1, 25))
    wide = torch.randn(3, 40).to(torch.bfloat16)  # a bf16 column slice (rows 40 apart): copied contiguous first
    assert torch.equal(packed.matmul_2d(wide[:, :24], None), packed.matmul_2d(wide[:, :24].contiguous(), None))
    with pytest.raises(RuntimeError, match="float32 or bfloat16 x"):
        packed.matmul_2d(torch.randn(2, 24).half(), None)


def test_mode_follows_the_cpu_and_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    onednn = torch.backends.mkldnn.is_available()
    monkeypatch.setattr(loader, "cpu_flags", lambda cpuinfo=None: {"avx2", "fma"})
    assert cpu_linear.mode(torch.float32) == "panel"  # no AVX-512: the panel kernel
    assert cpu_linear.mode(torch.float64) == "torch"
    monkeypatch.setattr(loader, "cpu_flags", lambda cpuinfo=None: {"avx2", "fma", "avx512f"})
    # AVX-512: panels for decode rows, oneDNN's 512-bit kernels above (both layouts, twice the memory)
    assert cpu_linear.mode(torch.float32) == ("split" if onednn else "panel")
    assert cpu_linear.layouts(torch.float32) == (2 if onednn else 1)
    if onednn:
        assert isinstance(cpu_linear.pack(torch.randn(4, 4)), cpu_linear.SplitWeight)
    monkeypatch.setenv("LORAFLEET_CPU_LINEAR", "panel")
    assert cpu_linear.mode(torch.float32) == "panel" and cpu_linear.layouts(torch.float32) == 1
    assert isinstance(cpu_linear.pack(torch.randn(4, 4)), cpu_gemm.PanelWeight)
    monkeypatch.setenv("LORAFLEET_CPU_LINEAR", "split")
    assert cpu_linear.mode(torch.float32) == ("split" if onednn else "panel")
    monkeypatch.setenv("LORAFLEET_CPU_LINEAR", "onednn")
    assert cpu_linear.mode(torch.float32) == ("onednn" if onednn else "torch")
    monkeypatch.setenv("LORAFLEET_CPU_LINEAR", "torch")
    assert cpu_linear.mode(torch.float32) == "torch" and cpu_linear.pack(torch.randn(4, 4)) is None
