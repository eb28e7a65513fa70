"""Demand-weighted bounded loads (``placement.place_balanced``): the bound, capacity, determinism,
minimal movement when pods come and go, and no movement in a steady state (also under jitter)."""

from __future__ import annotations

import math
import random

import pytest
from lorafleet_operator.placement import DEFAULT_EPSILON, Loads, place_balanced, place_within, rank, relief

Placement = dict[str, list[str]]
ADAPTERS = [f"org/adapter-{i:04d}" for i in range(300)]
PODS = [f"worker-{i}" for i in range(12)]


def zipf(names: list[str], s: float = 1.1, seed: int = 7) -> dict[str, float]:
    order = list(names)
    random.Random(seed).shuffle(order)
    return {name: 100 / (rank + 1) ** s for rank, name in enumerate(order)}


def counts(demand: dict[str, float], pods: int, floor: int = 2) -> dict[str, int]:
    """Replicas as the autoscaler sizes them: one replica carries at most the mean pod load."""
    mean = sum(demand.values()) / pods
    return {name: min(pods, max(floor, math.ceil(d / mean))) for name, d in demand.items()}


class Fleet:
    """Pods, their listings and the operator's passes: one ``place_balanced`` per adapter, then the
    adapters ``relief`` names placed again (what the next demand polls re-queue)."""

    def __init__(self, pods: list[str], capacity: int | None = None) -> None:
        self.pods = list(pods)
        self.capacity = capacity
        self.held: dict[str, set[str]] = {p: set() for p in pods}
        self.placement: Placement = {}

    def fits(self, pod: str, name: str) -> bool:
        names = self.held[pod]
        return self.capacity is None or len(names) - (name in names) < self.capacity

    def loads(self, demand: dict[str, float] | None) -> Loads:
        return Loads(self.held, demand)

    def one(self, name: str, replicas: int, loads: Loads) -> list[str]:
        current = [p for p in self.placement.get(name, []) if p in self.held]
        chosen = place_balanced(name, self.pods, replicas, current, loads, self.fits)
        loads.set(name, chosen)
        self.placement[name] = chosen
        for pod in chosen:  # capacity is a hard cap after every single placement
            assert self.capacity is None or len(self.held[pod]) <= self.capacity
        return chosen

    def apass(self, demand: dict[str, float], replicas: dict[str, int], rounds: int = 6) -> int:
        """One pass over every adapter plus relief rounds; the replicas that moved or were added."""
        before = {n: set(ps) for n, ps in self.placement.items()}
        loads = self.loads(demand)
        for name in sorted(replicas):
            self.one(name, replicas[name], loads)
        for _ in range(rounds):
            again = relief(self.pods, loads, self.fits)
            for name in again:
                self.one(name, replicas[name], loads)
            if not again:
                break
        return sum(len(set(ps) - before.get(n, set())) for n, ps in self.placement.items())

    def resize(self, pods: list[str]) -> None:
        self.pods = list(pods)
        self.held = {p: self.held.get(p, set()) for p in pods}

    def max_over_mean(self, demand: dict[str, float]) -> float:
        load = dict.fromkeys(self.pods, 0.0)
        for name, on in self.placement.items():
            for pod in on:
                load[pod] += demand[name] / len(on)
        return max(load.values()) / (sum(load.values()) / len(self.pods))


def converged(demand: dict[str, float], pods: list[str] = PODS, capacity: int | None = None) -> Fleet:
    fleet = Fleet(pods, capacity)
    replicas = counts(demand, len(pods))
    fleet.apass(demand, replicas)
    fleet.apass(demand, replicas)
    return fleet


def test_the_bound_holds_where_the_plain_hrw_walk_overloads() -> None:
    demand = zipf(ADAPTERS)
    replicas = counts(demand, len(PODS))
    fleet = converged(demand)
    assert fleet.max_over_mean(demand) <= 1 + DEFAULT_EPSILON + 1e-9
    plain = Fleet(PODS)  # the same counts on each adapter's top HRW pods
    plain.placement = {n: place_within(n, PODS, replicas[n], lambda _: True) for n in ADAPTERS}
    assert plain.max_over_mean(demand) > 1.5  # the skew is real: the bound is what balances it


def test_capacity_is_never_exceeded_and_a_full_pod_is_never_chosen() -> None:
    demand = zipf(ADAPTERS)
    capacity = math.ceil(1.1 * sum(counts(demand, len(PODS)).values()) / len(PODS))
    fleet = converged(demand, capacity=capacity)  # ``Fleet.one`` asserts the cap after every placement
    assert all(len(names) <= capacity for names in fleet.held.values())
    assert all(fleet.placement[n] for n in ADAPTERS)  # tight, but everything fits somewhere
    loads = fleet.loads(demand)
    full = {p for p, names in fleet.held.items() if len(names) >= capacity}
    assert full  # the cap binds somewhere
    newcomer = place_balanced("org/new", PODS, 3, [], loads, fleet.fits)
    assert newcomer and not full & set(newcomer)


def test_same_inputs_same_placement_whatever_the_order_given() -> None:
    demand = zipf(ADAPTERS)
    a, b = converged(demand), converged(demand)
    assert a.placement == b.placement
    loads = a.loads(demand)
    name = ADAPTERS[5]
    current = a.placement[name]
    once = place_balanced(name, PODS, 3, current, loads, a.fits)
    assert once == place_balanced(name, list(reversed(PODS)), 3, list(reversed(current)), loads, a.fits)
    assert once == sorted(once, key=rank(name, PODS).index)  # best first, like ``place``


