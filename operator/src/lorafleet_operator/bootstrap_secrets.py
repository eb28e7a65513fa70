"""Secrets generated once, at run time, by the operator (GitOps-safe credentials).

``helm template`` (how Argo CD and Flux render charts) cannot keep a random value from one
render to the next, so the chart never renders generated credentials. It lists them instead in
``LORAFLEET_GENERATED_SECRETS``, a JSON object ``{secret name: {key: length}}``, and the
operator creates, at start-up and in its own namespace (``POD_NAMESPACE``), each of those
Secrets that does not exist yet, with random alphanumeric values. An existing Secret is never
changed, so restarts, re-renders and re-syncs all find the same values; a Secret created at
the same moment by another operator process (409) is simply used. Pods that need the values
(workers, MinIO) reference the Secrets as usual and wait until they exist, as the kubelet does
for any missing Secret.

``LORAFLEET_ADMIN_TOKEN_SECRET`` (``name/key``) names the generated admin token the operator
itself sends to the workers' management API; it is read back from the API, so the operator
pod does not depend on a Secret it creates.

The generated Secrets belong to no Helm release (a release-tracking label would make Argo CD
prune them): ``helm uninstall`` keeps them, as it keeps the MinIO volume, so a reinstall finds
the same token and keys. They carry ``app.kubernetes.io/managed-by: lorafleet-operator``.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import secrets
import string
from collections.abc import Mapping
from typing import Any

from lorafleet_operator.kube import KubeClient, KubeError

log = logging.getLogger(__name__)

SECRETS_ENV = "LORAFLEET_GENERATED_SECRETS"
ADMIN_TOKEN_ENV = "LORAFLEET_ADMIN_TOKEN_SECRET"
MANAGED_BY = "lorafleet-operator"
_ALPHABET = string.ascii_letters + string.digits

Wanted = dict[str, dict[str, int]]  # secret name -> key -> value length


def parse_wanted(raw: str) -> Wanted:
    """``{"name": {"key": length}}`` from the env value; ValueError naming the problem."""
    if not raw.strip():
        return {}
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{SECRETS_ENV}: not JSON ({e})") from None
    ok = isinstance(data, dict) and all(
        isinstance(keys, dict) and keys and all(isinstance(n, int) and 8 <= n <= 256 for n in keys.values())
        for keys in data.values()
    )
    if not ok:
        raise ValueError(f'{SECRETS_ENV}: want {{"secret": {{"key": length 8..256}}}}, got {raw!r}')
    return {str(name): {str(k): int(n) for k, n in keys.items()} for name, keys in data.items()}


def random_value(length: int) -> str:
    return "".join(secrets.choice(_ALPHABET) for _ in range(length))


def operator_secret(name: str, namespace: str, data: Mapping[str, str]) -> dict[str, Any]:
    """A Secret the operator owns (``data`` base64-encoded), labelled as such."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/managed-by": MANAGED_BY, "app.kubernetes.io/part-of": "lorafleet"},
        },
        "type": "Opaque",
        "data": dict(data),
    }


def secret_manifest(name: str, namespace: str, keys: Mapping[str, int]) -> dict[str, Any]:
    """A new Secret with a fresh random value per key."""
    data = {key: base64.b64encode(random_value(n).encode()).decode() for key, n in sorted(keys.items())}
    return operator_secret(name, namespace, data)


def decoded(secret: Mapping[str, object]) -> dict[str, str]:
    data = secret.get("data") or {}
    assert isinstance(data, dict)
    return {k: base64.b64decode(v).decode() for k, v in data.items()}


async def ensure(kube: KubeClient, namespace: str, wanted: Wanted) -> dict[str, dict[str, str]]:
    """Create each wanted Secret that is missing; returns every wanted Secret's values."""
    out: dict[str, dict[str, str]] = {}
    for name, keys in wanted.items():
        path = f"/api/v1/namespaces/{namespace}/secrets"
        found = await kube.get(f"{path}/{name}")
        if found is None:
            try:
                found = await kube.create(path, secret_manifest(name, namespace, keys))
                log.info("created Secret %s/%s (keys %s)", namespace, name, ", ".join(sorted(keys)))
            except KubeError as e:
                if e.status != 409:
                    raise
                found = await kube.get(f"{path}/{name}") or {}
        values = decoded(found)
        missing = sorted(set(keys) - set(values))
        if missing:  # never rewrite a Secret someone else made: say what is wrong instead
            log.error("Secret %s/%s exists without key(s) %s; pods using it cannot start", namespace, name, missing)
        out[name] = values
    return out


async def bootstrap(kube: KubeClient, token: str | None, env: Mapping[str, str] = os.environ) -> str | None:
    """Create the generated Secrets the chart asks for; the admin token to send to workers
    (``token`` from the settings wins, else the generated one named by ADMIN_TOKEN_ENV)."""
    wanted = parse_wanted(env.get(SECRETS_ENV, ""))
    if not wanted:
        return token
    namespace = env.get("POD_NAMESPACE") or "default"
    values = await ensure(kube, namespace, wanted)
    if token or not env.get(ADMIN_TOKEN_ENV):
        return token
    name, _, key = env[ADMIN_TOKEN_ENV].partition("/")
    return values.get(name, {}).get(key) or None
