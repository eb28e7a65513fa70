"""The `lorafleet-sync` job (SPEC §6), run as a real process against the local hub and MinIO."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from lorafleet_devcluster.hfhub import LocalHub
from lorafleet_devcluster.minio import MinioServer
from lorafleet_sync.manifest import MANIFEST_NAME, sha256_file
from lorafleet_sync.sources import AdapterSources, SourceError

from .conftest import SYNC, Run, read_tree, write_adapter


def _puts(minio: MinioServer, bucket: str, prefix: str) -> list[str]:
    minio.sync_audit(bucket)
    return [r["api"]["object"][len(prefix) :] for r in minio.audit.calls("PutObject", bucket, prefix)]


async def test_sync_uploads_all_then_nothing_then_new_sha(
    run_sync: Callable[..., Run], minio: MinioServer, hub: LocalHub, bucket: str, tmp_path: Path
) -> None:
    src = write_adapter(tmp_path / "v1", extra={"README.md": b"# card", ".gitattributes": b"*"})
    sha = hub.commit("acme/sync-a", src)
    prefix = f"mirror/acme/sync-a/{sha}/"

    first = run_sync("--source", "hf://acme/sync-a@main", "--dest", f"s3://{bucket}/mirror")
    assert first.code == 0, first.stderr
    assert first.last_line == f"s3://{bucket}/mirror/acme/sync-a/{sha}"
    assert first.stdout.strip() == first.last_line  # stdout is machine-readable; logs go to stderr
    for name in ("adapter_config.json", "adapter_model.safetensors", "README.md"):
        assert f"uploaded {name}" in first.stderr
    puts = _puts(minio, bucket, prefix)
    assert sorted(puts) == sorted(["README.md", "adapter_config.json", "adapter_model.safetensors", MANIFEST_NAME])
    assert puts[-1] == MANIFEST_NAME  # written last

    manifest = json.loads(minio.client().get_object(Bucket=bucket, Key=prefix + MANIFEST_NAME)["Body"].read())
    assert manifest["sha"] == sha and manifest["source"] == f"hf://acme/sync-a@{sha}"
    assert {f["path"]: (f["size"], f["sha256"]) for f in manifest["files"]} == {
        name: ((src / name).stat().st_size, sha256_file(src / name))
        for name in ("README.md", "adapter_config.json", "adapter_model.safetensors")
    }

    second = run_sync("--source", "hf://acme/sync-a@main", "--dest", f"s3://{bucket}/mirror")
    assert second.code == 0 and second.last_line == first.last_line
    assert "up to date" in second.stderr
    assert _puts(minio, bucket, prefix) == puts  # nothing uploaded

    sha2 = hub.commit("acme/sync-a", write_adapter(tmp_path / "v2", seed=2))
    third = run_sync("--source", "hf://acme/sync-a", "--dest", f"s3://{bucket}/mirror")
    assert third.code == 0 and third.last_line == f"s3://{bucket}/mirror/acme/sync-a/{sha2}"
    assert sorted(_puts(minio, bucket, f"mirror/acme/sync-a/{sha2}/")) == sorted(
        ["adapter_config.json", "adapter_model.safetensors", MANIFEST_NAME]
    )


async def test_interrupted_sync_is_completed_without_reuploading(
    run_sync: Callable[..., Run], minio: MinioServer, hub: LocalHub, bucket: str, tmp_path: Path
) -> None:
    sha = hub.commit("acme/sync-b", write_adapter(tmp_path / "b"))
    assert run_sync("--source", "hf://acme/sync-b", "--dest", f"s3://{bucket}").code == 0
    prefix = f"acme/sync-b/{sha}/"
    minio.client().delete_object(Bucket=bucket, Key=prefix + MANIFEST_NAME)  # as if it died before the manifest
    before = _puts(minio, bucket, prefix)
    again = run_sync("--source", "hf://acme/sync-b", "--dest", f"s3://{bucket}")
    assert again.code == 0 and "unchanged adapter_model.safetensors" in again.stderr
    assert _puts(minio, bucket, prefix)[len(before) :] == [MANIFEST_NAME]


@pytest.mark.parametrize("source", ["hf://acme/no-such-repo", "hf://acme/sync-c@no-such-branch"])
def test_missing_repo_or_revision_is_permanent(
    run_sync: Callable[..., Run], hub: LocalHub, bucket: str, tmp_path: Path, source: str
) -> None:
    hub.commit("acme/sync-c", write_adapter(tmp_path / "c"))
    result = run_sync("--source", source, "--dest", f"s3://{bucket}")
    assert result.code == 65 and result.stdout == ""
    assert "permanent" in result.stderr and source in result.stderr


def test_unreachable_hub_is_retryable(run_sync: Callable[..., Run], bucket: str, tmp_path: Path) -> None:
    down = LocalHub(tmp_path / "down").start()
    url = down.url
    down.stop()
    result = run_sync("--source", "hf://acme/x", "--dest", f"s3://{bucket}", "--deadline", "1", endpoint=url)
    assert result.code == 75 and "retryable" in result.stderr and result.stdout == ""


def test_wrong_token_is_permanent_and_not_logged(
    run_sync: Callable[..., Run], hub: LocalHub, bucket: str, tmp_path: Path
) -> None:
    hub.commit("acme/sync-d", write_adapter(tmp_path / "d"))
    result = run_sync("--source", "hf://acme/sync-d", "--dest", f"s3://{bucket}", token="hf_wrong_token_value")
    assert result.code == 65  # (the helper asserts the token appears nowhere in the output)


@pytest.mark.parametrize(
    "args",
    [["--source", "s3://bucket/x", "--dest", "s3://bucket/y"], ["--source", "hf://a/b", "--dest", "file:///x"], []],
)
def test_usage_errors(run_sync: Callable[..., Run], args: list[str]) -> None:
    assert run_sync(*args).code == 64


def test_help_documents_layout_and_exit_codes() -> None:
    out = subprocess.run([str(SYNC), "--help"], capture_output=True, text=True, check=True).stdout
    for text in ("s3://BUCKET[/PREFIX]/ORG/REPO/SHA/", "lorafleet-manifest.json", "75", "65", "HF_TOKEN"):
        assert text in out


async def test_same_adapter_from_file_s3_and_hf_is_identical(
    run_sync: Callable[..., Run],
    remote_sources: Callable[..., AdapterSources],
    hub: LocalHub,
    bucket: str,
    tmp_path: Path,
) -> None:
    src = write_adapter(tmp_path / "roots" / "same")
    sha = hub.commit("acme/same", src)
    s3_uri = run_sync("--source", "hf://acme/same", "--dest", f"s3://{bucket}/m").last_line
    sources = remote_sources()
    from_file = await sources.fetch(f"file://{src}")
    from_s3 = await sources.fetch(s3_uri)
    from_hf = await sources.fetch(f"hf://acme/same@{sha}")
    assert read_tree(from_file) == read_tree(from_s3) == read_tree(from_hf) == read_tree(src)
    assert (from_s3 / MANIFEST_NAME).is_file()  # validated against the manifest on fetch


@pytest.mark.parametrize("tamper", ["bytes", "size"])
async def test_tampered_object_is_refused_naming_the_file(
    run_sync: Callable[..., Run],
    remote_sources: Callable[..., AdapterSources],
    minio: MinioServer,
    hub: LocalHub,
    bucket: str,
    tmp_path: Path,
    tamper: str,
) -> None:
    src = write_adapter(tmp_path / "t")
    hub.commit("acme/tampered", src)
    uri = run_sync("--source", "hf://acme/tampered", "--dest", f"s3://{bucket}").last_line
    key = uri.removeprefix(f"s3://{bucket}/") + "/adapter_model.safetensors"
    data = bytearray((src / "adapter_model.safetensors").read_bytes())
    if tamper == "bytes":
        data[100] ^= 0x01
    else:
        data += b"\0"
    minio.client().put_object(Bucket=bucket, Key=key, Body=bytes(data))
    sources = remote_sources()
    with pytest.raises(SourceError) as err:
        await sources.fetch(uri)
    assert err.value.status == 400
    assert "adapter_model.safetensors" in err.value.message and "integrity" in err.value.message
    assert sources.cache.keys() == [] and list(sources.cache.tmp_root.iterdir()) == []


def test_log_formatter_masks_secrets_in_messages_and_tracebacks() -> None:
    import logging

    from lorafleet_sync.log import SecretMaskingFormatter

    formatter = SecretMaskingFormatter("%(message)s", ["hf_supersecret", "", "abc"])
    try:
        raise RuntimeError("token hf_supersecret leaked into an exception")
    except RuntimeError:
        import sys

        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "using %s", ("hf_supersecret",), sys.exc_info())
    text = formatter.format(record)
    assert "hf_supersecret" not in text and text.count("***") >= 2 and "RuntimeError" in text
