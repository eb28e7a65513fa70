"""S3 / MinIO access with boto3, configured from the standard ``AWS_*`` variables (SPEC §5).

Endpoint: ``AWS_ENDPOINT_URL_S3`` > ``AWS_ENDPOINT_URL`` > ``AWS_ENDPOINT`` (none: AWS itself);
plain ``http://`` endpoints need ``AWS_ALLOW_HTTP=true``; region ``AWS_REGION`` (default us-east-1);
credentials: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` when set, else boto3's default chain
(workload identity: ``AWS_ROLE_ARN`` + ``AWS_WEB_IDENTITY_TOKEN_FILE`` as IRSA injects them, EKS Pod
Identity / ECS container credentials, shared config files, instance metadata).
A custom endpoint uses path-style addressing (MinIO). boto3's own retries are off: callers retry.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from .errors import SourceError
from .log import get_logger
from .uris import S3URI, URIError, validate_relative_key

log = get_logger(__name__)
_TRUE = {"1", "true", "yes", "on"}
SHA256_META = "sha256"  # x-amz-meta-sha256 on objects uploaded by the sync job
_T = TypeVar("_T")


@dataclass(frozen=True)
class S3Settings:
    endpoint_url: str | None = None
    region: str = "us-east-1"
    allow_http: bool = False
    access_key_id: str | None = None  # None: boto3's default credential chain
    secret_access_key: str | None = field(default=None, repr=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> S3Settings:
        endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or env.get("AWS_ENDPOINT") or None
        region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
        return cls(
            endpoint,
            region,
            env.get("AWS_ALLOW_HTTP", "").strip().lower() in _TRUE,
            env.get("AWS_ACCESS_KEY_ID") or None,
            env.get("AWS_SECRET_ACCESS_KEY") or None,
        )

    def client(self, *, connect_timeout: float = 5.0, read_timeout: float = 30.0) -> Any:
        """A boto3 S3 client (no automatic retries)."""
        import boto3
        from botocore.config import Config

        if self.endpoint_url and self.endpoint_url.lower().startswith("http://") and not self.allow_http:
            raise SourceError(
                400,
                f"S3 endpoint {self.endpoint_url} is plain HTTP; set AWS_ALLOW_HTTP=true to allow it",
                retryable=False,
            )
        config = Config(
            region_name=self.region,
            connect_timeout=max(0.1, connect_timeout),
            read_timeout=max(0.1, read_timeout),
            retries={"max_attempts": 1, "mode": "standard"},
            s3={"addressing_style": "path" if self.endpoint_url else "auto"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        session = boto3.session.Session(
            aws_access_key_id=self.access_key_id, aws_secret_access_key=self.secret_access_key
        )
        return session.client("s3", endpoint_url=self.endpoint_url, config=config)


def call(label: str, fn: Callable[[], _T]) -> _T:
    """Run ``fn`` (a boto3 call), mapping its errors to SourceError (see :func:`classify`)."""
    try:
        return fn()
    except SourceError:
        raise
    except Exception as exc:
        raise classify(exc, label) from None


def classify(exc: BaseException, label: str) -> SourceError:
    """Map a boto3/botocore exception to a SourceError with the right status and retryability."""
    from botocore import exceptions as bx

    if isinstance(exc, SourceError):
        return exc
    if isinstance(exc, (bx.ConnectTimeoutError, bx.ReadTimeoutError)):
        return SourceError(504, f"{label}: object store timed out ({type(exc).__name__})")
    if isinstance(exc, (bx.EndpointConnectionError, bx.ConnectionClosedError, bx.ConnectionError)):
        return SourceError(502, f"{label}: object store unreachable ({type(exc).__name__})")
    if isinstance(exc, bx.NoCredentialsError):
        return SourceError(
            502,
            f"{label}: no S3 credentials: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or give the pod a cloud "
            "identity (boto3's default chain: web identity token, container or instance credentials)",
            retryable=False,
        )
    if isinstance(exc, bx.ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        http = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if code in ("NoSuchKey", "NoSuchBucket", "404", "NotFound") or http == 404:
            return SourceError(400, f"{label}: not found ({code or http})")
        if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403") or http in (401, 403):
            return SourceError(502, f"{label}: object store refused our credentials ({code or http})", retryable=False)
        if http >= 500 or code in ("SlowDown", "ServiceUnavailable", "InternalError", "XMinioServerNotInitialized"):
            return SourceError(502, f"{label}: object store error {code or http}")
        return SourceError(502, f"{label}: object store error {code or http}", retryable=False)
    if isinstance(exc, OSError):
        return SourceError(502, f"{label}: {type(exc).__name__}: {exc}")
    if isinstance(exc, bx.BotoCoreError):
        return SourceError(502, f"{label}: {type(exc).__name__}")
    log.error("unexpected error fetching %s", label, exc_info=exc)
    return SourceError(502, f"{label}: unexpected error {type(exc).__name__}", retryable=False)


@dataclass(frozen=True)
class RemoteObject:
    key: str
    rel: str  # key relative to the listed prefix
    size: int


def list_objects(client: Any, uri: S3URI) -> list[RemoteObject]:
    """Every object under ``uri``'s prefix; unsafe keys ('..', absolute, empty segments) raise 400."""
    out: list[RemoteObject] = []
    prefix = uri.key_prefix
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=uri.bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            key = item["Key"]
            rel = key[len(prefix) :]
            if key.endswith("/") and item.get("Size", 0) == 0:
                continue  # a "directory" marker
            try:
                validate_relative_key(rel)
            except URIError as exc:
                raise SourceError(400, f"{uri}: refusing object key {key!r}: {exc}", retryable=False) from None
            out.append(RemoteObject(key, rel, int(item.get("Size", 0))))
    return out


