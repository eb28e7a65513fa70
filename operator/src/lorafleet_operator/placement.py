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
are full: a pod is full at its own capacity (the worker's ``--max-loaded-loras``) and, in
``assign``, at the count bound ``ceil((1 + epsilon) * m / n)`` (``m`` replicas asked for in all,
``n`` pods), whichever is lower. No pod ever holds more than either; a model whose top pods have
room lands exactly where plain HRW puts it, so movement stays close to HRW's minimum. The
reconciler uses ``place_within`` with capacity alone for fixed-replica adapters.

Demand-weighted balance (``Loads``, ``place_balanced``, ``relief``; what the reconciler does for
autoscaled adapters by default, and what ``bench/sim_placement.py`` measures as ``ours``): a pod's
load is the sum, over the adapters it holds, of the adapter's weight (its demand as the routers
report it; 1 each when no demand is known) divided by the number of pods holding it; the bound is
``(1 + epsilon) x`` the mean load, the entry level ``(1 - hysteresis) x`` the bound. One adapter at
a time, given the pods it is placed on now:
- replicas it holds stay, unless their pod is above the bound and the adapter is among the shares
  that pod sheds: largest first (ties by name), skipping those no other pod can take, until the
  pod is at or below the entry level;
- a shed replica goes to the first pod of the adapter's HRW order (with room, not holding it)
  whose load stays at or below the entry level or, when that is higher, at or below the shedding
  pod's load less the gap ``bound - entry`` (the higher of the two pods drops by at least the
  gap, so the sum of squared loads falls and nothing moves back and forth); else it stays;
- new replicas go to the first pods of the HRW order with room at or below the entry level; when
  there are not enough, to the least loaded pods with room (HRW order on ties).
Capacity is never exceeded; the same listings and weights give the same placement (sums are
``math.fsum``, ties go by HRW order or name). The gap between the entry level and the bound is the
hysteresis: demand that jitters by less than it moves nothing once placed. ``relief`` names what
pods above the bound would shed after a placement, for the caller to place again.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping

import blake3

SEPARATOR = b"\x00"
DEFAULT_EPSILON = 0.25  # the balance bound is 1.25x the mean load
DEFAULT_HYSTERESIS = 0.1  # new replicas land only at or below 0.9x the bound


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

    One hash per placed pod instead of ranking every pod: what a pod event costs per model (none
    for a model that wants no replica)."""
    if replicas < 1:
        return False
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


class Loads:
    """Demand-weighted load of each pod: the sum over the adapters it holds of weight / holders.

    ``held``: pod -> the adapters it holds (its ``GET /v1/loras``); ``set`` updates it in place.
    ``weights``: adapter -> demand; adapters absent weigh 0 (idle). None, or no positive weight at
    all, means no demand is known: every adapter weighs 1."""

    def __init__(self, held: dict[str, set[str]], weights: Mapping[str, float] | None = None) -> None:
        self.held = held
        self.weights = weights if weights is not None and any(w > 0 for w in weights.values()) else None
        self.holders: Counter[str] = Counter(name for names in held.values() for name in names)
        # fsum: correctly rounded whatever the order of the set, so the same listings give the same loads
        self.load = {pod: math.fsum(self.share(name) for name in names) for pod, names in held.items()}

    def weight(self, name: str) -> float:
        return 1.0 if self.weights is None else max(0.0, self.weights.get(name, 0.0))

    def share(self, name: str) -> float:
        """The load ``name`` puts on each pod that holds it."""
        return self.weight(name) / max(1, self.holders[name])

    def without(self, name: str, pod: str) -> float:
        """The load of ``pod`` without ``name``."""
        load = self.load.get(pod, 0.0)
        return load - self.share(name) if name in self.held.get(pod, ()) else load

    def set(self, name: str, pods: Iterable[str]) -> None:
        """``name`` is now held by exactly ``pods`` (pods not in ``held`` are added)."""
        before = [p for p, names in self.held.items() if name in names] if self.holders[name] else []
        for pod in before:
            self.load[pod] -= self.share(name)
            self.held[pod].discard(name)
        after = list(dict.fromkeys(pods))
        self.holders[name] = len(after)
        for pod in after:
            self.held.setdefault(pod, set()).add(name)
            self.load[pod] = self.load.get(pod, 0.0) + self.share(name)


def place_balanced(
    model_name: str,
    pods: Iterable[str],
    replicas: int,
    current: Iterable[str],
    loads: Loads,
    fits: Callable[[str, str], bool],
    epsilon: float = DEFAULT_EPSILON,
    hysteresis: float = DEFAULT_HYSTERESIS,
) -> list[str]:
    """``replicas`` pods for ``model_name`` (fewer when not enough fit), in HRW order, balanced by
    demand (see the module docstring). ``current``: the pods it is placed on now; ``fits(pod,
    adapter)``: the pod has capacity for that adapter. Deterministic: the same inputs give the same
    placement."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if epsilon < 0 or not 0 <= hysteresis < 1:
        raise ValueError(f"need epsilon >= 0 and 0 <= hysteresis < 1, got {epsilon}, {hysteresis}")
    order = rank(model_name, pods)
    if not order:
        return []
    weight = loads.weight(model_name)
    base = {p: loads.without(model_name, p) for p in order}
    bound = (1 + epsilon) * math.fsum([*base.values(), weight]) / len(order)
    enter = (1 - hysteresis) * bound
    share = weight / replicas
    held = set(current)
    kept = [p for p in order if p in held and fits(p, model_name)][:replicas]  # a shrink drops the HRW-last
    limits = {}  # pod that sheds this adapter -> the load a pod taking it over may reach
    for pod in kept:
        limit = _shed_limit(loads, order, fits, pod, model_name, share, base[pod] + share, bound, enter)
        if limit is not None:
            limits[pod] = limit
    chosen = [p for p in kept if p not in limits]
    new = [p for p in order if p not in held and base[p] + share <= enter and fits(p, model_name)]
    chosen += new[: replicas - len(kept)]  # growing: the first pods of the HRW order below the entry level
    for pod, limit in limits.items():  # a shed replica: the first pod of the HRW order that takes it, else it stays
        to = (p for p in order if p not in held and p not in chosen and base[p] + share <= limit)
        chosen.append(next((p for p in to if fits(p, model_name)), pod))
    if len(chosen) < replicas:  # growing, no pod below the entry level: the least loaded with room
        rest = [p for p in order if p not in chosen and p not in held and fits(p, model_name)]
        chosen += sorted(rest, key=base.__getitem__)[: replicas - len(chosen)]  # stable: HRW order on ties
    position = {p: i for i, p in enumerate(order)}
    return sorted(chosen, key=position.__getitem__)