@pytest.mark.parametrize("seed", [7, 8, 9])
def test_zero_moves_in_a_steady_state_also_under_jittered_demand(seed: int) -> None:
    """Demand jittering by +-10 % per adapter and pass moves nothing: the gap between the entry level
    and the bound (hysteresis 0.1) absorbs it (with no gap, these same runs move replicas)."""
    demand = zipf(ADAPTERS, seed=seed)
    replicas = counts(demand, len(PODS))
    fleet = converged(demand)
    settled = {n: list(ps) for n, ps in fleet.placement.items()}
    assert fleet.apass(demand, replicas) == 0
    rng = random.Random(3)
    for _ in range(8):  # replica counts unchanged (the autoscaler's own hysteresis keeps them)
        jittered = {n: d * rng.uniform(0.9, 1.1) for n, d in demand.items()}
        assert fleet.apass(jittered, replicas) == 0
    assert fleet.placement == settled


def test_minimal_movement_when_a_pod_leaves_or_joins() -> None:
    demand = zipf(ADAPTERS)
    replicas = counts(demand, len(PODS))
    fleet = converged(demand)
    before = {n: set(ps) for n, ps in fleet.placement.items()}
    gone = PODS[4]
    lost = sum(gone in ps for ps in before.values())
    fleet.resize([p for p in PODS if p != gone])
    del fleet.held  # the pod's listing is gone with it
    fleet.held = {p: {n for n, ps in fleet.placement.items() if p in ps} for p in fleet.pods}
    moved = fleet.apass(demand, replicas)
    assert moved >= lost  # every replica it held is placed again
    assert moved <= lost + lost // 4, (moved, lost)  # and little else moves
    kept = sum(len(before[n] & set(ps)) for n, ps in fleet.placement.items())
    assert kept >= sum(len(ps) for ps in before.values()) - lost - lost // 4

    fleet = converged(demand)
    before = {n: set(ps) for n, ps in fleet.placement.items()}
    fleet.resize([*PODS, "worker-new"])
    moved = fleet.apass(demand, replicas)
    share = sum(len(ps) for ps in before.values()) / (len(PODS) + 1)  # a fair share of the new pod
    assert moved <= 2 * share, (moved, share)
    from_scratch = converged(demand, [*PODS, "worker-new"])
    rebuilt = sum(len(set(ps) - before[n]) for n, ps in from_scratch.placement.items())
    assert moved < rebuilt / 2  # far fewer than placing everything again


def test_equal_weights_when_no_demand_is_known() -> None:
    held = {"a": {"x", "y"}, "b": {"y"}}
    for weights in (None, {}, {"x": 0.0, "y": 0.0}):
        loads = Loads(held, weights)
        assert loads.weight("x") == loads.weight("z") == 1.0
        assert loads.load == {"a": 1.5, "b": 0.5}
    loads = Loads(held, {"x": 4.0})  # known demand: an adapter the routers did not report is idle
    assert (loads.weight("x"), loads.weight("y")) == (4.0, 0.0)
    assert loads.load == {"a": 4.0, "b": 0.0}


def test_an_adapter_alone_lands_on_its_top_hrw_pods() -> None:
    """Nothing else placed: its share is above any bound, so it takes the least loaded pods, ties in
    HRW order, i.e. exactly where ``place`` puts it, and it stays there pass after pass."""
    loads = Loads({p: set() for p in PODS}, None)
    chosen = place_balanced("org/solo", PODS, 2, [], loads, lambda *_: True)
    assert chosen == rank("org/solo", PODS)[:2]
    loads.set("org/solo", chosen)
    assert place_balanced("org/solo", PODS, 2, chosen, loads, lambda *_: True) == chosen
    assert place_balanced("org/solo", PODS, 1, chosen, loads, lambda *_: True) == chosen[:1]  # shrink: HRW-last goes


def test_an_overloaded_pod_sheds_its_largest_movable_share_only() -> None:
    held = {"p1": {"hot", "warm", "cold"}, "p2": {"c1"}, "p3": {"c2"}, "p4": {"c3"}}
    demand = {"hot": 6.0, "warm": 2.0, "cold": 0.5, "c1": 0.5, "c2": 0.5, "c3": 0.5}
    loads = Loads(held, demand)  # p1 carries 8.5 of 10: mean 2.5, bound 3.125
    assert relief(held, loads, lambda *_: True) == ["hot"]  # moving it (to p2, 0.5 + 6 < 8.5 - gap) helps most
    kept = place_balanced("cold", held, 1, ["p1"], loads, lambda *_: True)
    assert kept == ["p1"]  # the small one stays: the hot one's move is what brings p1 down
    moved = place_balanced("hot", held, 1, ["p1"], loads, lambda *_: True)
    assert moved != ["p1"]


@pytest.mark.parametrize("bad", [{"replicas": 0}, {"epsilon": -0.1}, {"hysteresis": 1.0}])
def test_invalid_arguments(bad: dict[str, float]) -> None:
    kwargs: dict = {"replicas": 1} | bad
    replicas = kwargs.pop("replicas")
    with pytest.raises(ValueError):
        place_balanced("x", PODS, replicas, [], Loads({}, None), lambda *_: True, **kwargs)


def test_same_placement_whatever_the_hash_seed() -> None:
    """Listings are sets, whose order follows ``PYTHONHASHSEED``: the placement must not."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import test_placement_balance as t; "
        "print(json.dumps(t.converged(t.zipf(t.ADAPTERS)).placement, sort_keys=True))"
    )
    here = str(Path(__file__).resolve().parent)
    runs = [
        subprocess.run(
            [sys.executable, "-c", script, here],
            env=os.environ | {"PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    ]
    assert json.loads(runs[0]) == json.loads(runs[1]) == converged(zipf(ADAPTERS)).placement
