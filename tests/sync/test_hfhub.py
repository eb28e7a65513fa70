"""The local hub answers the real huggingface_hub client the way the Hub does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import RemoteEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError
from lorafleet_devcluster.hfhub import LocalHub

TOKEN = "hf_local_hub_token"
FILES_V1 = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"w" * 5000, "docs/README.md": b"hi"}
FILES_V2 = {"adapter_config.json": b'{"r": 16}', "adapter_model.safetensors": b"v" * 6000}


@pytest.fixture(scope="module")
def private_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalHub, str, str]]:
    hub = LocalHub(tmp_path_factory.mktemp("private-hub"), token=TOKEN).start()
    sha1 = hub.commit("org/model", FILES_V1, tags=("v1",))
    sha2 = hub.commit("org/model", FILES_V2)
    yield hub, sha1, sha2
    hub.stop()


def test_model_info_resolves_branches_tags_and_shas(private_hub: tuple[LocalHub, str, str]) -> None:
    hub, sha1, sha2 = private_hub
    api = HfApi(endpoint=hub.url, token=TOKEN)
    assert api.model_info("org/model").sha == sha2
    assert api.model_info("org/model", revision="main").sha == sha2
    assert api.model_info("org/model", revision="v1").sha == sha1
    info = api.model_info("org/model", revision=sha1, files_metadata=True)
    sizes = {s.rfilename: s.size for s in info.siblings or []}
    assert sizes == {name: len(data) for name, data in FILES_V1.items()}
    lfs = {s.rfilename: s.lfs for s in info.siblings or [] if s.lfs}
    assert list(lfs) == ["adapter_model.safetensors"] and lfs["adapter_model.safetensors"].size == 5000


def test_list_files_and_refs(private_hub: tuple[LocalHub, str, str]) -> None:
    hub, sha1, sha2 = private_hub
    api = HfApi(endpoint=hub.url, token=TOKEN)
    assert sorted(api.list_repo_files("org/model", revision="v1")) == sorted(FILES_V1)
    assert sorted(api.list_repo_files("org/model")) == sorted(FILES_V2)
    refs = api.list_repo_refs("org/model")
    assert [(b.name, b.target_commit) for b in refs.branches] == [("main", sha2)]
    assert [(t.name, t.target_commit) for t in refs.tags] == [("v1", sha1)]


def test_snapshot_download_into_cache_and_local_dir(private_hub: tuple[LocalHub, str, str], tmp_path: Path) -> None:
    hub, sha1, _ = private_hub
    cached = Path(
        snapshot_download("org/model", revision="v1", cache_dir=tmp_path / "c", endpoint=hub.url, token=TOKEN)
    )
    assert cached.name == sha1
    assert {p.relative_to(cached).as_posix(): p.read_bytes() for p in cached.rglob("*") if p.is_file()} == FILES_V1
    local = Path(snapshot_download("org/model", local_dir=tmp_path / "l", endpoint=hub.url, token=TOKEN))
    assert (local / "adapter_config.json").read_bytes() == FILES_V2["adapter_config.json"]
    before = hub.downloads["org/model/adapter_model.safetensors"]
    snapshot_download("org/model", revision="v1", cache_dir=tmp_path / "c", endpoint=hub.url, token=TOKEN)
    assert hub.downloads["org/model/adapter_model.safetensors"] == before  # served from the client's cache


def test_errors_map_to_the_clients_exceptions(private_hub: tuple[LocalHub, str, str], tmp_path: Path) -> None:
    hub, _, _ = private_hub
    api = HfApi(endpoint=hub.url, token=TOKEN)
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("org/missing")
    with pytest.raises(RevisionNotFoundError):
        api.model_info("org/model", revision="no-such-branch")
    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download("org/model", "nope.txt", local_dir=tmp_path, endpoint=hub.url, token=TOKEN)


def test_token_is_required_and_checked(private_hub: tuple[LocalHub, str, str]) -> None:
    hub, _, _ = private_hub
    with pytest.raises(RepositoryNotFoundError):  # what the Hub answers a private repo without a token
        HfApi(endpoint=hub.url, token=False).model_info("org/model")
    with pytest.raises(Exception) as err:
        HfApi(endpoint=hub.url, token="hf_wrong").model_info("org/model")
    assert getattr(getattr(err.value, "response", None), "status_code", None) == 401
