"""The worker pods' readiness gate (gates.py): opened only after the pod's arrival was reconciled and it
holds every adapter placed on it, closed when its containers stop being ready, written as one condition
with a strategic merge patch (the kubelet's own conditions are left alone)."""

from __future__ import annotations

from typing import Any

from lorafleet_operator.gates import PodGates, holds_its_placement
from lorafleet_operator.resources import ADAPTERS_GATE, Model, Pod


class Patches:
    """Records the PATCHes the gates send (what the API server would receive)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    async def strategic_patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.sent.append((path, body))
        return body


def pod_body(name: str, *, containers_ready: bool = True, gate: bool | None = None, gated: bool = True) -> Pod:
    conditions = [{"type": "ContainersReady", "status": str(containers_ready)}]
    if gate is not None:
        conditions.append({"type": ADAPTERS_GATE, "status": str(gate)})
    spec = {"readinessGates": [{"conditionType": ADAPTERS_GATE}]} if gated else {}
    return Pod.from_body({
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "labels": {}},
        "spec": spec,
        "status": {"phase": "Running", "podIP": "10.0.0.1", "conditions": conditions},
    })  # fmt: skip


def model(name: str, placement: list[str], ready_on: list[str]) -> Model:
    endpoints = [{"podName": p, "ready": p in ready_on} for p in placement]
    return Model.from_body({
        "metadata": {"namespace": "ns", "name": name, "uid": name, "generation": 1},
        "spec": {"modelName": f"org/{name}", "baseModelName": "base", "modelType": "lora",
                 "source": {"uri": f"s3://b/{name}"}},
        "status": {"placement": placement, "endpoints": endpoints},
    })  # fmt: skip


def test_a_pod_holds_its_placement_when_every_model_placed_on_it_lists_it_ready() -> None:
    pod = pod_body("w0")
    assert pod.ready and pod.gated and not pod.gate_open
    assert holds_its_placement(pod, [model("a", ["w0", "w1"], ["w1"]), model("b", ["w1"], [])]) == ["org/a"]
    assert holds_its_placement(pod, [model("a", ["w0", "w1"], ["w0"]), model("b", ["w1"], [])]) == []


async def test_the_gate_opens_after_the_arrival_passes_and_the_loads() -> None:
    models = {"a": model("a", [], [])}
    kube = Patches()
    gates = PodGates(kube, lambda ns, h: list(models.values()))  # type: ignore[arg-type]
    pod = pod_body("w0")
    gates.on_pod(pod, joined={("ns", "a")})
    await gates.write_due()
    assert kube.sent == []  # model a's pass since the pod arrived has not run: its placement may name it
    models["a"] = model("a", ["w0"], [])  # the pass placed it here; the load is still going on
    gates.after_pass(("ns", "a"))
    await gates.write_due()
    assert kube.sent == []
    models["a"] = model("a", ["w0"], ["w0"])
    gates.after_pass(("ns", "a"))
    await gates.write_due()
    ((path, body),) = kube.sent
    assert path == "/api/v1/namespaces/ns/pods/w0/status"
    (condition,) = body["status"]["conditions"]
    assert (condition["type"], condition["status"], condition["reason"]) == (ADAPTERS_GATE, "True", "AdaptersLoaded")
    await gates.write_due()
    assert len(kube.sent) == 1  # opened once


async def test_a_restarted_worker_is_closed_and_opens_again_only_when_it_holds_its_adapters() -> None:
    models = [model("a", ["w0"], [])]
    kube = Patches()
    gates = PodGates(kube, lambda ns, h: models)  # type: ignore[arg-type]
    gates.on_pod(pod_body("w0", containers_ready=False, gate=True), joined=None)
    await gates.write_due()
    ((_, body),) = kube.sent
    assert body["status"]["conditions"][0]["status"] == "False"
    gates.on_pod(pod_body("w0", gate=False), joined=set())  # back, empty: model a is not loaded there yet
    await gates.write_due()
    assert len(kube.sent) == 1
    models[0] = model("a", ["w0"], ["w0"])
    gates.after_pass(("ns", "a"))
    await gates.write_due()
    assert [b["status"]["conditions"][0]["status"] for _, b in kube.sent] == ["False", "True"]


async def test_pods_without_the_gate_in_their_spec_are_left_alone() -> None:
    kube = Patches()
    gates = PodGates(kube, lambda ns, h: [])  # type: ignore[arg-type]
    gates.on_pod(pod_body("w0", gated=False), joined=set())
    gates.on_pod(pod_body("w1", gated=False, containers_ready=False, gate=True), joined=None)
    await gates.write_due()
    assert kube.sent == []
