"""Placement simulation: four policies side by side on the operator's real placement code.

A fluid model of one fleet over ``--epochs`` epochs ("minutes"). Demand: ``--adapters``
adapters with Zipf(s) popularity whose ranks shift every epoch (``--shift`` of the adapters
swap rank with a random other one); one pod is replaced every epoch (a rolling restart), so
even a static policy has some churn. Every pod can hold ``--capacity`` adapters (the
workers' ``--max-loaded-loras``) and serves ``--pod-rate`` units of demand (mean utilisation
``--utilisation``). An adapter's demand is split evenly over the pods that serve it.

Policies:
  fixed-r    every adapter on its top ``--replicas`` HRW pods (``placement.place``), capacity ignored
  all-pods   every adapter on every pod (Dynamo), capacity ignored
  affinity   prefer-where-loaded (the gateway's LoRA affinity): an adapter stays on the pods that
             held it while their load is below 1.25x the mean, else it is loaded on the least
             loaded pod; a full pod evicts its least-demanded adapter
  ours       demand-aware replicas (``ceil(demand / target)``, at least ``--replicas``; the target is
             ``--replica-target`` x the mean pod load; a stand-in for outcome 2's autoscaler) placed
             hottest first along each adapter's HRW order (``placement.place_within``), skipping pods
             at capacity or at 1.25x the mean demand load (bounded loads weighted by demand); no
             hysteresis yet, so its churn is an upper bound

Reported per policy: max/mean pod load, p99 queueing delay (M/M/1 per pod, in units of the mean
service time), adapter loads per epoch (churn), and over-capacity placements (what would be 507s).

    python bench/sim_placement.py                                  # the full grid
    python bench/sim_placement.py --adapters 200 --pods 20 --zipf 1.1 --epochs 3   # smoke run
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import log, write_json
from lorafleet_operator.placement import DEFAULT_EPSILON, place, place_within

Placement = dict[str, list[str]]
AFFINITY_THRESHOLD = 1.25  # the gateway moves on when a holder's load exceeds this x the mean


def zipf_demand(names: list[str], s: float) -> dict[str, float]:
    weights = [1 / (rank + 1) ** s for rank in range(len(names))]
    total = sum(weights)
    return {name: w / total for name, w in zip(names, weights, strict=True)}


def shift(order: list[str], fraction: float, rng: random.Random) -> list[str]:
    """Swap the popularity rank of ``fraction`` of the adapters with random others."""
    order = list(order)
    for _ in range(int(fraction * len(order))):
        i, j = rng.randrange(len(order)), rng.randrange(len(order))
        order[i], order[j] = order[j], order[i]
    return order


def pod_loads(placement: Placement, demand: dict[str, float], pods: list[str]) -> dict[str, float]:
    load = dict.fromkeys(pods, 0.0)
    for name, held in placement.items():
        for pod in held:
            load[pod] += demand[name] / len(held)
    return load


def p99_wait(load: dict[str, float], pod_rate: float) -> float:
    """The worst pod's p99 M/M/1 queueing delay, in mean service times (inf when overloaded)."""
    worst = 0.0
    for demand in load.values():
        rho = demand / pod_rate
        if rho >= 1:
            return math.inf
        if rho > 0.01:  # P(wait > t) = rho * exp(-(1 - rho) t); service time 1
            worst = max(worst, max(0.0, math.log(100 * rho)) / (1 - rho))
    return worst


def fixed_r(names: list[str], pods: list[str], replicas: int) -> Placement:
    return {name: place(name, pods, replicas) for name in names}


def all_pods(names: list[str], pods: list[str]) -> Placement:
    return {name: list(pods) for name in names}


def affinity(previous: Placement, demand: dict[str, float], pods: list[str], capacity: int) -> Placement:
    """Prefer-where-loaded, fluid: hottest adapters first, each kept where it was while those pods
    are below the threshold, else added on the least loaded pod (evicting its coldest adapter)."""
    mean = sum(demand.values()) / len(pods)
    held = {pod: {n for n, ps in previous.items() if pod in ps} for pod in pods}
    load = dict.fromkeys(pods, 0.0)
    placement: Placement = {}
    for name in sorted(demand, key=lambda n: -demand[n]):
        current = [p for p in previous.get(name, []) if p in held and name in held[p]]
        while not current or load[min(current, key=load.__getitem__)] + demand[name] / len(current) > (
            AFFINITY_THRESHOLD * mean
        ):
            spare = [p for p in pods if p not in current]
            if not spare:
                break
            pod = min(spare, key=load.__getitem__)
            if len(held[pod]) >= capacity:
                coldest = min(held[pod], key=lambda n: (n in placement, demand[n]))
                held[pod].discard(coldest)
                if coldest in placement and pod in placement[coldest]:
                    placement[coldest].remove(pod)
            held[pod].add(name)
            current.append(pod)
        placement[name] = current
        for pod in current:
            load[pod] += demand[name] / len(current)
    return placement


