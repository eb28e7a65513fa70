"""Chart-document helpers of the chart tests; helm itself and the chart's path come from the dev cluster."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from lorafleet_devcluster.helm import CHART, ROOT, Doc, HelmError, helm, template, values_args

__all__ = [
    "CHART",
    "ROOT",
    "Doc",
    "HelmError",
    "containers",
    "env_of",
    "find",
    "helm",
    "one",
    "template",
    "values_args",
]


def find(docs: Iterable[Doc], kind: str, name: str | None = None) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: Iterable[Doc], kind: str, name: str) -> Doc:
    found = find(docs, kind, name)
    assert len(found) == 1, f"want one {kind}/{name}, found {len(found)}"
    return found[0]


def containers(doc: Doc) -> list[Doc]:
    spec = doc["spec"]["template"]["spec"]
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def env_of(container: Doc) -> dict[str, Any]:
    """name -> value (or the valueFrom mapping, JSON-encoded) of a container's env."""
    return {e["name"]: e.get("value", json.dumps(e.get("valueFrom"), sort_keys=True)) for e in container.get("env", [])}


# Volume types Pod Security "restricted" allows.
_RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def restricted_violations(pod_spec: Doc) -> list[str]:
    """Rules of Pod Security Standards "restricted" (v1.30) a pod spec breaks (empty = admitted).

    A static mirror of the API server's check, for specs the tests build without a cluster;
    the e2e tests let the real admission plugin judge the pods that actually run.
    """
    bad = [f"spec.{k}" for k in ("hostNetwork", "hostPID", "hostIPC") if pod_spec.get(k)]
    pod_sc = pod_spec.get("securityContext") or {}
    for vol in pod_spec.get("volumes") or []:
        kinds = set(vol) - {"name"}
        if not kinds <= _RESTRICTED_VOLUMES:
            bad.append(f"volume {vol['name']}: {sorted(kinds)}")
    every = list(pod_spec.get("initContainers") or []) + list(pod_spec.get("containers") or [])
    for c in every:
        sc = c.get("securityContext") or {}
        name = c["name"]
        if sc.get("privileged"):
            bad.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}: allowPrivilegeEscalation must be false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            bad.append(f"{name}: capabilities must drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: capabilities.add {caps['add']}")
        if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            bad.append(f"{name}: runAsNonRoot")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            bad.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: seccompProfile {seccomp!r}")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            bad.append(f"{name}: hostPort")
    return bad
