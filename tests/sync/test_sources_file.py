"""file:// sources: confined to LORAFLEET_FILE_ROOTS, symlinks may not escape; adapter validation."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from lorafleet_sync.manifest import MANIFEST_NAME, Manifest, file_entry
from lorafleet_sync.sources import AdapterSources, SourceError

from .conftest import write_adapter


@pytest.fixture
def roots(tmp_path: Path) -> Path:
    return tmp_path / "roots"


@pytest.fixture
def sources(make_sources: Callable[..., AdapterSources]) -> AdapterSources:
    return make_sources()


async def test_file_adapter_under_root_is_used_in_place(sources: AdapterSources, roots: Path) -> None:
    adapter = write_adapter(roots / "a")
    assert await sources.fetch(f"file://{adapter}") == adapter.resolve()


async def test_file_outside_roots_is_refused(sources: AdapterSources, tmp_path: Path) -> None:
    outside = write_adapter(tmp_path / "elsewhere")
    with pytest.raises(SourceError) as err:
        await sources.fetch(f"file://{outside}")
    assert err.value.status == 400 and "outside the allowed roots" in err.value.message


async def test_dotdot_is_refused(sources: AdapterSources, roots: Path, tmp_path: Path) -> None:
    write_adapter(tmp_path / "elsewhere")
    with pytest.raises(SourceError) as err:
        await sources.fetch(f"file://{roots}/../elsewhere")
    assert err.value.status == 400


async def test_symlinked_directory_escaping_root_is_refused(
    sources: AdapterSources, roots: Path, tmp_path: Path
) -> None:
    outside = write_adapter(tmp_path / "elsewhere")
    (roots / "link").symlink_to(outside, target_is_directory=True)
    with pytest.raises(SourceError) as err:
        await sources.fetch(f"file://{roots}/link")
    assert err.value.status == 400 and "outside the allowed roots" in err.value.message


async def test_symlinked_file_escaping_root_is_refused(sources: AdapterSources, roots: Path, tmp_path: Path) -> None:
    adapter = write_adapter(roots / "a")
    secret = tmp_path / "secret.safetensors"
    secret.write_bytes(b"not yours")
    (adapter / "adapter_model.safetensors").unlink()
    (adapter / "adapter_model.safetensors").symlink_to(secret)
    with pytest.raises(SourceError) as err:
        await sources.fetch(f"file://{adapter}")
    assert err.value.status == 400 and "symlink" in err.value.message


async def test_symlink_inside_root_is_fine(sources: AdapterSources, roots: Path) -> None:
    adapter = write_adapter(roots / "real")
    (roots / "alias").symlink_to(adapter, target_is_directory=True)
    assert await sources.fetch(f"file://{roots}/alias") == adapter.resolve()


async def test_no_roots_means_file_disabled(make_sources: Callable[..., AdapterSources], tmp_path: Path) -> None:
    sources = make_sources(file_roots=[])
    with pytest.raises(SourceError, match="disabled"):
        await sources.fetch(f"file://{write_adapter(tmp_path / 'x')}")


@pytest.mark.parametrize(
    ("remove", "message"),
    [("adapter_config.json", "missing adapter_config.json"), ("adapter_model.safetensors", "missing adapter weights")],
)
async def test_incomplete_adapter_is_refused(sources: AdapterSources, roots: Path, remove: str, message: str) -> None:
    adapter = write_adapter(roots / "a")
    (adapter / remove).unlink()
    with pytest.raises(SourceError, match=message) as err:
        await sources.fetch(f"file://{adapter}")
    assert err.value.status == 400


async def test_missing_directory(sources: AdapterSources, roots: Path) -> None:
    with pytest.raises(SourceError, match="no such directory"):
        await sources.fetch(f"file://{roots}/nope")


def _write_manifest(adapter: Path) -> None:
    entries = [file_entry(adapter, p.name) for p in sorted(adapter.iterdir()) if p.name != MANIFEST_NAME]
    (adapter / MANIFEST_NAME).write_text(Manifest(source="test", sha="0" * 40, files=entries).to_json())


async def test_manifest_checked_when_present(sources: AdapterSources, roots: Path) -> None:
    adapter = write_adapter(roots / "a")
    _write_manifest(adapter)
    assert await sources.fetch(f"file://{adapter}") == adapter.resolve()

    weights = adapter / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[10] ^= 0xFF  # same size, different bytes
    weights.write_bytes(bytes(data))
    with pytest.raises(SourceError) as err:
        await sources.fetch(f"file://{adapter}")
    assert err.value.status == 400
    assert "adapter_model.safetensors" in err.value.message and "sha256" in err.value.message


async def test_manifest_refuses_unlisted_and_missing_files(sources: AdapterSources, roots: Path) -> None:
    adapter = write_adapter(roots / "a")
    _write_manifest(adapter)
    (adapter / "adapter_model.bin").write_bytes(b"smuggled")
    with pytest.raises(SourceError, match=r"adapter_model\.bin is not listed"):
        await sources.fetch(f"file://{adapter}")
    (adapter / "adapter_model.bin").unlink()
    data = json.loads((adapter / MANIFEST_NAME).read_text())
    data["files"].append({"path": "extra.txt", "size": 1, "sha256": "0" * 64})
    (adapter / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(SourceError, match=r"extra\.txt listed .* is missing"):
        await sources.fetch(f"file://{adapter}")


async def test_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    root_a, root_b = tmp_path / "ra", tmp_path / "rb"
    monkeypatch.setenv("DYN_LORA_PATH", str(tmp_path / "cache"))
    monkeypatch.setenv("LORAFLEET_FILE_ROOTS", f"{root_a}{os.pathsep}{root_b}")
    monkeypatch.setenv("LORAFLEET_CACHE_MAX_BYTES", "12345")
    sources = AdapterSources.from_env()
    assert sources.cache.root == tmp_path / "cache" and sources.cache.max_bytes == 12345
    assert sources.file_roots == [root_a.resolve(), root_b.resolve()]
    adapter = write_adapter(root_b / "x")
    assert await sources.fetch(f"file://{adapter}") == adapter.resolve()
