"""Prepacked base linears on CPU (`model/cpu_linear.py`: panels, oneDNN) against F.linear, and the model's packing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lorafleet_worker.model import Transformer, cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.packs(torch.float32), reason="no oneDNN in this torch build")


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("rows", [1, 7, 32, 65])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("path", ["panel", "onednn"])
def test_packed_linear_matches_f_linear(
    dtype: torch.dtype, tol: float, rows: int, bias: bool, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORAFLEET_CPU_LINEAR", path)
    if cpu_linear.mode(dtype) != path:
        pytest.skip(f"{dtype} is not packed for {path} on this CPU")
    torch.manual_seed(0)
    w = torch.randn(48, 40).to(dtype)
    b = torch.randn(48).to(dtype) if bias else None
    packed = cpu_linear.pack(w)
    assert packed is not None
    x = torch.randn(rows, 40).to(dtype)
    got = cpu_linear.linear(x, w.new_empty(0), b, packed)  # the dense weight is not read
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == dtype and got.shape == (rows, 48)
    assert (got.float() - ref).abs().max().item() < tol * ref.abs().max().item()
    strided = torch.randn(rows, 80).to(dtype)[:, ::2]  # a non-contiguous input
    assert torch.allclose(cpu_linear.linear(strided, w, b, packed).float(), F.linear(strided, w, b).float(), tol, tol)


def test_unsupported_weights_and_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_linear.pack(torch.randn(4, 4, dtype=torch.float64)) is None
    assert cpu_linear.pack(torch.randn(4)) is None
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    assert torch.equal(cpu_linear.linear(x, w, None, None), F.linear(x, w))  # no packed weight: F.linear
    monkeypatch.setenv("LORAFLEET_CPU_LINEAR", "torch")
    assert not cpu_linear.enabled() and cpu_linear.pack(w) is None


def test_model_packs_on_cpu_and_keeps_its_state_dict(tiny_models: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    model = Transformer.from_pretrained(Path(tiny_models["llama"]))
    layer = model.layers[0]
    assert set(layer.packed) == {"qkv", "o", "gate_up", "down"}
    assert layer.qkv_w.numel() == 0  # the dense copy is released
    monkeypatch.setenv("LORAFLEET_CPU_LINEAR", "torch")
    plain = Transformer.from_pretrained(Path(tiny_models["llama"]))
    assert not plain.layers[0].packed and plain.packed_head is None
    state, ref = model.state_dict(), plain.state_dict()
    assert state.keys() == ref.keys()
    assert all(torch.equal(state[k], ref[k]) for k in ref)  # dense weights read back out of the packed ones
    assert model.weight_nbytes() >= plain.weight_nbytes()


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_the_model_reads_its_panels_from_one_arena_in_step_order(tiny_models: Any, quantization: str | None) -> None:
    """`PanelArena`: every panel weight lies in one buffer, layer by layer and lm_head last, and computes the same."""
    model = Transformer.from_pretrained(Path(tiny_models["llama"]), dtype="bfloat16")
    if quantization:
        model.quantize_weights(quantization)
    weights = [p for layer in model.layers for p in layer.packed.values()] + [model.packed_head]
    panels = [cpu_linear.panel_tensor(p) for p in weights]
    if not all(t is not None for t in panels):
        pytest.skip("the panel kernel does not serve every weight here")
    tensors = [t for t in panels if t is not None]
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(storages) == 1  # one buffer
    starts = [t.data_ptr() for t in tensors]
    assert starts == sorted(starts) and all(s % cpu_linear.PanelArena.ALIGN == 0 for s in starts)
    ends = [t.data_ptr() + t.nbytes for t in tensors]
    assert all(end <= nxt for end, nxt in zip(ends, starts[1:], strict=False))  # in order, none overlapping
    arena = cpu_linear.PanelArena(weights)
    moved = [arena.move(p) for p in weights]
    x = torch.randn(3, model.config.hidden_size, dtype=torch.bfloat16)
    first, again = weights[0], moved[0]
    assert first is not None and again is not None
    none = x.new_empty(0)
    assert torch.equal(cpu_linear.linear(x, none, None, first), cpu_linear.linear(x, none, None, again))
    with pytest.raises(ValueError, match="sized for other weights"):
        arena.move(first)
