"""The pinned helm and the chart: `helm()`, values files, `helm template`, the chart's RBAC rules
(chart tests, e2e, `make demo`, the plain-manifest stacks of `rawstack`)."""

from __future__ import annotations

import copy
import functools
import subprocess
import tempfile
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from lorafleet_devcluster.cluster import tool_path
from lorafleet_devcluster.paths import CHART, REPO_ROOT

ROOT = REPO_ROOT

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


RBAC_RELEASE, RBAC_NAMESPACE = "lf", "lorafleet"


@functools.cache
def _chart_roles() -> dict[str, list[Doc]]:
    """The rules of each Role the chart renders, by name less the release's prefix ("operator",
    "operator-leader", "operator-secrets", "router"); rendered with two operator replicas, so that
    the leader-election Role is among them."""
    docs = template(
        {"operator": {"replicas": 2}},
        release=RBAC_RELEASE,
        namespace=RBAC_NAMESPACE,
        extra=["--show-only", "templates/operator/rbac.yaml", "--show-only", "templates/router/rbac.yaml"],
    )
    prefix = f"{RBAC_RELEASE}-lorafleet-"
    return {d["metadata"]["name"].removeprefix(prefix): d["rules"] for d in docs if d["kind"] == "Role"}


def chart_rules(*roles: str) -> list[Doc]:
    """The RBAC rules the chart grants in a watched namespace, for plain manifests that run lorafleet's
    processes without the chart: ``chart_rules("operator")``, ``chart_rules("router")``, and
    ``"operator-leader"`` (the Lease for ``--leader-elect``). The chart's ``_rbac.tpl`` is the one list."""
    rendered = _chart_roles()
    missing = [r for r in roles if r not in rendered]
    if missing:
        raise KeyError(f"the chart renders no Role {missing}; it has {sorted(rendered)}")
    return [copy.deepcopy(rule) for role in roles for rule in rendered[role]]
