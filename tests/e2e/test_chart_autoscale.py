"""Demand-aware replicas through the chart as installed: the operator finds every router pod
through the headless Service `<fullname>-router-pods` by its cluster DNS name, reads their demand and
grows, then shrinks, an autoscaled adapter while requests go through the router's Service.

Only a cluster with DNS resolves that name: `make e2e-kind` runs this on kind. The local dev cluster
has no DNS, so there it is skipped (its demand path is covered by `test_autoscale.py`, which hands the
operator the router's address directly).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from lorafleet_devcluster.session import TestCluster
from lorafleet_devcluster.stack import BASE_MODEL, JSON, Release, deep_merge, default_values
from lorafleet_operator import api
from lorafleet_worker_dev.tiny import make_tiny_adapter, make_tiny_model

from tests.e2e.traffic import Load

HOT = "hot-lora"


@pytest.fixture(scope="module")
def release(cluster: TestCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    if cluster.is_local:
        pytest.skip("the local dev cluster has no DNS for the headless router Service (make e2e-kind runs this)")
    root = tmp_path_factory.mktemp("autoscale-adapter")
    adapter = make_tiny_adapter(root / "hot", make_tiny_model(root / "base", "qwen3"), rank=4, seed=7, strength=3.0)
    rel = Release(cluster, cluster.new_namespace("chart-autoscale"))
    fast = {
        "operator": {"autoscaling": {"enabled": True, "intervalSeconds": 1, "cooldownSeconds": 4}},
        "router": {"demandWindowSeconds": 2},
    }
    rel.deploy(deep_merge(default_values(cluster, workers=3), fast))
    rel.upload(adapter, "s3://autoscale/hot")
    yield rel
    rel.helm("uninstall", rel.name, check=False)


def hot_model(autoscaling: JSON) -> str:
    spec = {"modelName": HOT, "baseModelName": BASE_MODEL, "modelType": "lora", "source": {"uri": "s3://autoscale/hot"}}
    doc = {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": "hot"}}
    return yaml.safe_dump(doc | {"spec": spec | {"autoscaling": autoscaling}})


def reason(dm: JSON, type_: str) -> str | None:
    return next((c["reason"] for c in dm["status"]["conditions"] if c["type"] == type_), None)


def test_demand_through_the_headless_service_grows_and_shrinks_the_adapter(release: Release, tmp_path: Path) -> None:
    release.apply(hot_model({"minReplicas": 1, "maxReplicas": 3, "target": 1}))
    dm = release.wait_ready("hot", total=1)
    assert reason(dm, "Autoscaling") in ("NoDemandData", "AtMinReplicas", "AtTarget"), dm["status"]
    url = f"{release.router_url()}/v1/completions"
    # a trickle runs throughout (the shrink too: leaving replicas must not fail a request), four clients on top
    auth = release.inference_headers()
    with Load(url, HOT, clients=1, pause=2.0, tokens=1, headers=auth) as trickle:
        with Load(url, HOT, clients=4, headers=auth) as load:
            dm = release.wait_ready("hot", total=3, timeout=180)
            assert dm["status"]["desiredReplicas"] == 3
            assert reason(dm, "Autoscaling") in ("ScaledUp", "AtMaxReplicas"), dm["status"]
        dm = release.wait_ready("hot", total=1, timeout=120)
        assert reason(dm, "Autoscaling") in ("ScaledDown", "AtMinReplicas"), dm["status"]
    assert not load.failures and not trickle.failures, (load.failures + trickle.failures)[:5]
    assert load.ok > 0 and trickle.ok > 0
    print(f"\nchart autoscale on a real node: {load.ok} + {trickle.ok} requests, 0 failed; 1 -> 3 -> 1 replicas")
