"""HRW placement benchmark: compute time and churn, for the operator's own placement function.

- full: place 10,000 adapters on 200 pods (replicas 2) from scratch;
- incremental: one pod is added; only each adapter's score for the new pod is computed and
  compared with its current R-th best score (what the operator's re-placement needs);
- churn: the fraction of (adapter, pod) placements that moved, vs the optimum R/(N+1).

    python bench/bench_placement.py [--adapters 10000] [--pods 200] [--replicas 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import log, write_json
from lorafleet_operator.placement import hrw_score, place


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=10_000)
    ap.add_argument("--pods", type=int, default=200)
    ap.add_argument("--replicas", type=int, default=2)
    args = ap.parse_args()
    models = [f"org/adapter-{i}" for i in range(args.adapters)]
    pods = [f"worker-{i:04d}" for i in range(args.pods)]

    t0 = time.perf_counter()
    before = {m: place(m, pods, args.replicas) for m in models}
    full_s = time.perf_counter() - t0

    new_pod = f"worker-{args.pods:04d}"
    t0 = time.perf_counter()
    moved = 0
    for m in models:
        held = before[m]
        worst = hrw_score(m, held[-1])
        if hrw_score(m, new_pod) > worst:
            moved += 1  # the new pod replaces the last holder: one placement moves
    incremental_s = time.perf_counter() - t0

    after = {m: place(m, [*pods, new_pod], args.replicas) for m in models}
    moved_full = sum(len(set(after[m]) - set(before[m])) for m in models)
    assert moved_full == moved, (moved_full, moved)
    total = args.adapters * args.replicas
    optimum = args.replicas / (args.pods + 1)
    result = {
        "adapters": args.adapters,
        "pods": args.pods,
        "replicas": args.replicas,
        "full_placement_s": round(full_s, 3),
        "incremental_add_pod_s": round(incremental_s, 4),
        "moved_fraction": round(moved / total, 5),
        "optimum_fraction": round(optimum / args.replicas, 5),
        "moved_vs_optimum": round((moved / args.adapters) / optimum, 3),
    }
    log(f"placement: {result}")
    write_json("placement", result)


if __name__ == "__main__":
    main()
