"""Placement simulation: six policies side by side on the operator's real placement and autoscale code.

A fluid model of one fleet over ``--epochs`` epochs ("minutes"). Demand: ``--adapters``
adapters with Zipf(s) popularity whose ranks shift every epoch (``--shift`` of the adapters
swap rank with a random other one); one pod is replaced every epoch (a rolling restart), so
even a static policy has some churn. Every pod can hold ``--capacity`` adapters (the
workers' ``--max-loaded-loras``) and serves ``--pod-rate`` units of demand (mean utilisation
``--utilisation``). An adapter's demand is split evenly over the pods that serve it.

Policies:
  fixed-r      every adapter on its top ``--replicas`` HRW pods (``placement.place``), capacity ignored
  all-pods     every adapter on every pod (Dynamo), capacity ignored
  affinity     prefer-where-loaded (the gateway's LoRA affinity): an adapter stays on the pods that
               held it while their load is below 1.25x the mean, else it is loaded on the least
               loaded pod; a full pod evicts its least-demanded adapter
  ours         the operator as it runs by default for autoscaled adapters: replica counts from its
               policy (``autoscale.decide``: at least ``--replicas``, a replica carries at most
               ``--replica-target`` x the mean pod load, grow at once, shrink below ``--scale-down-at``
               of the target only after ``--cooldown`` epochs), one reconcile pass per adapter per
               epoch (name order) placing it with the operator's own function
               ``placement.place_balanced`` (demand-weighted bounded loads, ``--epsilon``, with
               hysteresis), then ``--revisits`` demand polls, each placing again the adapters that
               ``placement.relief`` names (those pods above the bound shed)
  ours-hrw     the same replica counts placed by the plain HRW walk within capacity
               (``placement.place_within``; the operator's ``--balance off``)
  fixed-r-bal  fixed ``--replicas`` placed like ``ours`` (the operator's ``--balance all`` for a
               fixed-replica adapter)

Reported per policy: max/mean pod load, p99 queueing delay (M/M/1 per pod, in units of the mean
service time), adapter loads per epoch (churn), and over-capacity placements (what would be 507s).

    python bench/sim_placement.py --out sim_placement --plot       # the full grid, JSON and PNG
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
from common import OUT_DIR, log, write_json
from lorafleet_operator.autoscale import SCALE_DOWN_AT, Policy, decide
from lorafleet_operator.placement import DEFAULT_EPSILON, Loads, place, place_balanced, place_within, relief

Placement = dict[str, list[str]]
POLICIES = ("fixed-r", "all-pods", "affinity", "ours", "ours-hrw", "fixed-r-bal")
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


class Ours:
    """The operator, one reconcile pass per adapter per epoch: replica counts from its own policy
    (``autoscale.decide``: grow at once to ``ceil(demand / target)``, shrink below half the target
    only after ``cooldown`` epochs; ``autoscale=False``: always ``replicas``), placed by its own code.

    ``balanced``: ``placement.place_balanced`` (what the reconciler does for autoscaled adapters by
    default), weighted by this epoch's demand, given the placement so far; else ``place_within``,
    the plain HRW walk within capacity (what it does for fixed-replica adapters). Adapters are
    reconciled in name order (the operator's passes come in no demand order) and each pass sees
    the pods as the earlier ones left them (the workers' listings)."""

    def __init__(
        self, replicas: int, target_share: float, cooldown: int, scale_down_at: float, balanced: bool,
        autoscale: bool = True, epsilon: float = DEFAULT_EPSILON, revisits: int = 4,
    ) -> None:  # fmt: skip
        self.replicas, self.target_share, self.cooldown = replicas, target_share, cooldown
        self.scale_down_at, self.balanced, self.autoscale, self.epsilon = scale_down_at, balanced, autoscale, epsilon
        self.revisits = revisits
        self.count: dict[str, int] = {}
        self.changed: dict[str, int] = {}
        self.previous: Placement = {}
        self.epoch = 0

    def wanted(self, name: str, demand: float, target: float, pods: int) -> int:
        if not self.autoscale:
            return min(self.replicas, pods)
        policy = Policy(min(self.replicas, pods), pods, target)
        current = self.count.get(name, policy.min_replicas)
        since = self.epoch - self.changed.get(name, -(10**9))
        decision = decide(policy, demand, current, since, cooldown=self.cooldown, scale_down_at=self.scale_down_at)
        if decision.replicas != current:
            self.changed[name] = self.epoch
        self.count[name] = decision.replicas
        return decision.replicas

    def place(self, demand: dict[str, float], pods: list[str], capacity: int) -> Placement:
        live = set(pods)
        target = self.target_share * sum(demand.values()) / len(pods)
        held: dict[str, set[str]] = {pod: set() for pod in pods}
        for name, on in self.previous.items():
            for pod in on:
                if pod in live:
                    held[pod].add(name)
        loads = Loads(held, demand)
        placement: Placement = {}
        for name in sorted(demand):
            wanted = self.wanted(name, demand[name], target, len(pods))

            def fits(pod: str, name: str) -> bool:
                return len(held[pod]) - (name in held[pod]) < capacity

            if self.balanced:
                current = [p for p in self.previous.get(name, ()) if p in live]
                chosen = place_balanced(name, pods, wanted, current, loads, fits, self.epsilon)
            else:
                chosen = place_within(name, pods, wanted, lambda pod, name=name: fits(pod, name))
            loads.set(name, chosen)
            placement[name] = chosen
        for _ in range(self.revisits if self.balanced else 0):  # the autoscale polls in the epoch
            again = relief(pods, loads, fits, self.epsilon)
            for name in again:
                wanted = self.count.get(name, self.replicas) if self.autoscale else min(self.replicas, len(pods))
                chosen = place_balanced(name, pods, wanted, placement[name], loads, fits, self.epsilon)
                loads.set(name, chosen)
                placement[name] = chosen
            if not again:
                break
        self.previous = placement
        self.epoch += 1
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
    epsilon, revisits = getattr(args, "epsilon", DEFAULT_EPSILON), getattr(args, "revisits", 4)
    common = (args.replicas, args.replica_target, args.cooldown, args.scale_down_at)
    scaled = {
        name: Ours(*common, balanced, autoscale, epsilon, revisits)
        for name, balanced, autoscale in (("ours", True, True), ("ours-hrw", False, True), ("fixed-r-bal", True, False))
    }
    for _ in range(args.epochs):
        demand = zipf_demand(order, s)
        pod_rate = sum(demand.values()) / pod_count / args.utilisation
        plans = {
            "fixed-r": fixed_r(names, pods, args.replicas),
            "all-pods": all_pods(names, pods),
            "affinity": affinity(previous.get("affinity", {}), demand, pods, capacity),
            **{name: policy.place(demand, pods, capacity) for name, policy in scaled.items()},
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
    ap.add_argument("--replica-target", type=float, default=1.0, help="ours: demand per replica / mean pod load")
    ap.add_argument("--cooldown", type=int, default=3, help="ours: epochs after a change before a shrink")
    ap.add_argument("--scale-down-at", type=float, default=SCALE_DOWN_AT, help="ours: shrink below this x target")
    ap.add_argument("--epsilon", type=float, default=DEFAULT_EPSILON, help="ours: balance bound (1 + epsilon) x mean")
    ap.add_argument(
        "--revisits", type=int, default=4, help="ours: demand polls per epoch (re-place what pods above the bound shed)"
    )
    ap.add_argument("--shift", type=float, default=0.05)
    ap.add_argument("--utilisation", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--out", default="", help="write the results to bench/<out>.json")
    ap.add_argument("--plot", action="store_true", help="write bench/sim_placement.png (load balance and churn)")
    args = ap.parse_args()
    results = []
    for s in args.zipf:
        for pod_count in args.pods:
            row = {"zipf": s, "pods": pod_count, **simulate(args, s, pod_count)}
            results.append(row)
            log(f"zipf {s} pods {pod_count} capacity {row['capacity']}")
            for policy in POLICIES:
                log(f"  {policy:9s} {row[policy]}")
    if args.out:
        write_json(args.out, {"args": vars(args), "results": results})
    if args.plot:
        plot(results, OUT_DIR / "sim_placement.png")


def plot(results: list[dict[str, Any]], png: Path) -> None:
    """Max/mean pod load and adapter loads per epoch, per policy, against the Zipf exponent (one column per fleet)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fleets = sorted({r["pods"] for r in results})
    fig, axes = plt.subplots(2, len(fleets), figsize=(4.2 * len(fleets), 7), squeeze=False)
    for col, pods in enumerate(fleets):
        rows = sorted((r for r in results if r["pods"] == pods), key=lambda r: r["zipf"])
        zipf = [r["zipf"] for r in rows]
        for policy in POLICIES:
            style = {"linewidth": 2.5} if policy == "ours" else {"linestyle": "--" if policy == "ours-hrw" else "-"}
            axes[0][col].plot(zipf, [r[policy]["max_over_mean_load"] for r in rows], marker="o", label=policy, **style)
            churn = [max(r[policy]["adapter_loads_per_epoch"], 0.5) for r in rows]
            axes[1][col].plot(zipf, churn, marker="o", label=policy, **style)
        axes[0][col].axhline(1.25, color="grey", linewidth=0.8)
        axes[0][col].set_title(f"{pods} pods, capacity {rows[0]['capacity']}")
        axes[0][col].set_yscale("log")
        axes[1][col].set_yscale("log")
        axes[1][col].set_xlabel("Zipf exponent")
    axes[0][0].set_ylabel("max / mean pod load (1.25 = bound)")
    axes[1][0].set_ylabel("adapter loads per epoch (churn)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    log(f"wrote {png}")


if __name__ == "__main__":
    main()
