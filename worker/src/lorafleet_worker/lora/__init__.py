"""LoRA layer of the worker: adapter loading, slot pool, adapter manager, batch description, backends."""

from .backends import LoRABackend, TorchLoRABackend, get_backend
from .batch import LoRABatchInfo, build_batch_info
from .errors import AdapterError, AdapterNotFoundError, CapacityError, LoRAError
from .weights import LoRAProjWeights

__all__ = [
    "AdapterError",
    "AdapterNotFoundError",
    "CapacityError",
    "LoRABackend",
    "LoRABatchInfo",
    "LoRAError",
    "LoRAProjWeights",
    "TorchLoRABackend",
    "build_batch_info",
    "get_backend",
]
