"""Bounded-load placement (``placement.assign`` / ``place_within``): caps, determinism, movement."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st
from lorafleet_operator.placement import assign, load_bound, place, place_within, rank

ADAPTERS = {f"org/adapter-{i}": 2 for i in range(3000)}


def loads(placement: dict[str, list[str]]) -> Counter[str]:
    return Counter(p for pods in placement.values() for p in pods)


def moved(before: dict[str, list[str]], after: dict[str, list[str]]) -> int:
    """Replica slots that changed pod (what the operator must load elsewhere)."""
    return sum(len(set(after[m]) - set(before[m])) for m in before)


@settings(max_examples=40, deadline=None)
@given(
    caps=st.lists(st.one_of(st.none(), st.integers(0, 12)), min_size=1, max_size=10),
    replicas=st.lists(st.integers(1, 4), min_size=1, max_size=40),
    epsilon=st.sampled_from([0.0, 0.1, 0.25, 1.0]),
)
def test_never_above_capacity_or_bound_and_deterministic(
    caps: list[int | None], replicas: list[int], epsilon: float
) -> None:
    capacity = {f"worker-{i}": c for i, c in enumerate(caps)}
    models = {f"lora-{i}": r for i, r in enumerate(replicas)}
    placement = assign(models, capacity, epsilon)
    assert placement == assign(dict(reversed(models.items())), dict(reversed(capacity.items())), epsilon)
    bound = load_bound(sum(min(r, len(caps)) for r in replicas), len(caps), epsilon)
    for pod, n in loads(placement).items():
        assert n <= bound
        assert capacity[pod] is None or n <= capacity[pod]
    for name, pods in placement.items():
        assert len(set(pods)) == len(pods) <= models[name]
        # a model's pods keep their HRW order
        assert pods == [p for p in rank(name, capacity) if p in pods]


def test_everything_fits_when_capacity_allows_and_load_is_flat() -> None:
    capacity: dict[str, int | None] = {f"worker-{i}": None for i in range(20)}
    placement = assign(ADAPTERS, capacity, epsilon=0.05)
    assert all(len(p) == 2 for p in placement.values())
    held = loads(placement)
    assert max(held.values()) <= 1.05 * 2 * len(ADAPTERS) / 20 == 315
    # plain HRW on the same input is less even (max 326): the bound is what flattens it
    hrw = Counter(p for m in ADAPTERS for p in place(m, capacity, 2))
    assert max(hrw.values()) > max(held.values())


def test_what_does_not_fit_is_reported_as_missing_replicas() -> None:
    capacity: dict[str, int | None] = {"worker-0": 3, "worker-1": 3, "worker-2": 0}
    placement = assign({f"lora-{i}": 2 for i in range(5)}, capacity)
    assert sum(len(p) for p in placement.values()) == 6  # the fleet holds 6 of the 10 asked for
    assert loads(placement) == Counter({"worker-0": 3, "worker-1": 3})
    assert [name for name, pods in placement.items() if len(pods) < 2]  # these get InsufficientCapacity


def test_movement_close_to_plain_hrw_when_pods_come_and_go() -> None:
    """3,000 adapters x 2 replicas on 20 pods with a capacity cap: movement vs HRW's minimum."""
    pods = [f"worker-{i}" for i in range(20)]
    cap = 330  # 6,000 replicas on 20 pods: mean 300, room for 6,600 (6,270 with one pod gone)
    capacity: dict[str, int | None] = dict.fromkeys(pods, cap)
    base = assign(ADAPTERS, capacity)
    hrw_base = {m: place(m, pods, 2) for m in ADAPTERS}
    for change in ("remove", "add"):
        changed = dict(capacity)
        if change == "remove":
            del changed["worker-7"]
        else:
            changed["worker-20"] = cap
        ours = assign(ADAPTERS, changed)
        hrw = {m: place(m, changed, 2) for m in ADAPTERS}
        assert max(loads(ours).values()) <= cap
        assert all(len(p) == 2 for p in ours.values())
        ours_moved, hrw_moved = moved(base, ours), moved(hrw_base, hrw)
        # HRW moves only what it must (~290 slots) but overfills pods (341 on one when a pod
        # leaves); bounded loads respect the cap and move at most a few percent more
        assert 0 < hrw_moved <= ours_moved <= 1.25 * hrw_moved, (change, ours_moved, hrw_moved)
        if change == "remove":
            assert max(loads(hrw).values()) > cap


def test_place_within_skips_full_pods_in_hrw_order() -> None:
    pods = [f"worker-{i}" for i in range(6)]
    order = rank("lora", pods)
    full = set(order[:2])
    assert place_within("lora", pods, 2, lambda p: p not in full) == order[2:4]
    assert place_within("lora", pods, 2, lambda p: False) == []
