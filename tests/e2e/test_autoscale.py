"""Demand-aware replicas end to end: real workers, the router and the operator as pods.

A skewed load through the router (several clients on one adapter) makes that adapter's replica count
grow along its HRW order; once the load stops it shrinks back (after the cool-down), and no request
fails on the way. Intervals, window and cool-down are set small by flags so the test takes seconds
of scaling, not minutes; every wait polls for a condition with a deadline.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from lorafleet_devcluster.cluster import wait_until
from lorafleet_devcluster.paths import REPO_ROOT
from lorafleet_devcluster.rawstack import (
    BASE,
    READY_S,
    RawStack,
    deployment,
    env_var,
    install_crd,
    pod_ready,
    rbac,
    worker_deployment,
)
from lorafleet_devcluster.session import TestCluster
from lorafleet_operator.placement import place
from lorafleet_sync.ids import BASE_MODEL_HASH_LABEL, base_model_hash

from tests.e2e.traffic import Load

HOT = "org/hot-lora"
# the pods run this checkout's operator code (the venv's editable install may point at another one)
CODE = env_var("PYTHONPATH", ":".join(str(REPO_ROOT / p / "src") for p in ("operator", "jobs")))


@dataclass
class Stack(RawStack):
    adapter: Path


@pytest.fixture(scope="module")
def stack(cluster: TestCluster, tiny_models: Any, tiny_adapter_factory: Any) -> Iterator[Stack]:
    install_crd(cluster)
    model_dir = tiny_models["llama"]
    adapter = tiny_adapter_factory(model_dir, rank=4, seed=111, strength=2.0)
    ns = cluster.new_namespace("autoscale")
    stack = Stack(cluster, ns, adapter)
    workers = worker_deployment(
        str(model_dir),
        BASE,
        {BASE_MODEL_HASH_LABEL: base_model_hash(BASE)},
        [],
        [env_var("LORAFLEET_FILE_ROOTS", str(adapter.parent))],
    )
    router = deployment(
        "router",
        "lorafleet/operator:dev",
        [
            "lorafleet-router",
            "--namespace",
            ns,
            "--bind-host",
            "$(POD_IP)",
            "--router-port",
            "8000",
            "--demand-window",
            "2",
        ],
        sa="lorafleet-router",
        env=[CODE],
        probe={"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 1},
    )
    stack.apply(*rbac("lorafleet-operator", "operator"), *rbac("lorafleet-router", "router"))
    stack.apply(workers, router)
    try:
        wait_until(partial(_any_ready, stack, "router"), 180, "router pod Ready")
        operator = deployment(
            "operator",
            "lorafleet/operator:dev",
            [
                "lorafleet-operator",
                "--namespace",
                ns,
                "--bind-host",
                "$(POD_IP)",
                "--drift-interval",
                "5",
                "--demand-urls",
                f"{stack.router}/demand",
                "--autoscale-interval",
                "1",
                "--autoscale-cooldown",
                "4",
                "--unload-grace",
                "1",
                "--retry-max",
                "5",
                "--call-timeout",
                "5",
            ],
            sa="lorafleet-operator",
            env=[CODE],
            probe={"httpGet": {"path": "/healthz", "port": 8080}, "periodSeconds": 2},
        )
        stack.apply(operator)
        wait_until(partial(_any_ready, stack, "operator"), 180, "operator pod Ready")
        wait_until(lambda: len(stack.ready_workers()) == 3, READY_S, "3 Ready workers")
        yield stack
    except BaseException:
        for app in ("operator", "router"):
            for p in stack.pods(app):
                print(f"--- {p['metadata']['name']}\n{cluster.logs(ns, p['metadata']['name'])[-4000:]}")
        raise
    finally:
        cluster.kubectl("delete", "dynamomodels", "--all", "-n", ns, "--wait=false", check=False)
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def _any_ready(stack: RawStack, app: str) -> bool:
    return any(pod_ready(p) for p in stack.pods(app))


def _scaled(stack: RawStack, name: str, replicas: int) -> dict | None:
    """The object once it wants and serves ``replicas`` on exactly its top HRW pods (and only there)."""
    obj = stack.dm(name)
    status = obj.get("status") or {}
    workers = stack.ready_workers()
    want = place(HOT, workers, replicas)
    if (status.get("desiredReplicas"), status.get("currentReplicas"), status.get("placement")) != (
        replicas,
        replicas,
        want,
    ):
        return None
    holders = {pod for pod, ip in workers.items() if HOT in stack.loras(ip)}
    return obj if holders == set(want) and status.get("phase") == "Ready" else None


def _reason(obj: dict, type_: str) -> str | None:
    return next((c["reason"] for c in obj["status"]["conditions"] if c["type"] == type_), None)


def test_skewed_load_grows_the_hot_adapter_and_it_shrinks_after(stack: Stack) -> None:
    uri = f"file://{stack.adapter}"
    stack.apply(stack.dm_doc("hot", HOT, uri, autoscaling={"minReplicas": 1, "maxReplicas": 3, "target": 1}))
    obj = wait_until(lambda: _scaled(stack, "hot", 1), 180, "hot adapter Ready on 1 replica")
    assert _reason(obj, "Autoscaling") in ("NoDemandData", "AtMinReplicas", "AtTarget")
    # a trickle runs throughout (the shrink too: leavers must not fail a request), four clients on top
    url = f"{stack.router}/v1/completions"
    with Load(url, HOT, clients=1, pause=2.0, tokens=1) as trickle:
        with Load(url, HOT, clients=4) as load:
            obj = wait_until(lambda: _scaled(stack, "hot", 3), 180, "hot adapter grown to 3 replicas", interval=0.5)
            assert _reason(obj, "Autoscaling") in ("ScaledUp", "AtMaxReplicas")
        obj = wait_until(lambda: _scaled(stack, "hot", 1), 120, "hot adapter shrunk to 1 replica", interval=0.5)
        assert _reason(obj, "Autoscaling") in ("ScaledDown", "AtMinReplicas")
    assert not load.failures and not trickle.failures, (load.failures + trickle.failures)[:5]
    assert load.ok > 0 and trickle.ok > 0
    print(f"\nautoscale e2e: {load.ok} + {trickle.ok} requests, 0 failed; 1 -> 3 -> 1 replicas")
