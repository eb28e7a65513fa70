"""Identifiers shared by worker and operator (Dynamo's conventions)."""

from __future__ import annotations

import hashlib
import re

import blake3

_LORA_NAME = re.compile(r"[A-Za-z0-9._/-]{1,128}")
LORA_NAME_RULE = "1-128 characters of [A-Za-z0-9._/-], no '..'"


def lora_name_problem(name: str) -> str | None:
    """Why `name` is not a valid adapter name (SPEC §2: `LORA_NAME_RULE`), or None when it is.

    >>> lora_name_problem("org/my-lora.v2") is None
    True
    >>> lora_name_problem("../etc")
    "invalid lora_name '../etc': 1-128 characters of [A-Za-z0-9._/-], no '..'"
    """
    if _LORA_NAME.fullmatch(name) and ".." not in name:
        return None
    return f"invalid lora_name {name[:140]!r}: {LORA_NAME_RULE}"


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
