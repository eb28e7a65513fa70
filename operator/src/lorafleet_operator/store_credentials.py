"""The object-store Secret (and the HF token Secret), copied into each namespace where sync Jobs run.

A sync Job runs in its DynamoModel's namespace, and a pod reads Secrets of its own namespace
only. With several watched namespaces (or cluster scope) the operator therefore keeps a copy of
the store Secret (``LORAFLEET_STORE_SECRET``, read in the operator's own namespace) under the
same name in the Job's namespace while the Job runs: created when absent, updated when its keys
differ (rotated keys), never deleted (other Jobs of that namespace use it). Copies carry
``app.kubernetes.io/managed-by: lorafleet-operator``. Without a store Secret (workload identity)
there is nothing to copy; in the operator's own namespace the original is used.

The HF token Secret (``LORAFLEET_HF_TOKEN_SECRET``, key ``HF_TOKEN``) is copied the same way, so
sync Jobs of private or gated ``hf://`` repositories in other namespaces can authenticate.

RBAC: ``create`` on Secrets, ``get``/``update`` on those Secret names, in the watched namespaces.
Where the copies are unwanted (multi-tenant clusters), give sync Jobs a cloud identity instead.
"""

from __future__ import annotations

import logging
import os

from lorafleet_operator.bootstrap_secrets import MANAGED_BY, operator_secret
from lorafleet_operator.kube import KubeClient, KubeError

log = logging.getLogger(__name__)

KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
HF_KEYS = ("HF_TOKEN",)


async def ensure_copy(
    kube: KubeClient, name: str, namespace: str, home: str | None = None, keys: tuple[str, ...] = KEYS
) -> None:
    """Make Secret ``name`` in ``namespace`` hold the ``keys`` (default: the store keys) of the one
    in ``home`` (default: the operator's namespace, ``POD_NAMESPACE``)."""
    home = home or os.environ.get("POD_NAMESPACE") or "default"
    if not name or namespace == home:
        return
    source = await kube.get(f"/api/v1/namespaces/{home}/secrets/{name}")
    data = {k: v for k, v in ((source or {}).get("data") or {}).items() if k in keys}
    if not data:
        log.warning("Secret %s/%s is missing or has no %s yet; sync Jobs in %s go without", home, name,
                    "/".join(keys), namespace)  # fmt: skip
        return
    path = f"/api/v1/namespaces/{namespace}/secrets"
    copy = operator_secret(name, namespace, data)
    current = await kube.get(f"{path}/{name}")
    if current is None:
        try:
            await kube.create(path, copy)
            log.info("copied Secret %s into namespace %s for sync Jobs", name, namespace)
        except KubeError as e:
            if e.status != 409:
                raise
        return
    current_meta = current.get("metadata") or {}
    ours = (current_meta.get("labels") or {}).get("app.kubernetes.io/managed-by") == MANAGED_BY
    if ours and {k: v for k, v in (current.get("data") or {}).items() if k in keys} != data:
        copy["metadata"]["resourceVersion"] = current_meta.get("resourceVersion")
        await kube.request("PUT", f"{path}/{name}", copy)
        log.info("updated the Secret copy %s/%s (keys changed)", namespace, name)