def _shed_limit(
    loads: Loads,
    pods: list[str],
    fits: Callable[[str, str], bool],
    pod: str,
    name: str,
    share: float,
    load: float,
    bound: float,
    enter: float,
) -> float | None:
    """When ``pod`` (load ``load`` with ``name`` at ``share``) sheds ``name`` (``_shedding``): the
    load a pod taking it over may reach; None when it keeps it."""
    if load <= bound:
        return None
    others = [(loads.share(n), n) for n in loads.held.get(pod, ()) if n != name]
    shed = _shedding(loads, pods, fits, pod, [*others, (share, name)], load, bound, enter, stop=name)
    return shed[-1][1] if shed and shed[-1][0] == name else None


def _shedding(
    loads: Loads,
    pods: list[str],
    fits: Callable[[str, str], bool],
    pod: str,
    items: list[tuple[float, str]],
    load: float,
    bound: float,
    enter: float,
    stop: str | None = None,
) -> list[tuple[str, float]]:
    """What ``pod`` (at ``load``, holding ``items``: (share, name)) sheds: its largest shares first
    (ties by name), until its load is at or below ``enter``, each with the load a pod taking it over
    may reach: ``enter``, or, when that is higher, the pod's load before shedding it less the
    hysteresis gap ``bound - enter`` (a move that lowers the higher of the two pods by at least the
    gap: no adapter moves back and forth). Shares no other pod can take are skipped; ``stop`` is
    returned as the last one when it is reached."""
    out: list[tuple[str, float]] = []
    for s, n in sorted(items, key=lambda item: (-item[0], item[1])):
        if load <= enter:
            break
        limit = max(enter, load - (bound - enter))
        if n == stop:
            out.append((n, limit))
            break
        if any(q != pod and n not in loads.held.get(q, ()) and loads.load.get(q, 0.0) + s <= limit and fits(q, n)
               for q in pods):  # fmt: skip
            out.append((n, limit))
            load -= s
    return out


def relief(
    pods: Iterable[str],
    loads: Loads,
    fits: Callable[[str, str], bool],
    epsilon: float = DEFAULT_EPSILON,
    hysteresis: float = DEFAULT_HYSTERESIS,
) -> list[str]:
    """The adapters that pods above the bound would shed (``place_balanced`` moves them when they
    are next placed): what to reconcile again after a placement left a pod above the bound."""
    order = sorted(set(pods))
    if not order:
        return []
    bound = (1 + epsilon) * math.fsum(loads.load.get(p, 0.0) for p in order) / len(order)
    out: list[str] = []
    for pod in order:
        load = loads.load.get(pod, 0.0)
        if load > bound:
            items = [(loads.share(n), n) for n in loads.held.get(pod, ())]
            out += [n for n, _ in _shedding(loads, order, fits, pod, items, load, bound, (1 - hysteresis) * bound)]
    return sorted(set(out))
