"""Rendezvous (highest-random-weight) placement of adapters on worker pods.

The score of pod ``p`` for model ``m`` is the first 8 bytes (big-endian) of
``BLAKE3(utf8(m) ‖ 0x00 ‖ utf8(p))``: "‖" is concatenation with one NUL byte as
separator, which can appear in neither a modelName nor a pod name, so distinct
(model, pod) pairs never hash the same input. A model is placed on the
``replicas`` pods with the highest scores (ties, astronomically unlikely, broken
by pod name). Adding a pod moves a model only if the new pod enters its top
``replicas``; removing a pod moves only the models it held.

Capacity (``assign``, ``place_within``): consistent hashing with bounded loads (Mirrokni,
Thorup, Zadimoghaddam 2018) on top of HRW. A model walks its HRW order and skips pods that
are full: a pod is full at its own capacity (the worker's ``--max-loaded-loras``) or at the
balance bound ``ceil((1 + epsilon) * m / n)`` (``m`` replicas asked for in all, ``n`` pods),
whichever is lower. No pod ever holds more than either; a model whose top pods have room lands
exactly where plain HRW puts it, so movement stays close to HRW's minimum.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

import blake3

SEPARATOR = b"\x00"
DEFAULT_EPSILON = 0.25  # the balance bound is 1.25x the mean load


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


def load_bound(total_replicas: int, pod_count: int, epsilon: float = DEFAULT_EPSILON) -> int:
    """The most models one pod may hold for balance: ``ceil((1 + epsilon) * total / pods)``, at least 1."""
    if epsilon < 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon}")
    if pod_count < 1:
        return 0
    return max(1, math.ceil((1 + epsilon) * total_replicas / pod_count))


def place_within(model_name: str, pods: Iterable[str], replicas: int, has_room: Callable[[str], bool]) -> list[str]:
    """The first ``replicas`` pods of ``model_name``'s HRW order for which ``has_room`` holds, best first.

    Fewer (possibly none) when not enough pods have room."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    chosen: list[str] = []
    for pod in rank(model_name, pods):
        if len(chosen) == replicas:
            break
        if has_room(pod):
            chosen.append(pod)
    return chosen


def assign(
    replicas: Mapping[str, int], capacity: Mapping[str, int | None], epsilon: float = DEFAULT_EPSILON
) -> dict[str, list[str]]:
    """Place every model (name -> replicas) on the pods (name -> capacity, None = unlimited).

    Bounded-load consistent hashing: models in name order, each on the first pods of its HRW
    order whose load is below ``min(capacity, load_bound)``. Deterministic; a model that does
    not fit gets fewer pods than asked for (an empty list when none has room)."""
    pods = sorted(capacity)
    total = sum(min(r, len(pods)) for r in replicas.values())
    bound = load_bound(total, len(pods), epsilon)
    limit = {p: bound if capacity[p] is None else min(bound, capacity[p] or 0) for p in pods}
    load = dict.fromkeys(pods, 0)
    placement: dict[str, list[str]] = {}
    for name in sorted(replicas):
        chosen = place_within(name, pods, replicas[name], lambda pod: load[pod] < limit[pod])
        for pod in chosen:
            load[pod] += 1
        placement[name] = chosen
    return placement
