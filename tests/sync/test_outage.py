"""The object store going away during a download: retry within the deadline, clear 502/504 after it."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from lorafleet_devcluster.minio import MinioServer, wait_until
from lorafleet_sync.errors import SourceError
from lorafleet_sync.retry import FetchPolicy
from lorafleet_sync.s3 import S3Settings
from lorafleet_sync.sources import AdapterSources

from .conftest import read_tree, s3_settings_for, write_adapter


@pytest.fixture
def own_minio(tmp_path: Path) -> Iterator[MinioServer]:
    """A MinIO of this test's own, free to be stopped."""
    server = MinioServer(tmp_path / "minio-data").start()
    yield server
    server.close()


def _upload(minio: MinioServer, tmp_path: Path) -> tuple[str, Path]:
    bucket = minio.make_bucket()
    src = write_adapter(
        tmp_path / "src", weight_bytes=300_000, extra={f"part{i}.bin": bytes([i]) * 200_000 for i in range(3)}
    )
    minio.upload_dir(bucket, "adapter", src)
    return bucket, src


def _assert_clean(sources: AdapterSources) -> None:
    assert sources.cache.keys() == []
    assert [p.name for p in sources.cache.root.iterdir()] == [".tmp"]
    assert list(sources.cache.tmp_root.iterdir()) == []


def _stop_after_first_file(minio: MinioServer, sources: AdapterSources) -> list[str]:
    seen: list[str] = []

    def hook(_uri: str, rel: str) -> None:
        seen.append(rel)
        if len(seen) == 1:
            minio.stop()  # mid-download: the remaining GETs meet a dead server

    sources.on_file = hook
    return seen


async def test_retry_succeeds_when_store_returns_within_deadline(
    make_sources: Callable[..., AdapterSources], own_minio: MinioServer, tmp_path: Path
) -> None:
    bucket, src = _upload(own_minio, tmp_path)
    policy = FetchPolicy(deadline_s=90, initial_backoff_s=0.1, max_backoff_s=1.0)
    sources = make_sources(s3_settings=s3_settings_for(own_minio), policy=policy)
    seen = _stop_after_first_file(own_minio, sources)

    def restart_after_a_failed_attempt() -> None:
        wait_until(lambda: sources.stats["retries"] >= 1, 60, "a failed attempt")
        own_minio.start()

    restarter = threading.Thread(target=restart_after_a_failed_attempt)
    restarter.start()
    try:
        path = await sources.fetch(f"s3://{bucket}/adapter")
    finally:
        restarter.join()
    assert len(seen) > 4  # the first attempt stopped after one file; a later one fetched all five
    assert read_tree(path) == read_tree(src)
    assert sources.stats["downloads"] == 1 and sources.stats["retries"] >= 1
    assert list(sources.cache.tmp_root.iterdir()) == []


async def test_store_gone_past_deadline_is_502_and_leaves_nothing(
    make_sources: Callable[..., AdapterSources], own_minio: MinioServer, tmp_path: Path
) -> None:
    bucket, _ = _upload(own_minio, tmp_path)
    policy = FetchPolicy(deadline_s=2, initial_backoff_s=0.1, max_backoff_s=0.5)
    sources = make_sources(s3_settings=s3_settings_for(own_minio), policy=policy)
    seen = _stop_after_first_file(own_minio, sources)
    with pytest.raises(SourceError) as err:
        await sources.fetch(f"s3://{bucket}/adapter")
    assert seen and err.value.status == 502
    assert f"s3://{bucket}/adapter" in err.value.message and "unreachable" in err.value.message
    assert "gave up" in err.value.message and sources.stats["retries"] >= 1
    _assert_clean(sources)


async def test_store_that_never_answers_is_504(make_sources: Callable[..., AdapterSources]) -> None:
    with socket.socket() as blackhole:  # accepts TCP connections (backlog) but never answers
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(64)
        port = blackhole.getsockname()[1]
        policy = FetchPolicy(deadline_s=1.5, initial_backoff_s=0.1, max_backoff_s=0.2, read_timeout_s=0.3)
        settings = S3Settings(f"http://127.0.0.1:{port}", "us-east-1", True, "key", "secret-value")
        sources = make_sources(s3_settings=settings, policy=policy)
        with pytest.raises(SourceError) as err:
            await sources.fetch("s3://bucket/adapter")
    assert err.value.status == 504 and "timed out" in err.value.message and "gave up" in err.value.message
    _assert_clean(sources)
