"""A tiny JSON client for the Kubernetes API (httpx), used by the node agent and cluster helpers.

It works on plain dicts (no model classes), which keeps the agent fast and simple.
Only the kubeconfig shapes this package writes are supported: a CA file or CA
data, and a client certificate/key pair or a bearer token.
"""

from __future__ import annotations

import base64
import json
import ssl
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

JSON = dict[str, Any]


class KubeError(Exception):
    """A non-2xx answer from the API server."""

    def __init__(self, status: int, body: str) -> None:
        self.status = status
        try:
            self.reason = json.loads(body).get("reason", "")
            message = json.loads(body).get("message", body)
        except (ValueError, AttributeError):
            self.reason, message = "", body
        super().__init__(f"HTTP {status}: {message}")


@dataclass(frozen=True)
class Credentials:
    """Where and how to reach an API server."""

    server: str
    ca_file: Path
    cert_file: Path | None = None
    key_file: Path | None = None
    token: str | None = None

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        if self.cert_file and self.key_file:
            ctx.load_cert_chain(str(self.cert_file), str(self.key_file))
        return ctx


def _materialise(data_b64: str, suffix: str) -> Path:
    with tempfile.NamedTemporaryFile("wb", suffix=suffix, delete=False) as f:
        f.write(base64.b64decode(data_b64))
    return Path(f.name)


def load_kubeconfig(path: Path) -> Credentials:
    """Credentials of the current context of a kubeconfig file."""
    cfg = yaml.safe_load(path.read_text())
    ctx_name = cfg["current-context"]
    ctx = next(c["context"] for c in cfg["contexts"] if c["name"] == ctx_name)
    cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == ctx["cluster"])
    user = next(u["user"] for u in cfg["users"] if u["name"] == ctx["user"])
    ca = cluster.get("certificate-authority") or _materialise(cluster["certificate-authority-data"], ".crt")
    cert = user.get("client-certificate") or (
        _materialise(user["client-certificate-data"], ".crt") if "client-certificate-data" in user else None
    )
    key = user.get("client-key") or (
        _materialise(user["client-key-data"], ".key") if "client-key-data" in user else None
    )
    return Credentials(
        server=cluster["server"],
        ca_file=Path(ca),
        cert_file=Path(cert) if cert else None,
        key_file=Path(key) if key else None,
        token=user.get("token"),
    )


def write_kubeconfig(path: Path, *, server: str, ca_pem: bytes, user: JSON, namespace: str | None = None) -> Path:
    """Write a one-context kubeconfig (`user` is the kubeconfig `user` stanza)."""
    context: JSON = {"cluster": "local", "user": "user"}
    if namespace:
        context["namespace"] = namespace
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "local",
                "cluster": {"server": server, "certificate-authority-data": base64.b64encode(ca_pem).decode()},
            }
        ],
        "users": [{"name": "user", "user": user}],
        "contexts": [{"name": "local", "context": context}],
        "current-context": "local",
    }
    path.write_text(yaml.safe_dump(cfg))
    path.chmod(0o600)
    return path


class Kube:
    """Synchronous JSON calls against one API server."""

    def __init__(self, creds: Credentials, timeout: float = 30.0) -> None:
        self.creds = creds
        headers = {"Authorization": f"Bearer {creds.token}"} if creds.token else {}
        self._http = httpx.Client(
            base_url=creds.server, verify=creds.ssl_context(), headers=headers, timeout=timeout, trust_env=False
        )

    @classmethod
    def from_kubeconfig(cls, path: Path, timeout: float = 30.0) -> Kube:
        return cls(load_kubeconfig(path), timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Kube:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(
        self,
        method: str,
        path: str,
        body: JSON | list[JSON] | None = None,
        *,
        params: dict[str, Any] | None = None,
        content_type: str = "application/json",
    ) -> JSON:
        content = json.dumps(body).encode() if body is not None else None
        resp = self._http.request(method, path, content=content, params=params, headers={"Content-Type": content_type})
        if resp.status_code >= 300:
            raise KubeError(resp.status_code, resp.text)
        return resp.json() if resp.content else {}

    def get(self, path: str, **params: Any) -> JSON:
        return self.request("GET", path, params=params or None)

    def post(self, path: str, body: JSON) -> JSON:
        return self.request("POST", path, body)

    def put(self, path: str, body: JSON) -> JSON:
        return self.request("PUT", path, body)

    def merge_patch(self, path: str, body: JSON) -> JSON:
        return self.request("PATCH", path, body, content_type="application/merge-patch+json")

    def delete(self, path: str, body: JSON | None = None) -> JSON:
        return self.request("DELETE", path, body)

    def watch(self, path: str, resource_version: str, timeout_seconds: int = 60, **params: Any) -> Iterator[JSON]:
        """Yield watch events (`{"type", "object"}`) until the server ends the watch."""
        query = {"watch": "1", "resourceVersion": resource_version, "timeoutSeconds": timeout_seconds, **params}
        with self._http.stream("GET", path, params=query, timeout=timeout_seconds + 10) as resp:
            if resp.status_code >= 300:
                raise KubeError(resp.status_code, resp.read().decode())
            for line in resp.iter_lines():
                if line.strip():
                    yield json.loads(line)
