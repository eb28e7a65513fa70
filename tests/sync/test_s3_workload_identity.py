"""s3:// without static keys: boto3's default credential chain, against a real MinIO.

The chain is fed the way EKS Pod Identity feeds a pod (`AWS_CONTAINER_CREDENTIALS_FULL_URI` and
`AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE`, served here by a small real HTTP server handing out
temporary credentials from MinIO's STS), so the settings the chart gives workers and sync Jobs
under workload identity (no key Secret) work.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from lorafleet_devcluster.minio import MinioServer
from lorafleet_sync.errors import SourceError
from lorafleet_sync.s3 import S3Settings
from lorafleet_sync.sources import AdapterSources

from .conftest import read_tree, write_adapter

AGENT_TOKEN = "pod-identity-token-123"


class CredentialAgent:
    """The EKS Pod Identity agent's contract: GET with the token -> temporary credentials."""

    def __init__(self, credentials: dict[str, str]) -> None:
        self.calls: list[str] = []
        agent = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                agent.calls.append(self.headers.get("Authorization", ""))
                if self.headers.get("Authorization") != AGENT_TOKEN:
                    self.send_response(401)
                    self.end_headers()
                    return
                body = json.dumps(credentials).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/credentials"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def no_static_keys(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, minio: MinioServer) -> dict[str, str]:
    """The pod environment the chart renders under workload identity: endpoint, no keys."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "absent-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "absent-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return {"AWS_ENDPOINT_URL_S3": minio.url, "AWS_ALLOW_HTTP": "true", "AWS_REGION": "us-east-1"}


def temporary_credentials(minio: MinioServer) -> dict[str, str]:
    """Session credentials from MinIO's STS AssumeRole (what a cloud identity agent hands out)."""
    import boto3

    sts = boto3.client(
        "sts",
        endpoint_url=minio.url,
        region_name="us-east-1",
        aws_access_key_id=minio.access_key,
        aws_secret_access_key=minio.secret_key,
    )
    creds = sts.assume_role(RoleArn="arn:minio:iam:::role/lorafleet", RoleSessionName="wi", DurationSeconds=900)
    c = creds["Credentials"]
    expiration = c["Expiration"].strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "AccessKeyId": c["AccessKeyId"],
        "SecretAccessKey": c["SecretAccessKey"],
        "Token": c["SessionToken"],
        "Expiration": expiration,
    }


@pytest.fixture
def agent(minio: MinioServer) -> Iterator[CredentialAgent]:
    server = CredentialAgent(temporary_credentials(minio))
    yield server
    server.close()


async def test_pod_identity_credentials_reach_minio(
    make_sources: Callable[..., AdapterSources],
    minio: MinioServer,
    bucket: str,
    tmp_path: Path,
    no_static_keys: dict[str, str],
    agent: CredentialAgent,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    token_file = tmp_path / "eks-pod-identity-token"
    token_file.write_text(AGENT_TOKEN)
    monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", agent.url)
    monkeypatch.setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", str(token_file))
    src = write_adapter(tmp_path / "src")
    minio.upload_dir(bucket, "wi/a", src)
    settings = S3Settings.from_env(no_static_keys)
    assert settings.access_key_id is None and settings.secret_access_key is None
    sources = make_sources(s3_settings=settings)
    path = await sources.fetch(f"s3://{bucket}/wi/a")
    assert read_tree(path) == read_tree(src)
    assert agent.calls and set(agent.calls) == {AGENT_TOKEN}


async def test_no_keys_and_no_identity_is_a_clear_error(
    make_sources: Callable[..., AdapterSources], bucket: str, no_static_keys: dict[str, str]
) -> None:
    sources = make_sources(s3_settings=S3Settings.from_env(no_static_keys))
    with pytest.raises(SourceError, match="no S3 credentials") as err:
        await sources.fetch(f"s3://{bucket}/nothing")
    assert err.value.status == 502 and not err.value.retryable
    assert "cloud identity" in err.value.message
