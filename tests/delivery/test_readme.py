"""The README and docs/ claim only what exists: make targets and repository paths.

Flags, environment variables and chart values are generated into docs/configuration.md and checked by
test_docs.py.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DOCS = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))])


MAKE = re.compile(r"(?:`|^)make ([a-z][a-z0-9-]*)", re.MULTILINE)  # in code, not "make the model ..."


def make_targets() -> set[str]:
    text = "\n".join(p.read_text() for p in [ROOT / "Makefile", *sorted((ROOT / "mk").glob("*.mk"))])
    return set(re.findall(r"^([a-zA-Z0-9_-]+):", text, re.MULTILINE))


def test_quickstart_commands_exist() -> None:
    mentioned = set(MAKE.findall(README))
    assert {"demo", "test"} <= mentioned
    assert mentioned <= make_targets(), sorted(mentioned - make_targets())


def test_every_make_target_mentioned_exists() -> None:
    mentioned = set(MAKE.findall(DOCS))
    assert {"demo", "test", "e2e-kind", "manifests", "docs", "bench-report"} <= mentioned
    assert mentioned <= make_targets(), sorted(mentioned - make_targets())


def test_every_path_mentioned_exists() -> None:
    prefixes = "charts|manifests|examples|crds|tests|docs|tools|demo|mk|bench|devcluster|operator|worker|jobs"
    paths = set(re.findall(rf"`((?:{prefixes})/[\w./-]*\w)`", DOCS))
    paths |= set(re.findall(r"\b(examples/[\w.-]+\.yaml)", DOCS))
    assert len(paths) > 10
    missing = sorted(p for p in paths if "*" not in p and not (ROOT / p).exists())
    assert not missing, missing
