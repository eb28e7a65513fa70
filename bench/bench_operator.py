"""Operator benchmark: time from `kubectl apply` to all Ready for 1, 50 and 200 DynamoModels on 5 workers.

Runs on the local control plane of the e2e tests (`lorafleet_devcluster.session.shared_cluster()`: API
server + node agent; `LORAFLEET_E2E_CLUSTER=kubeconfig` uses the current kubeconfig instead),
with the plain manifests of the operator e2e tests (`lorafleet_devcluster.rawstack`): 5 worker
pods (`lorafleet/worker:dev`, a tiny llama) and the
operator pod. Adapters come from `file://` (no object store in the path being timed). "Ready"
means what the e2e tests check: every DynamoModel of the batch is phase Ready, on exactly its
HRW placement over the Ready workers, and each of those workers lists the adapter.
Each batch is deleted (and its unloads awaited) before the next one.

    python bench/bench_operator.py [--batches 1 50 200] [--workers 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
from common import SMOKE_MODEL, bench_adapter, bench_model, log, machine, write_json  # noqa: E402

NUM_ADAPTER_DIRS = 4  # distinct adapter directories; the batch's models cycle through them
READY_S = 900.0  # worker pods import torch on a busy 2-core machine


def worker_command(model_dir: Path, base: str) -> list[str]:
    return [
        "lorafleet-worker", "serve", "--model", str(model_dir), "--served-model-name", base,
        "--host", "$(POD_IP)", "--port", "8000", "--system-port", "9090",
        "--max-lora-rank", "16", "--max-loras", "4", "--max-cpu-loras", "256",
    ]  # fmt: skip


def deploy(stack: Any, model_dir: Path, adapters_root: Path, workers: int) -> None:
    """Worker Deployment + operator (its RBAC) in the stack's namespace; waits until all are Ready."""
    from lorafleet_devcluster import rawstack as e2e
    from lorafleet_devcluster.cluster import wait_until
    from lorafleet_sync.ids import BASE_MODEL_HASH_LABEL, base_model_hash

    worker = e2e.deployment(
        "workers",
        "lorafleet/worker:dev",
        worker_command(model_dir, e2e.BASE),
        replicas=workers,
        labels={BASE_MODEL_HASH_LABEL: base_model_hash(e2e.BASE)},
        volumes=True,
        env=[e2e.env_var("LORAFLEET_FILE_ROOTS", str(adapters_root)), e2e.env_var("DYN_LORA_PATH", "/var/cache/lora")],
        probe={"httpGet": {"path": "/ready", "port": 9090}, "periodSeconds": 1},
    )
    operator = e2e.deployment(
        "operator",
        "lorafleet/operator:dev",
        ["lorafleet-operator", "--namespace", stack.ns, "--bind-host", "$(POD_IP)", "--drift-interval", "30"],
        sa="lorafleet-operator",
        probe={"httpGet": {"path": "/healthz", "port": 8080}, "periodSeconds": 2},
    )
    stack.apply(*e2e.rbac("lorafleet-operator", "operator"))
    stack.apply(worker, operator)
    wait_until(lambda: any(e2e.pod_ready(p) for p in stack.pods("operator")), 300, "operator pod Ready")
    wait_until(lambda: len(stack.ready_workers()) == workers, READY_S, f"{workers} Ready workers")


def time_batch(stack: Any, n: int, adapters: list[Path]) -> float:
    """Seconds from `kubectl apply` of `n` DynamoModels to all of them converged; then deletes them."""
    from lorafleet_devcluster.cluster import wait_until

    label = {"bench-batch": str(n)}
    names = [f"b{n}-{i:03d}" for i in range(n)]
    docs = [
        stack.dm_doc(name, f"bench/n{n}-{i:03d}", f"file://{adapters[i % len(adapters)]}", labels=dict(label))
        for i, name in enumerate(names)
    ]
    t0 = time.perf_counter()
    stack.apply(*docs)
    wait_until(lambda: stack.converged(names), READY_S, f"{n} DynamoModels Ready", interval=0.2)
    seconds = time.perf_counter() - t0
    stack.cluster.kubectl("delete", "dynamomodels", "-n", stack.ns, "-l", f"bench-batch={n}", "--wait=true")
    wait_until(lambda: not stack.dms(f"bench-batch={n}"), 300, f"batch {n} deleted")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 50, 200])
    ap.add_argument("--workers", type=int, default=5)
    ap.add_argument("--operator-log", type=Path, metavar="FILE", help="save the operator pod's log here at the end")
    args = ap.parse_args()

    from lorafleet_devcluster.rawstack import RawStack, install_crd
    from lorafleet_devcluster.session import shared_cluster

    model_dir = bench_model("op-tiny-llama", **SMOKE_MODEL)
    adapters = [bench_adapter(model_dir, i, rank=8) for i in range(NUM_ADAPTER_DIRS)]
    with shared_cluster() as cluster:
        install_crd(cluster)
        ns = cluster.new_namespace("bench")
        # no object store / hub: file:// sources only
        stack = RawStack(cluster, ns)
        try:
            t0 = time.perf_counter()
            deploy(stack, model_dir, adapters[0].parent, args.workers)
            log(f"{args.workers} workers + operator Ready in {time.perf_counter() - t0:.1f} s")
            results = []
            for n in args.batches:
                seconds = time_batch(stack, n, adapters)
                log(f"{n} DynamoModels on {args.workers} workers: Ready in {seconds:.1f} s")
                results.append({"models": n, "workers": args.workers, "seconds": round(seconds, 2)})
            write_json("operator", {"machine": machine(), "results": results})
        finally:
            if args.operator_log:
                pods = stack.pods("operator")
                args.operator_log.write_text(cluster.logs(ns, pods[0]["metadata"]["name"]) if pods else "")
                log(f"operator log: {args.operator_log}")
            cluster.kubectl("delete", "dynamomodels", "--all", "-n", ns, "--wait=false", check=False)
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


if __name__ == "__main__":
    main()
