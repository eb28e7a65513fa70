"""The worker groups over nodes and through rollouts. By default each group prefers one pod per node (so a
lost node loses one worker of the group) without ever leaving a pod unscheduled; a group or workerDefaults
can replace or drop it, and an entry's labelSelector defaults to the group's own pods. A rollout waits
minReadySeconds and the adapters readiness gate for each new worker."""

from __future__ import annotations

from typing import Any

import pytest

from tests.delivery.helm import HelmError, one, template

VOLUME = {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}}


def spread(values: dict[str, Any], group: str = "a") -> list[dict[str, Any]]:
    dep = one(template(values), "Deployment", f"lf-lorafleet-worker-{group}")
    return list(dep["spec"]["template"]["spec"].get("topologySpreadConstraints", []))


def group(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "baseModelName": f"m-{name}", "model": {"volume": VOLUME}, **extra}


def test_each_group_prefers_one_pod_per_node_by_default() -> None:
    docs = template({"workers": [group("a"), group("b")]})
    for name in ("a", "b"):
        dep = one(docs, "Deployment", f"lf-lorafleet-worker-{name}")
        pod = dep["spec"]["template"]
        (constraint,) = pod["spec"]["topologySpreadConstraints"]
        assert constraint == {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",  # one node or a cordon still schedules every pod
            "labelSelector": {"matchLabels": dep["spec"]["selector"]["matchLabels"]},
        }
        # the selector counts this group's pods only, and they carry every label it names
        assert constraint["labelSelector"]["matchLabels"]["lorafleet.dev/worker-group"] == name
        assert constraint["labelSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()


def test_a_group_replaces_or_drops_the_default_and_keeps_a_given_selector() -> None:
    zone = {"maxSkew": 2, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule"}
    (only,) = spread({"workers": [group("a", topologySpreadConstraints=[zone])]})
    assert only == zone | {"labelSelector": {"matchLabels": only["labelSelector"]["matchLabels"]}}
    assert only["labelSelector"]["matchLabels"]["lorafleet.dev/worker-group"] == "a"
    assert spread({"workers": [group("a", topologySpreadConstraints=[])]}) == []
    assert spread({"workerDefaults": {"topologySpreadConstraints": []}, "workers": [group("a")]}) == []
    own = dict(zone, labelSelector={"matchLabels": {"team": "x"}})
    assert spread({"workers": [group("a", topologySpreadConstraints=[own])]}) == [own]


@pytest.mark.parametrize(
    "entry",
    [
        {"topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway"},  # no maxSkew
        {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "Sometimes"},
    ],
)
def test_a_malformed_constraint_is_refused_by_the_schema(entry: dict[str, Any]) -> None:
    with pytest.raises(HelmError, match="topologySpreadConstraints"):
        template({"workers": [group("a", topologySpreadConstraints=[entry])]})


def test_a_rollout_waits_for_each_new_workers_adapters() -> None:
    """A new worker is Ready only once the operator opens its readiness gate (its adapters loaded), and counts
    as available minReadySeconds (default 10 s) later; a group can change both."""
    vllm = {"name": "vq", "baseModelName": "Qwen/Qwen3-0.6B", "model": {"path": "Qwen/Qwen3-0.6B"}}
    docs = template({"workers": [group("a"), group("b", minReadySeconds=45)], "vllmWorkers": [vllm]})
    assert one(docs, "Deployment", "lf-lorafleet-worker-a")["spec"]["minReadySeconds"] == 10
    assert one(docs, "Deployment", "lf-lorafleet-worker-b")["spec"]["minReadySeconds"] == 45
    assert one(docs, "Deployment", "lf-lorafleet-vllm-vq")["spec"]["minReadySeconds"] == 10
    gate = [{"conditionType": "lorafleet.dev/adapters-loaded"}]
    for name in ("worker-a", "worker-b", "vllm-vq"):
        assert one(docs, "Deployment", f"lf-lorafleet-{name}")["spec"]["template"]["spec"]["readinessGates"] == gate
    ungated = template({"workers": [group("a", adaptersReadinessGate=False)]})
    assert "readinessGates" not in one(ungated, "Deployment", "lf-lorafleet-worker-a")["spec"]["template"]["spec"]
    with pytest.raises(HelmError, match="minReadySeconds"):
        template({"workers": [group("a", minReadySeconds=-1)]})
