"""The network (`transformer.py`) and what it reads: step inputs, attention, RoPE, checkpoint loading."""

from lorafleet_worker.model.forward_batch import ForwardBatch, LoRAContext, PrefillSeq
from lorafleet_worker.model.loading import parse_dtype
from lorafleet_worker.model.transformer import Transformer

__all__ = ["ForwardBatch", "LoRAContext", "PrefillSeq", "Transformer", "parse_dtype"]
