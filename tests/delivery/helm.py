"""Helm helpers shared by the chart's static tests, the chart e2e tests and `make demo`."""

from __future__ import annotations

import json
import subprocess
import tempfile
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from tests.infra.cluster import tool_path

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "lorafleet"
Doc = dict[str, Any]
_VALUES_DIR = tempfile.TemporaryDirectory(prefix="lorafleet-values-")


class HelmError(Exception):
    """helm exited non-zero; the message holds its stderr."""


def helm(*args: str, env: Mapping[str, str] | None = None, timeout: float = 300) -> str:
    """Run the pinned helm; returns stdout, raises HelmError with stderr on failure."""
    argv = [str(tool_path("helm")), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=dict(env) if env else None)
    if done.returncode != 0:
        raise HelmError(f"helm {' '.join(args)} failed ({done.returncode}):\n{done.stderr.strip()}")
    return done.stdout


def values_args(values: Mapping[str, Any] | None) -> list[str]:
    """`--values FILE` for a values mapping (a file in a temp dir removed when the process exits)."""
    if not values:
        return []
    path = Path(_VALUES_DIR.name) / f"values-{uuid.uuid4().hex[:12]}.yaml"
    path.write_text(yaml.safe_dump(dict(values)))
    return ["--values", str(path)]


def template(
    values: Mapping[str, Any] | None = None,
    *,
    release: str = "lf",
    namespace: str = "lorafleet",
    extra: Iterable[str] = (),
) -> list[Doc]:
    """`helm template --include-crds` of the chart, parsed into a list of objects."""
    out = helm(
        "template", release, str(CHART), "--namespace", namespace, "--include-crds", *values_args(values), *extra
    )
    return [d for d in yaml.safe_load_all(out) if d]


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
