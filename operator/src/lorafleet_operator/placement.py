"""Rendezvous (highest-random-weight) placement of adapters on worker pods.

The score of pod ``p`` for model ``m`` is the first 8 bytes (big-endian) of
``BLAKE3(utf8(m) ‖ 0x00 ‖ utf8(p))``: "‖" is concatenation with one NUL byte as
separator, which can appear in neither a modelName nor a pod name, so distinct
(model, pod) pairs never hash the same input. A model is placed on the
``replicas`` pods with the highest scores (ties, astronomically unlikely, broken
by pod name). Adding a pod moves a model only if the new pod enters its top
``replicas``; removing a pod moves only the models it held.
"""

from __future__ import annotations

from collections.abc import Iterable

import blake3

SEPARATOR = b"\x00"


def hrw_score(model_name: str, pod_name: str) -> int:
    """The HRW score of ``pod_name`` for ``model_name`` (a 64-bit unsigned integer)."""
    digest = blake3.blake3(model_name.encode() + SEPARATOR + pod_name.encode()).digest(length=8)
    return int.from_bytes(digest, "big")


def rank(model_name: str, pods: Iterable[str]) -> list[str]:
    """All ``pods`` ordered by descending HRW score for ``model_name`` (duplicates dropped)."""
    return sorted(set(pods), key=lambda pod: (-hrw_score(model_name, pod), pod))


def place(model_name: str, pods: Iterable[str], replicas: int) -> list[str]:
    """The ``replicas`` pods (all of them if fewer) with the highest scores, best first.

    ``pods`` must already be the eligible (Ready) pods of the model's base model.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    return rank(model_name, pods)[:replicas]


def takes(model_name: str, placement: Iterable[str], replicas: int, pod_name: str) -> bool:
    """Whether ``pod_name`` joining the eligible pods enters ``model_name``'s current ``placement``.

    One hash per placed pod instead of ranking every pod: what a pod event costs per model."""
    current = [p for p in placement if p != pod_name]
    if len(current) < replicas:
        return True
    weakest = max((-hrw_score(model_name, p), p) for p in current)  # ranked last by ``rank``
    return (-hrw_score(model_name, pod_name), pod_name) < weakest
