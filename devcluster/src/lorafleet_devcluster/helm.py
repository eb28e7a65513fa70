"""The pinned helm and the chart: `helm()`, values files, `helm template` (chart tests, e2e, `make demo`)."""

from __future__ import annotations

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