def ours(demand: dict[str, float], pods: list[str], capacity: int, replicas: int, target_share: float) -> Placement:
    """Replicas grow with demand (a replica carries at most ``target_share`` of a pod's mean load);
    placed hottest first by the operator's bounded-load walk (``placement.place_within``): a pod has
    room below its capacity and below 1.25x the mean demand load (bounded loads, weighted by demand)."""
    mean = sum(demand.values()) / len(pods)
    target = target_share * mean
    count = dict.fromkeys(pods, 0)
    load = dict.fromkeys(pods, 0.0)
    placement: Placement = {}
    for name in sorted(demand, key=lambda n: (-demand[n], n)):
        wanted = min(len(pods), max(replicas, math.ceil(demand[name] / target)))
        share = demand[name] / wanted
        bound = (1 + DEFAULT_EPSILON) * mean - share
        chosen = place_within(name, pods, wanted, lambda p, bound=bound: count[p] < capacity and load[p] <= bound)
        if len(chosen) < wanted:  # no pod under the bound: the least loaded ones with room
            rest = [p for p in pods if p not in chosen and count[p] < capacity]
            chosen += sorted(rest, key=lambda p: (load[p], p))[: wanted - len(chosen)]
        for pod in chosen:
            count[pod] += 1
            load[pod] += demand[name] / len(chosen)
        placement[name] = chosen
    return placement


def simulate(args: argparse.Namespace, s: float, pod_count: int) -> dict[str, Any]:
    rng = random.Random(args.seed)
    names = [f"org/adapter-{i:05d}" for i in range(args.adapters)]
    order = list(names)
    rng.shuffle(order)
    pods = [f"worker-{i}" for i in range(pod_count)]
    next_pod = pod_count
    capacity = args.capacity or math.ceil(2.5 * args.replicas * args.adapters / pod_count)
    previous: dict[str, Placement] = {}
    totals: dict[str, defaultdict[str, float]] = {}
    for _ in range(args.epochs):
        demand = zipf_demand(order, s)
        pod_rate = sum(demand.values()) / pod_count / args.utilisation
        plans = {
            "fixed-r": fixed_r(names, pods, args.replicas),
            "all-pods": all_pods(names, pods),
            "affinity": affinity(previous.get("affinity", {}), demand, pods, capacity),
            "ours": ours(demand, pods, capacity, args.replicas, args.replica_target),
        }
        for policy, plan in plans.items():
            load = pod_loads(plan, demand, pods)
            held = Counter(p for ps in plan.values() for p in ps)
            before = previous.get(policy)
            churn = sum(len(set(ps) - set(before.get(n, []))) for n, ps in plan.items()) if before else 0
            t = totals.setdefault(policy, defaultdict(float))
            t["max_over_mean"] = max(t["max_over_mean"], max(load.values()) / (sum(load.values()) / pod_count))
            t["p99_wait"] = max(t["p99_wait"], p99_wait(load, pod_rate))
            t["churn"] += churn
            t["over_capacity"] += sum(max(0, n - capacity) for n in held.values())
            t["unplaced"] += sum(1 for ps in plan.values() if not ps)
        previous = plans
        order = shift(order, args.shift, rng)
        pods = [*pods[1:], f"worker-{next_pod}"]  # rolling restart: one pod replaced per epoch
        next_pod += 1
    changes = max(1, args.epochs - 1)
    return {
        policy: {
            "max_over_mean_load": round(t["max_over_mean"], 3),
            "p99_wait_service_times": round(t["p99_wait"], 2) if math.isfinite(t["p99_wait"]) else "overloaded",
            "adapter_loads_per_epoch": round(t["churn"] / changes, 1),
            "over_capacity_placements": int(t["over_capacity"]),
            "unplaced_adapter_epochs": int(t["unplaced"]),
        }
        for policy, t in totals.items()
    } | {"capacity": capacity}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=1000)
    ap.add_argument("--zipf", type=float, nargs="+", default=[0.8, 1.1, 1.4])
    ap.add_argument("--pods", type=int, nargs="+", default=[20, 50, 200])
    ap.add_argument("--capacity", type=int, default=0, help="adapters per pod (0: 2.5x the fixed-R mean)")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--replica-target", type=float, default=0.5, help="ours: demand per replica / mean pod load")
    ap.add_argument("--shift", type=float, default=0.05)
    ap.add_argument("--utilisation", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--out", default="", help="write the results to bench/<out>.json")
    args = ap.parse_args()
    results = []
    for s in args.zipf:
        for pod_count in args.pods:
            row = {"zipf": s, "pods": pod_count, **simulate(args, s, pod_count)}
            results.append(row)
            log(f"zipf {s} pods {pod_count} capacity {row['capacity']}")
            for policy in ("fixed-r", "all-pods", "affinity", "ours"):
                log(f"  {policy:9s} {row[policy]}")
    if args.out:
        write_json(args.out, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
