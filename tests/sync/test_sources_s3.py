"""s3:// sources against a real MinIO: identical files, one download per URI, key safety, byte cap."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from xml.sax.saxutils import escape

import pytest
from lorafleet_devcluster.minio import MinioServer, wait_until
from lorafleet_sync import s3
from lorafleet_sync.errors import SourceError
from lorafleet_sync.s3 import S3Settings
from lorafleet_sync.sources import AdapterSources
from lorafleet_sync.uris import S3URI, cache_key

from .conftest import read_tree, write_adapter


async def test_s3_copy_is_identical_to_source(
    remote_sources: Callable[..., AdapterSources], minio: MinioServer, bucket: str, tmp_path: Path
) -> None:
    src = write_adapter(tmp_path / "src", extra={"nested/tokenizer.json": b"{}"})
    minio.upload_dir(bucket, "team/a", src)
    sources = remote_sources()
    path = await sources.fetch(f"s3://{bucket}/team/a/")
    assert path == sources.cache.root / cache_key(f"s3://{bucket}/team/a")
    assert read_tree(path) == read_tree(src)
    assert list(sources.cache.tmp_root.iterdir()) == []


async def test_sixteen_concurrent_fetches_download_once(
    remote_sources: Callable[..., AdapterSources], minio: MinioServer, bucket: str, tmp_path: Path
) -> None:
    src = write_adapter(tmp_path / "src", weight_bytes=2 << 20, extra={"extra.bin": b"x" * 1000})
    minio.upload_dir(bucket, "hot", src)
    sources = remote_sources()
    paths = await asyncio.gather(*(sources.fetch(f"s3://{bucket}/hot") for _ in range(16)))
    assert len(set(paths)) == 1
    assert sources.stats["downloads"] == 1
    wait_until(lambda: len(minio.audit.calls("GetObject", bucket, "hot/")) >= 3, 20, "the audit records")
    minio.sync_audit(bucket)  # and anything that might still follow
    gets = minio.audit.calls("GetObject", bucket, "hot/")
    assert sorted(r["api"]["object"] for r in gets) == [
        "hot/adapter_config.json",
        "hot/adapter_model.safetensors",
        "hot/extra.bin",
    ]
    # Later fetches are cache hits: no further GETs.
    await asyncio.gather(*(sources.fetch(f"s3://{bucket}/hot") for _ in range(4)))
    minio.sync_audit(bucket)
    assert len(minio.audit.calls("GetObject", bucket, "hot/")) == 3


@pytest.mark.parametrize(("prefix", "what"), [("nothing-here", "no objects"), ("missing-bucket", "not found")])
async def test_missing_object_or_empty_prefix_is_400_naming_uri(
    remote_sources: Callable[..., AdapterSources], bucket: str, prefix: str, what: str
) -> None:
    uri = f"s3://{bucket}/{prefix}" if prefix == "nothing-here" else "s3://no-such-bucket-xyz/a"
    sources = remote_sources()
    with pytest.raises(SourceError) as err:
        await sources.fetch(uri)
    assert err.value.status == 400 and uri in err.value.message and what in err.value.message
    assert sources.cache.keys() == [] and list(sources.cache.tmp_root.iterdir()) == []


async def test_prefix_without_adapter_files_is_400(
    remote_sources: Callable[..., AdapterSources], minio: MinioServer, bucket: str
) -> None:
    minio.client().put_object(Bucket=bucket, Key="junk/readme.txt", Body=b"hi")
    sources = remote_sources()
    with pytest.raises(SourceError, match=r"missing adapter_config\.json"):
        await sources.fetch(f"s3://{bucket}/junk")
    assert sources.cache.keys() == [] and list(sources.cache.tmp_root.iterdir()) == []


def test_minio_itself_refuses_dotdot_keys(minio: MinioServer, bucket: str) -> None:
    """Why the next test needs a hostile endpoint: MinIO will not store such keys at all."""
    from botocore.exceptions import ClientError

    for key in ("evil/../../x", "evil//etc/passwd", "evil/./a"):
        with pytest.raises(ClientError):
            minio.client().put_object(Bucket=bucket, Key=key, Body=b"payload")


@pytest.fixture
def hostile_s3() -> Iterator[Callable[[list[str]], str]]:
    """A real HTTP endpoint answering S3 ListObjectsV2 with whatever keys a test sets (as AWS S3 may
    hold keys MinIO refuses); every other request gets 500. Returns set_keys(keys) -> endpoint URL."""
    keys: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            return

        def do_GET(self) -> None:
            if "list-type=2" not in self.path:
                self.send_response(500)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            contents = "".join(
                f"<Contents><Key>{escape(k)}</Key><Size>7</Size><ETag>&quot;x&quot;</ETag></Contents>" for k in keys
            )
            body = (
                '<?xml version="1.0" encoding="UTF-8"?>'
                '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                f"<Name>bucket</Name><Prefix>evil/</Prefix><KeyCount>{len(keys)}</KeyCount>"
                f"<MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated>{contents}</ListBucketResult>"
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def set_keys(new: list[str]) -> str:
        keys[:] = new
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield set_keys
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("key", ["evil/../../x", "evil//etc/passwd", "evil/./a", "evil/a/../../../b"])
async def test_unsafe_object_keys_are_refused(
    make_sources: Callable[..., AdapterSources], hostile_s3: Callable[[list[str]], str], tmp_path: Path, key: str
) -> None:
    endpoint = hostile_s3(["evil/adapter_config.json", "evil/adapter_model.safetensors", key])
    sources = make_sources(s3_settings=S3Settings(endpoint, "us-east-1", True, "key", "secret"))
    with pytest.raises(SourceError, match="refusing object key") as err:
        await sources.fetch("s3://bucket/evil")
    assert err.value.status == 400 and not err.value.retryable
    assert sources.cache.keys() == [] and not (tmp_path / "x").exists()


def test_download_never_writes_outside_dest(minio: MinioServer, bucket: str, tmp_path: Path) -> None:
    """Defence in depth below the listing check: a crafted object list cannot escape the temp dir."""
    minio.client().put_object(Bucket=bucket, Key="p/a", Body=b"a")
    settings = S3Settings(minio.url, "us-east-1", True, minio.access_key, minio.secret_key)
    dest = tmp_path / "dest"
    dest.mkdir()
    bad = [s3.RemoteObject("p/a", "../escaped", 1)]
    with pytest.raises(SourceError, match="refusing object key"):
        s3.download_objects(settings.client(), S3URI(bucket, "p"), bad, dest)
    assert not (tmp_path / "escaped").exists()


async def test_plain_http_endpoint_needs_allow_http(
    remote_sources: Callable[..., AdapterSources], minio: MinioServer, bucket: str
) -> None:
    sources = remote_sources(s3_settings=S3Settings(minio.url, "us-east-1", False, minio.access_key, minio.secret_key))
    with pytest.raises(SourceError, match="AWS_ALLOW_HTTP") as err:
        await sources.fetch(f"s3://{bucket}/x")
    assert err.value.status == 400


async def test_wrong_credentials_are_refused_without_leaking(
    remote_sources: Callable[..., AdapterSources], minio: MinioServer, bucket: str, tmp_path: Path
) -> None:
    minio.upload_dir(bucket, "creds", write_adapter(tmp_path / "src"))
    wrong = S3Settings(minio.url, "us-east-1", True, minio.access_key, "not-the-secret-123")
    sources = remote_sources(s3_settings=wrong)
    with pytest.raises(SourceError) as err:
        await sources.fetch(f"s3://{bucket}/creds")
    assert err.value.status == 502 and "credentials" in err.value.message
    assert "not-the-secret-123" not in err.value.message and sources.stats["retries"] == 0


def test_settings_from_env_precedence() -> None:
    env = {
        "AWS_ENDPOINT": "http://c:3",
        "AWS_ENDPOINT_URL": "http://b:2",
        "AWS_ENDPOINT_URL_S3": "http://a:1",
        "AWS_ALLOW_HTTP": "true",
    }
    assert S3Settings.from_env(env).endpoint_url == "http://a:1"
    del env["AWS_ENDPOINT_URL_S3"]
    assert S3Settings.from_env(env).endpoint_url == "http://b:2"
    del env["AWS_ENDPOINT_URL"]
    settings = S3Settings.from_env(env)
    assert settings.endpoint_url == "http://c:3" and settings.allow_http and settings.region == "us-east-1"
    assert S3Settings.from_env({"AWS_REGION": "eu-west-1"}).region == "eu-west-1"
    assert "secret" not in repr(S3Settings.from_env({"AWS_SECRET_ACCESS_KEY": "secret"}))


async def test_disk_cache_stays_under_cap_across_more_adapters_than_fit(
    remote_sources: Callable[..., AdapterSources], minio: MinioServer, bucket: str, tmp_path: Path
) -> None:
    from lorafleet_sync.cache import dir_size

    weight = 100_000
    for i in range(8):
        minio.upload_dir(bucket, f"many/{i}", write_adapter(tmp_path / f"a{i}", seed=i, weight_bytes=weight))
    cap = 3 * weight + 3000  # room for three adapters
    sources = remote_sources(cache_max_bytes=cap)
    await sources.fetch(f"s3://{bucket}/many/0", pin=True)  # in the worker's tiers: must survive
    for i in range(1, 8):
        path = await sources.fetch(f"s3://{bucket}/many/{i}")
        assert read_tree(path) == read_tree(tmp_path / f"a{i}")
        assert dir_size(sources.cache.root) <= cap and sources.cache.total_bytes <= cap
        assert cache_key(f"s3://{bucket}/many/0") in sources.cache
    assert len(sources.cache.keys()) == 3 and sources.cache.evictions == 5
    # The unpinned older ones were evicted; fetching one again downloads it again.
    sources.unpin(f"s3://{bucket}/many/0")
    await sources.fetch(f"s3://{bucket}/many/1")
    assert sources.stats["downloads"] == 9 and dir_size(sources.cache.root) <= cap
