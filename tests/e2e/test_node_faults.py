"""Node faults under router traffic on a multi-node kind cluster (`make e2e-kind-multinode`).

The operator, router, MinIO and CoreDNS run off the fault node (it is cordoned while they are
scheduled); the two workers spread over both nodes, and an adapter with two replicas is placed on both.
Then, with clients sending non-streamed completions through the router the whole time:

- drain: `kubectl drain` of the fault node. The PodDisruptionBudget holds (at least one worker Ready at
  every sample), the adapter is placed again on the replacement pod while the other copy serves, and no
  request fails;
- node lost: the fault node's container is stopped (`podman stop -t 0`: the kubelet stops answering, its
  pods stay Running in the API until the node controller marks the node). No request fails after the
  router's retries, and the adapter is on two Ready workers again within NODE_LOSS_BOUND seconds. The
  workers tolerate an unreachable node for TOLERATION seconds (Kubernetes' default is 300);
- node returning: the container is started again; the node turns Ready, the evicted pod is gone, a rollout
  spreads the workers over both nodes again, and the placements then hold still (no flapping).

Times from each fault to converged are printed (and written to LORAFLEET_E2E_REPORT when set).
"""

from __future__ import annotations

import subprocess
import time

from lorafleet_devcluster.stack import Release, wait_for

from tests.e2e.kind_fleet import (
    ADAPTER,
    ENGINE,
    KIND_WORKERS,
    NODE_LOSS_BOUND,
    converged,
    fleet,
    node_of,
    ready,
    ready_workers,
    report,
    spread_again,
    traffic,
)
from tests.e2e.traffic import Sampler

__all__ = ["fleet"]  # the module's fixture


def test_drain_honours_the_budget_and_fails_no_request(fleet: Release) -> None:
    fault = KIND_WORKERS[1]
    with traffic(fleet) as load, Sampler(lambda: ready_workers(fleet)) as workers_ready:
        start = time.monotonic()
        fleet.cluster.kubectl("drain", fault, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=240s")
        drained = time.monotonic() - start
        wait_for(lambda: converged(fleet, avoid=fault), 240, "the adapter on two Ready workers off the drained node")
        done = time.monotonic() - start
    report("drain", drained_s=drained, converged_s=done, requests=load.ok)
    assert load.ok > 0 and not load.failures, (load.ok, load.failures[:5])
    assert workers_ready.seen and min(workers_ready.seen) >= 1, workers_ready.seen  # maxUnavailable: 1 of 2
    fleet.cluster.kubectl("uncordon", fault)


def test_a_lost_node_fails_no_request_and_its_adapters_are_placed_again(fleet: Release) -> None:
    fault = KIND_WORKERS[1]
    spread_again(fleet)
    (lost,) = [p["metadata"]["name"] for p in fleet.pods("worker") if node_of(p) == fault]
    node_path = f"/api/v1/nodes/{fault}"
    with traffic(fleet) as load:
        start = time.monotonic()
        subprocess.run([ENGINE, "stop", "-t", "0", fault], check=True, capture_output=True)
        wait_for(lambda: not ready(fleet.cluster.get(node_path)), 120, f"{fault} NotReady")
        not_ready = time.monotonic() - start
        wait_for(
            lambda: fleet.cluster.get(f"/api/v1/namespaces/{fleet.namespace}/pods/{lost}")["metadata"].get(
                "deletionTimestamp"
            ),
            120,
            f"the node controller to evict {lost}",
        )
        evicted = time.monotonic() - start
        wait_for(lambda: converged(fleet, avoid=fault), NODE_LOSS_BOUND, "the adapter on two Ready workers again")
        done = time.monotonic() - start
    report("node-lost", not_ready_s=not_ready, evicted_s=evicted, converged_s=done, requests=load.ok)
    assert load.ok > 0 and not load.failures, (load.ok, load.failures[:5])
    assert done <= NODE_LOSS_BOUND


def test_the_node_returns_and_placements_hold_still(fleet: Release) -> None:
    fault = KIND_WORKERS[1]
    node_path = f"/api/v1/nodes/{fault}"
    with traffic(fleet) as load:
        start = time.monotonic()
        subprocess.run([ENGINE, "start", fault], check=True, capture_output=True)
        wait_for(lambda: ready(fleet.cluster.get(node_path)), 240, f"{fault} Ready again")
        back = time.monotonic() - start
        # the evicted pod is gone once its kubelet answers again
        wait_for(lambda: len(fleet.pods("worker")) == 2 and all(map(ready, fleet.pods("worker"))), 180, "2 workers")
        wait_for(
            lambda: (
                not [
                    p
                    for p in fleet.cluster.get(f"/api/v1/namespaces/{fleet.namespace}/pods")["items"]
                    if p["metadata"].get("deletionTimestamp")
                ]
            ),
            180,
            "the evicted pod removed",
        )
        spread_again(fleet)
        done = time.monotonic() - start
        # no flapping: the placements stay what they converged to while traffic goes on
        placed = {e["podName"] for e in fleet.model(ADAPTER)["status"]["endpoints"]}
        with Sampler(lambda: frozenset(e["podName"] for e in fleet.model(ADAPTER)["status"]["endpoints"])) as seen:
            wait_for(lambda: len(seen.seen) >= 40, 60, "20 s of placement samples")
    report("node-returned", ready_s=back, rebalanced_s=done, requests=load.ok)
    assert load.ok > 0 and not load.failures, (load.ok, load.failures[:5])
    assert set(seen.seen) == {frozenset(placed)}, set(seen.seen)
