"""lorafleet-manifest.json: round trip and refusal of malformed or unsafe manifests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lorafleet_sync.errors import SourceError
from lorafleet_sync.manifest import MANIFEST_NAME, Manifest, file_entry, validate_adapter_dir

from .conftest import write_adapter

GOOD = {"format": "lorafleet-manifest/v1", "source": "hf://o/r@" + "a" * 40, "sha": "a" * 40}


def test_round_trip_is_sorted_and_stable(tmp_path: Path) -> None:
    adapter = write_adapter(tmp_path / "a")
    entries = [file_entry(adapter, "adapter_model.safetensors"), file_entry(adapter, "adapter_config.json")]
    manifest = Manifest(source=GOOD["source"], sha=GOOD["sha"], files=entries)
    text = manifest.to_json()
    assert [f["path"] for f in json.loads(text)["files"]] == ["adapter_config.json", "adapter_model.safetensors"]
    parsed = Manifest.from_json(text)
    assert parsed.to_json() == text and parsed.by_path()["adapter_config.json"] == entries[1]


@pytest.mark.parametrize(
    "files",
    [
        [{"path": "../x", "size": 1, "sha256": "0" * 64}],
        [{"path": "/etc/passwd", "size": 1, "sha256": "0" * 64}],
        [{"path": MANIFEST_NAME, "size": 1, "sha256": "0" * 64}],
        [{"path": "a", "size": -1, "sha256": "0" * 64}],
        [{"path": "a", "size": 1, "sha256": "short"}],
        [{"path": "a", "size": "1", "sha256": "0" * 64}],
        "not a list",
    ],
)
def test_malformed_manifest_is_refused(tmp_path: Path, files: object) -> None:
    with pytest.raises(ValueError):
        Manifest.from_json(json.dumps({**GOOD, "files": files}))
    adapter = write_adapter(tmp_path / "a")
    (adapter / MANIFEST_NAME).write_text(json.dumps({**GOOD, "files": files}))
    with pytest.raises(SourceError, match=r"invalid lorafleet-manifest\.json") as err:
        validate_adapter_dir(adapter, "s3://b/x")
    assert err.value.status == 400


def test_wrong_format_is_refused() -> None:
    with pytest.raises(ValueError):
        Manifest.from_json(json.dumps({**GOOD, "format": "other", "files": []}))
