"""The README claims only what exists: make targets, paths, settings, CLI flags and chart values."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import yaml
from lorafleet_operator.settings import Settings
from lorafleet_worker.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
OPAQUE = {"resources", "podSecurityContext", "containerSecurityContext"}  # documented as a whole


def make_targets() -> set[str]:
    text = "\n".join(p.read_text() for p in [ROOT / "Makefile", *sorted((ROOT / "mk").glob("*.mk"))])
    return set(re.findall(r"^([a-zA-Z0-9_-]+):", text, re.MULTILINE))


def test_every_make_target_mentioned_exists() -> None:
    mentioned = set(re.findall(r"\bmake ([a-z][a-z0-9-]*)", README))
    assert {"demo", "test", "e2e-kind", "manifests"} <= mentioned
    assert mentioned <= make_targets(), sorted(mentioned - make_targets())


def test_every_path_mentioned_exists() -> None:
    paths = set(re.findall(r"`((?:charts|manifests|examples|crds|tests|docs|tools|demo|mk)/[\w./-]*\w)`", README))
    paths |= set(re.findall(r"\b(examples/[\w.-]+\.yaml)", README))
    assert len(paths) > 10
    missing = sorted(p for p in paths if "*" not in p and not (ROOT / p).exists())
    assert not missing, missing


def test_operator_settings_are_documented() -> None:
    for f in dataclasses.fields(Settings):
        env = f.metadata["env"]
        flag = "--namespace" if f.name == "namespaces" else "--" + f.name.replace("_", "-")
        assert f"`{env}`" in README, env
        assert f"`{flag}`" in README or f"`{flag}/" in README, flag


def test_worker_serve_flags_are_documented() -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = {opt for action in serve._actions for opt in action.option_strings if opt.startswith("--")}
    flags.discard("--help")
    assert "--max-loras" in flags
    missing = sorted(f for f in flags if f"`{f}" not in README)
    assert not missing, missing


def leaf_keys(values: dict[str, Any], prefix: str = "") -> set[str]:
    keys = set()
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and key not in OPAQUE:
            keys |= leaf_keys(value, path + ".")
        else:
            keys.add(path)
    return keys


def test_every_chart_value_is_documented() -> None:
    values = yaml.safe_load((ROOT / "charts" / "lorafleet" / "values.yaml").read_text())
    table = README[README.index("### Chart values") : README.index("### Environment variables")]
    missing = []
    for key in sorted(leaf_keys(values)):
        last = key.rsplit(".", 1)[-1]
        head = key.split(".")[0]
        if head not in table or last not in table:
            missing.append(key)
    assert not missing, missing
