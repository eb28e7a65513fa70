"""Identifiers shared by worker and operator (Dynamo's conventions)."""

from __future__ import annotations

import hashlib

import blake3


def lora_id(name: str) -> int:
    """Dynamo's LoRA id: first 8 bytes of BLAKE3(name), big-endian, masked to 31 bits; 0 becomes 1.

    >>> lora_id("test_lora")
    1983627077
    """
    digest = blake3.blake3(name.encode()).digest()
    value = int.from_bytes(digest[:8], "big") & 0x7FFFFFFF
    return value or 1


def base_model_hash(base_model_name: str) -> str:
    """Value of the `nvidia.com/dynamo-base-model-hash` label: first 8 hex chars of sha256(name)."""
    return hashlib.sha256(base_model_name.encode()).hexdigest()[:8]


BASE_MODEL_HASH_LABEL = "nvidia.com/dynamo-base-model-hash"