def download_objects(
    client: Any,
    uri: S3URI,
    objects: list[RemoteObject],
    dest: Path,
    *,
    deadline: float | None = None,
    on_file: Callable[[str], None] | None = None,
) -> None:
    """Download ``objects`` into ``dest`` (relative layout kept, never outside ``dest``)."""
    root = dest.resolve()
    for obj in objects:
        if deadline is not None and time.monotonic() > deadline:
            raise SourceError(504, f"{uri}: download deadline passed")
        target = (root / obj.rel).resolve()
        if not target.is_relative_to(root) or target == root:
            raise SourceError(400, f"{uri}: refusing object key {obj.key!r}", retryable=False)
        target.parent.mkdir(parents=True, exist_ok=True)
        response = client.get_object(Bucket=uri.bucket, Key=obj.key)
        with target.open("wb") as fh:
            for chunk in response["Body"].iter_chunks(1 << 20):
                fh.write(chunk)
        if target.stat().st_size != obj.size:
            raise SourceError(502, f"{uri}: short read of {obj.rel}")
        if on_file is not None:
            on_file(obj.rel)


def head(client: Any, bucket: str, key: str) -> tuple[int, dict[str, str]] | None:
    """(size, user metadata) of an object, or None when it does not exist."""
    from botocore.exceptions import ClientError

    try:
        response = client.head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if status == 404 or exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return None
        raise
    return int(response["ContentLength"]), dict(response.get("Metadata", {}))


def get_bytes(client: Any, bucket: str, key: str) -> bytes | None:
    """An object's content, or None when it does not exist."""
    from botocore.exceptions import ClientError

    try:
        return bytes(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
            return None
        raise


def upload_file(client: Any, bucket: str, key: str, path: Path, sha256: str) -> None:
    with path.open("rb") as fh:
        client.put_object(Bucket=bucket, Key=key, Body=fh, Metadata={SHA256_META: sha256})


def put_bytes(client: Any, bucket: str, key: str, data: bytes, content_type: str = "application/json") -> None:
    client.put_object(Bucket=bucket, Key=key, Body=data, ContentType=content_type)
