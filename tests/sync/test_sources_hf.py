"""hf:// sources through the real huggingface_hub client against the local hub."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from lorafleet_devcluster.hfhub import LocalHub
from lorafleet_sync.hf import HfSettings
from lorafleet_sync.retry import FetchPolicy
from lorafleet_sync.sources import AdapterSources, SourceError
from lorafleet_sync.uris import cache_key

from .conftest import HF_TOKEN, read_tree, write_adapter


@pytest.fixture
def hf_sources(make_sources: Callable[..., AdapterSources], hub: LocalHub) -> Callable[..., AdapterSources]:
    return lambda **kw: make_sources(hf_settings=HfSettings(hub.url, HF_TOKEN), **kw)


async def test_fetch_resolves_branch_to_sha_and_matches_source(
    hf_sources: Callable[..., AdapterSources], hub: LocalHub, tmp_path: Path
) -> None:
    src = write_adapter(tmp_path / "src", extra={"README.md": b"card", ".gitattributes": b"*.safetensors lfs"})
    sha = hub.commit("acme/hf-a", src)
    sources = hf_sources()
    path = await sources.fetch("hf://acme/hf-a@main")
    assert path.name == cache_key(f"hf://acme/hf-a@{sha}")  # keyed on the resolved commit
    expected = read_tree(src)
    del expected[".gitattributes"]  # dot-files are not adapter files
    assert read_tree(path) == expected
    assert not (path / ".cache").exists()
    # The same commit by SHA is a cache hit; concurrent callers share one download.
    before = hub.downloads["acme/hf-a/adapter_model.safetensors"]
    paths = await asyncio.gather(*(sources.fetch(f"hf://acme/hf-a@{sha}") for _ in range(4)))
    assert set(paths) == {path}
    assert hub.downloads["acme/hf-a/adapter_model.safetensors"] == before


async def test_moved_branch_fetches_the_new_commit(
    hf_sources: Callable[..., AdapterSources], hub: LocalHub, tmp_path: Path
) -> None:
    hub.commit("acme/hf-b", write_adapter(tmp_path / "v1", seed=1))
    sources = hf_sources()
    first = await sources.fetch("hf://acme/hf-b")
    sha2 = hub.commit("acme/hf-b", write_adapter(tmp_path / "v2", seed=2))
    second = await sources.fetch("hf://acme/hf-b")
    assert second != first and second.name == cache_key(f"hf://acme/hf-b@{sha2}")
    assert read_tree(second) == read_tree(tmp_path / "v2")


@pytest.mark.parametrize(
    ("uri", "message"),
    [("hf://acme/does-not-exist", "not found"), ("hf://acme/hf-c@no-such-branch", "revision not found")],
)
async def test_missing_repo_or_revision_is_400_naming_the_uri(
    hf_sources: Callable[..., AdapterSources], hub: LocalHub, tmp_path: Path, uri: str, message: str
) -> None:
    hub.commit("acme/hf-c", write_adapter(tmp_path / "c"))
    with pytest.raises(SourceError) as err:
        await hf_sources().fetch(uri)
    assert err.value.status == 400 and uri in err.value.message and message in err.value.message


async def test_repo_without_adapter_files_is_refused_and_leaves_nothing(
    hf_sources: Callable[..., AdapterSources], hub: LocalHub
) -> None:
    hub.commit("acme/not-adapter", {"README.md": b"hello", "model.safetensors": b"x"})
    sources = hf_sources()
    with pytest.raises(SourceError, match=r"missing adapter_config\.json") as err:
        await sources.fetch("hf://acme/not-adapter")
    assert err.value.status == 400
    assert sources.cache.keys() == [] and list(sources.cache.tmp_root.iterdir()) == []


async def test_wrong_token_is_refused_without_retrying(
    make_sources: Callable[..., AdapterSources], hub: LocalHub, tmp_path: Path
) -> None:
    hub.commit("acme/hf-d", write_adapter(tmp_path / "d"))
    sources = make_sources(hf_settings=HfSettings(hub.url, "hf_wrong"))
    with pytest.raises(SourceError) as err:
        await sources.fetch("hf://acme/hf-d")
    assert err.value.status == 502 and "refused our token" in err.value.message
    assert "hf_wrong" not in err.value.message and sources.stats["retries"] == 0


async def test_unreachable_hub_is_502_after_the_deadline(
    make_sources: Callable[..., AdapterSources], tmp_path: Path
) -> None:
    down = LocalHub(tmp_path / "down").start()
    down.commit("acme/e", write_adapter(tmp_path / "e"))
    down.stop()
    policy = FetchPolicy(deadline_s=1.0, initial_backoff_s=0.05, max_backoff_s=0.2)
    sources = make_sources(hf_settings=HfSettings(down.url, None), policy=policy)
    with pytest.raises(SourceError) as err:
        await sources.fetch("hf://acme/e")
    assert err.value.status == 502 and "unreachable" in err.value.message and "gave up" in err.value.message
    assert sources.stats["retries"] >= 1


async def test_pin_survives_a_moved_branch_and_unpin_releases_the_pinned_commit(
    hf_sources: Callable[..., AdapterSources], hub: LocalHub, tmp_path: Path
) -> None:
    sha1 = hub.commit("acme/hf-pin", write_adapter(tmp_path / "p1", seed=1))
    sources = hf_sources()
    await sources.fetch("hf://acme/hf-pin", pin=True)
    old_key = cache_key(f"hf://acme/hf-pin@{sha1}")
    assert sources.cache.is_pinned(old_key)
    sha2 = hub.commit("acme/hf-pin", write_adapter(tmp_path / "p2", seed=2))
    await sources.fetch("hf://acme/hf-pin")
    sources.pin("hf://acme/hf-pin")  # pins what the last fetch resolved: the new commit
    new_key = cache_key(f"hf://acme/hf-pin@{sha2}")
    assert sources.cache.is_pinned(new_key)
    sources.unpin("hf://acme/hf-pin")  # first pin first: releases the old commit
    assert not sources.cache.is_pinned(old_key) and sources.cache.is_pinned(new_key)
    sources.unpin("hf://acme/hf-pin")
    assert not sources.cache.is_pinned(new_key)
    sources.unpin("hf://acme/hf-pin")  # unbalanced unpin is harmless
