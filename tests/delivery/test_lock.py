"""The hashed locks in locks/ (written by `make lock`, tools/lock.py): fresh, complete and obeying constraints.txt.

No network: a lock records a hash of its inputs, so editing a pyproject's dependencies, constraints.txt or
requirements-dev.txt without `make lock` fails here.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==(\S+)")


def _lock_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lorafleet_lock_tool", ROOT / "tools" / "lock.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


LOCK_TOOL = _lock_tool()


def pins(text: str) -> dict[str, str]:
    return {canonicalize_name(m.group(1)): m.group(2) for line in text.splitlines() if (m := PIN.match(line))}


@pytest.fixture(params=LOCK_TOOL.LOCK_SET, ids=lambda lock: lock.name)
def lock(request: pytest.FixtureRequest) -> Any:
    return request.param


def test_lock_is_fresh(lock: Any) -> None:
    assert lock.path.exists(), f"{lock.path.name} missing: run `make lock`"
    assert not LOCK_TOOL.stale(lock), f"{lock.path.name} is stale (its inputs changed): run `make lock`"


def test_every_requirement_is_pinned_with_hashes(lock: Any) -> None:
    entries = re.split(r"\n(?=[A-Za-z0-9])", lock.path.read_text().split("\n", 4)[-1])
    reqs = [e for e in entries if PIN.match(e)]
    assert reqs, "no pinned requirement in the lock"
    for entry in reqs:
        assert "--hash=sha256:" in entry, f"no hash for {entry.splitlines()[0]}"
    assert len(reqs) == len([e for e in entries if e.strip() and not e.startswith("#")]), "an unpinned line"


def test_lock_obeys_constraints_and_holds_every_declared_dependency(lock: Any) -> None:
    locked = pins(lock.path.read_text())
    chosen = pins((ROOT / "constraints.txt").read_text())
    for name, version in locked.items():
        if name in chosen:
            assert version == chosen[name], f"{name}: lock {version}, constraints.txt {chosen[name]}"
    for project in lock.projects:
        directory, _, extras = project.removeprefix("./").partition("[")
        data = tomllib.loads((ROOT / directory / "pyproject.toml").read_text())["project"]
        declared = list(data.get("dependencies", []))
        for extra in filter(None, extras.rstrip("]").split(",")):
            declared += data["optional-dependencies"][extra]
        for req in map(Requirement, declared):
            name = canonicalize_name(req.name)
            if name in {canonicalize_name(p) for p in LOCK_TOOL.LOCAL_PACKAGES.values()}:
                continue
            assert name in locked, f"{directory} declares {req.name}, which {lock.path.name} lacks"
