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
