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


def test_startup_waits_for_the_model_and_readiness_allows_a_busy_worker_5_seconds() -> None:
    """Startup asks /ready, so a model load that hangs ends in a restart after the startup budget instead of a
    pod that passes /health (healthy while loading) and stays out of service; readiness waits 5 s, not 1 s."""
    default = worker({"workers": [GROUP]})
    assert default["startupProbe"] == {
        "httpGet": {"path": "/ready", "port": "system"}, "periodSeconds": 5, "failureThreshold": 120,
        "timeoutSeconds": 5,
    }  # fmt: skip
    assert default["readinessProbe"] == {
        "httpGet": {"path": "/ready", "port": "system"}, "periodSeconds": 5, "failureThreshold": 3,
        "timeoutSeconds": 5,
    }  # fmt: skip
    tuned = worker({"workers": [{**GROUP, "startupProbe": {"failureThreshold": 360}}]})
    assert tuned["startupProbe"]["failureThreshold"] == 360  # type: ignore[index]
    assert tuned["startupProbe"]["periodSeconds"] == 5  # type: ignore[index]


def test_bad_liveness_values_are_refused() -> None:
    for bad in ({"healthStallTimeoutSeconds": -1}, {"livenessProbe": {"periodSeconds": 0}},
                {"livenessProbe": {"exec": {"command": ["true"]}}}, {"startupProbe": {"failureThreshold": 0}},
                {"readinessProbe": {"httpGet": {"path": "/"}}}):  # fmt: skip
        with pytest.raises(HelmError) as err:
            template({"workers": [{**GROUP, **bad}]})
        field = next(iter(bad))
        assert "schema" in str(err.value) and field in str(err.value), err.value


def test_two_router_replicas() -> None:
    dep = one(template({"router": {"replicas": 2}}), "Deployment", "lf-lorafleet-router")
    assert dep["spec"]["replicas"] == 2
