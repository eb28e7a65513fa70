"""The chart's liveness settings for workers (issue 28, outcome 3) and several router replicas (outcome 5)."""

from __future__ import annotations

import pytest

from tests.delivery.helm import HelmError, one, template

GROUP = {"name": "g", "baseModelName": "m", "device": "cpu", "model": {"generateTiny": True}}


def worker(values: dict[str, object]) -> dict[str, object]:
    dep = one(template(values), "Deployment", "lf-lorafleet-worker-g")
    container: dict[str, object] = dep["spec"]["template"]["spec"]["containers"][0]
    return container


def test_worker_stall_timeout_and_liveness_probe_come_from_values() -> None:
    default = worker({"workers": [GROUP]})
    assert "--health-stall-timeout=60" in default["args"]  # type: ignore[operator]
    assert default["livenessProbe"] == {
        "httpGet": {"path": "/health", "port": "system"}, "periodSeconds": 10, "failureThreshold": 3,
        "timeoutSeconds": 5,
    }  # fmt: skip
    tuned = worker({"workers": [{**GROUP, "healthStallTimeoutSeconds": 0, "livenessProbe": {"periodSeconds": 5}}]})
    assert "--health-stall-timeout=0" in tuned["args"]  # type: ignore[operator]
    assert tuned["livenessProbe"] == {"httpGet": {"path": "/health", "port": "system"}, "periodSeconds": 5,
                                      "failureThreshold": 3, "timeoutSeconds": 5}  # fmt: skip


def test_bad_liveness_values_are_refused() -> None:
    for bad in ({"healthStallTimeoutSeconds": -1}, {"livenessProbe": {"periodSeconds": 0}},
                {"livenessProbe": {"exec": {"command": ["true"]}}}):  # fmt: skip
        with pytest.raises(HelmError) as err:
            template({"workers": [{**GROUP, **bad}]})
        field = next(iter(bad))
        assert "schema" in str(err.value) and field in str(err.value), err.value


def test_two_router_replicas() -> None:
    dep = one(template({"router": {"replicas": 2}}), "Deployment", "lf-lorafleet-router")
    assert dep["spec"]["replicas"] == 2
