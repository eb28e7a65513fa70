"""LoRA backends, one file each behind one interface (`base.LoRABackend`): torch (per-adapter matmuls, any
device), cpu (the torch backend with a grouped C++ kernel, the CPU default) and triton (CUDA kernels)."""

from __future__ import annotations

from torch import device as Device

from .base import LoRABackend, StepRunner
from .torch import TorchLoRABackend

BACKENDS = ("torch", "triton")  # the names `--lora-backend` takes (besides "auto")

__all__ = ["BACKENDS", "LoRABackend", "StepRunner", "TorchLoRABackend", "get_backend"]


def get_backend(name: str, device: Device | str = "cpu") -> LoRABackend:
    """The LoRA backend called `name` on `device`: "torch" (on CPU the grouped C++ kernel's `CpuLoRABackend`
    where it builds and `LORAFLEET_CPU_LORA` allows it) or "triton" (imported lazily)."""
    if name == "torch":
        from lorafleet_worker.ops import cpu_lora

        if Device(device).type == "cpu" and cpu_lora.available():
            from .cpu import CpuLoRABackend

            return CpuLoRABackend()
        return TorchLoRABackend(device)
    if name == "triton":
        from .triton import TritonLoRABackend

        return TritonLoRABackend()
    raise ValueError(f"unknown LoRA backend {name!r}; choose one of {', '.join(BACKENDS)}")
