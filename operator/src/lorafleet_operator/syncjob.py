"""The sync Job that copies an ``hf://`` adapter into the object store (SPEC §6, §7).

Resolved URI (design choice): the operator resolves the revision to a commit SHA itself
(``lorafleet_sync.hf.resolve``, the same code the job uses) *before* creating the Job, runs
the Job with the pinned ``hf://org/repo@<sha>``, and records the SHA in the Job's
``lorafleet.nvidia.com/revision`` annotation. The job's destination is then a pure function,
``lorafleet_sync.uris.synced_uri(source, store, sha)`` = ``s3://bucket[/prefix]/org/repo/<sha>``,
so no pod log, termination message or store listing is needed, and a branch moving while the
Job runs cannot change what it copies. Once the Job is Complete the workers load that URI.

The Job's name is ``lorafleet-sync-<first 16 hex of BLAKE3(modelName ‖ 0x00 ‖ uri ‖ 0x00 ‖ sha)>``:
the same model, source and commit always map to the same Job, which is created once (a 409 means
another pass or an earlier operator already created it). The Job is owned by the DynamoModel
(garbage-collected with it). Exit code 75 (network trouble) is retried up to ``backoffLimit``;
any other failure fails the Job at once (``podFailurePolicy``).

Lifecycle: Jobs carry ``activeDeadlineSeconds`` (``--sync-deadline``) and
``ttlSecondsAfterFinished`` (``--sync-ttl``); once the status records the synced commit, a Job
the TTL removed is not recreated. A failed Job is deleted and created again after
``retry_base·2^(attempt-1)`` seconds (capped by ``--retry-max`` ×60); the Synced message says
when. A branch or tag is re-resolved every ``--revision-interval`` seconds; a new commit makes
a new Job and, once it completes, a hot swap (the old version serves meanwhile).

Per-model credentials: ``spec.source.credentialsSecretRef`` names a Secret of the DynamoModel's
namespace whose keys the sync Job gets as environment (``envFrom``; its ``HF_TOKEN`` replaces the
operator-wide token, the store's keys stay the store's). The operator never reads that Secret:
while it is missing, the Job's pod cannot start (the kubelet says so in the container's waiting
state, which the operator reads from the pod) and the model shows ``Synced=False`` reason
``CredentialsSecretMissing``; the Job starts by itself once the Secret exists. Branches are still
resolved with the operator's own token; a repository only the model's token can read needs a
source pinned to a commit.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import blake3
from lorafleet_sync.errors import SourceError
from lorafleet_sync.hf import HfSettings, resolve
from lorafleet_sync.uris import S3URI, HfURI, is_commit_sha, synced_uri

from lorafleet_operator import metrics, store_credentials
from lorafleet_operator import status as st
from lorafleet_operator.api import API_VERSION, KIND
from lorafleet_operator.kube import KubeClient, KubeError
from lorafleet_operator.reconcile import SyncResult
from lorafleet_operator.resources import Model
from lorafleet_operator.settings import OperatorSettings

MANAGED_BY = "lorafleet-operator"
REVISION_ANNOTATION = "lorafleet.nvidia.com/revision"
ATTEMPT_ANNOTATION = "lorafleet.nvidia.com/attempt"
SOURCE_ANNOTATION = "lorafleet.nvidia.com/source"
MODEL_LABEL = "lorafleet.nvidia.com/model-uid"
RETRYABLE_EXIT_CODE = 75
# Pod Security "restricted" (the images run as UID 10001); downloads are staged under /tmp.
POD_SECURITY_CONTEXT = {
    "runAsNonRoot": True,
    "runAsUser": 10001,
    "runAsGroup": 10001,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY_CONTEXT = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


def job_name(model_name: str, uri: str, sha: str = "") -> str:
    """Deterministic Job name for (modelName, source URI, commit)."""
    key = b"\x00".join(part.encode() for part in (model_name, uri, sha))
    return "lorafleet-sync-" + blake3.blake3(key).hexdigest()[:16]


def store_uri(settings: OperatorSettings) -> S3URI:
    return S3URI(settings.store_bucket, settings.store_prefix.strip("/"))


def job_manifest(model: Model, source: HfURI, sha: str, settings: OperatorSettings, attempt: int = 1) -> dict[str, Any]:
    """The batch/v1 Job for ``model``'s ``source`` pinned at ``sha``."""
    name = job_name(model.model_name, model.uri or str(source), sha)
    labels = {
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "app.kubernetes.io/component": "sync",
        MODEL_LABEL: model.uid,
    }
    env: list[dict[str, Any]] = [
        {"name": "AWS_REGION", "value": settings.store_region},
        {"name": "HOME", "value": "/tmp"},
    ]
    if settings.store_endpoint:
        env.append({"name": "AWS_ENDPOINT_URL_S3", "value": settings.store_endpoint})
        if settings.store_endpoint.startswith("http://"):
            env.append({"name": "AWS_ALLOW_HTTP", "value": "true"})
    if settings.store_secret:
        env += [
            {"name": key, "valueFrom": {"secretKeyRef": {"name": settings.store_secret, "key": key}}}
            for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
        ]
    if settings.hf_endpoint:
        env.append({"name": "HF_ENDPOINT", "value": settings.hf_endpoint})
    token_secret = model.credentials_secret or settings.hf_token_secret  # the model's own token wins
    if token_secret:
        ref = {"name": token_secret, "key": "HF_TOKEN", "optional": True}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "securityContext": POD_SECURITY_CONTEXT,
        "containers": [
            {
                "name": "sync",
                "image": settings.sync_image,
                "command": [
                    "lorafleet-sync",
                    "--source",
                    str(source.with_revision(sha)),
                    "--dest",
                    str(store_uri(settings)),
                ],
                "env": env,
                "resources": json.loads(settings.sync_resources) if settings.sync_resources else {},
                "securityContext": CONTAINER_SECURITY_CONTEXT,
                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
            }
        ],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
    }
    if model.credentials_secret:  # every key of the model's Secret (env above wins for the same names)
        pod_spec["containers"][0]["envFrom"] = [{"secretRef": {"name": model.credentials_secret}}]
    if settings.sync_service_account:
        pod_spec["serviceAccountName"] = settings.sync_service_account
    if settings.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in settings.image_pull_secrets]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "namespace": model.namespace,
            "labels": labels,
            "annotations": {
                SOURCE_ANNOTATION: model.uri or str(source),
                REVISION_ANNOTATION: sha,
                ATTEMPT_ANNOTATION: str(attempt),
            },
            "ownerReferences": [
                {
                    "apiVersion": API_VERSION,
                    "kind": KIND,
                    "name": model.name,
                    "uid": model.uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "backoffLimit": settings.sync_backoff_limit,
            "activeDeadlineSeconds": settings.sync_deadline,
            "ttlSecondsAfterFinished": settings.sync_ttl,
            "podFailurePolicy": {
                "rules": [
                    {
                        "action": "FailJob",
                        "onExitCodes": {"containerName": "sync", "operator": "NotIn", "values": [RETRYABLE_EXIT_CODE]},
                    }
                ]
            },
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


def job_state(job: Mapping[str, Any]) -> tuple[str, str]:
    """("running" | "succeeded" | "failed", message) from a Job's status conditions."""
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("status") != "True":
            continue
        if cond.get("type") == "Complete":
            return "succeeded", "sync Job completed"
        if cond.get("type") == "Failed":
            reason = cond.get("reason") or "Failed"
            return "failed", f"sync Job failed ({reason}): {cond.get('message') or 'see the Job pod logs'}"
    status = job.get("status") or {}
    active, failed = status.get("active") or 0, status.get("failed") or 0
    if failed:
        return "running", f"sync Job retrying: {failed} pod(s) failed on a retryable error, {active} active"
    return "running", f"sync Job running ({active} active pod(s))"


class SyncJobs:
    """``SyncBackend`` creating and following sync Jobs through the Kubernetes API."""

    def __init__(
        self, kube: KubeClient, settings: OperatorSettings, hf: HfSettings, secret_namespace: str = ""
    ) -> None:
        self.kube = kube
        self.settings = settings
        self.hf = hf
        self.secret_namespace = secret_namespace  # where --hf-token-secret lives (the operator's namespace)
        self._token: tuple[str | None, float] | None = None  # (HF token from the Secret, read at)
        self._seen: dict[str, str] = {}  # job name -> last state counted in metrics
        self._revisions: dict[str, tuple[str, float]] = {}  # hf://org/repo@rev -> (sha, resolved at)
        self._jobs: dict[tuple[str, str], Mapping[str, Any]] = {}  # (namespace, name) -> Job, from the watch

    def observe(self, job: Mapping[str, Any], *, deleted: bool = False) -> None:
        """Keep the Job cache current from the Jobs watch (``Runtime.on_job``)."""
        meta = job.get("metadata") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        if deleted:
            self._jobs.pop(key, None)
        else:
            self._jobs[key] = dict(job)

    async def ensure(self, model: Model, source: HfURI) -> SyncResult:
        uri = model.uri or str(source)
        try:
            sha = await self._revision(source)
        except SourceError as e:
            name = job_name(model.model_name, uri)
            state = "running" if e.retryable else "failed"
            retry = self.settings.revision_interval if state == "failed" else None
            return SyncResult(state, name, message=f"resolving {source}: {e.message}", reason=st.RESOLVE_FAILED,
                              retry_after=retry)  # fmt: skip
        name = job_name(model.model_name, uri, sha)
        resolved = str(synced_uri(source, store_uri(self.settings), sha))
        recheck = None if is_commit_sha(source.revision) else self.settings.revision_interval
        if _already_synced(model, sha, resolved):  # also after the TTL removed the finished Job
            return SyncResult("succeeded", model.status.get("syncJob") or name, resolved, sha,
                              "synced", retry_after=recheck)  # fmt: skip
        path = f"/apis/batch/v1/namespaces/{model.namespace}/jobs"
        job = self._jobs.get((model.namespace, name))
        if job is None:  # not seen on the watch (yet): ask once
            job = await self.kube.get(f"{path}/{name}")
        if job is None or job_state(job)[0] == "running":  # the Job's pod reads the keys in its namespace
            home = self.secret_namespace or None
            await store_credentials.ensure_copy(self.kube, self.settings.store_secret, model.namespace, home)
            await store_credentials.ensure_copy(
                self.kube, self.settings.hf_token_secret, model.namespace, home, store_credentials.HF_KEYS
            )
        if job is None:
            job = await self._create(model, source, sha, path, name, attempt=1)
        state, message = job_state(job)
        if self._seen.get(name) != state and state != "running":
            metrics.SYNC_JOBS.labels(state).inc()
        self._seen[name] = state
        if state == "failed":
            return await self._failed(model, source, sha, path, job, message)
        if state == "running" and model.credentials_secret and (missing := await self._secret_missing(model, name)):
            return SyncResult(state, name, None, sha, missing, reason=st.CREDENTIALS_MISSING, retry_after=recheck)
        retrying = state == "running" and bool((job.get("status") or {}).get("failed"))
        return SyncResult(state, name, resolved if state == "succeeded" else None, sha, message,
                          reason=st.SYNC_JOB_RETRYING if retrying else "", retry_after=recheck)  # fmt: skip

    async def _failed(
        self, model: Model, source: HfURI, sha: str, path: str, job: Mapping[str, Any], message: str
    ) -> SyncResult:
        """A failed Job: recreated after an exponential backoff; until then, say when."""
        meta = job.get("metadata") or {}
        attempt = int((meta.get("annotations") or {}).get(ATTEMPT_ANNOTATION) or 1)
        delay = min(self.settings.retry_max * 60, self.settings.retry_base * 30 * 2 ** (attempt - 1))
        failed_at = _failed_at(job)
        wait = failed_at + delay - time.time()
        name = meta.get("name", "")
        if wait > 0:
            when = datetime.fromtimestamp(failed_at + delay, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            return SyncResult("failed", name, None, sha, f"{message}; attempt {attempt}, next try at {when}",
                              retry_after=wait)  # fmt: skip
        await self.kube.delete(f"{path}/{name}", {"propagationPolicy": "Background"})
        self._jobs.pop((model.namespace, name), None)
        await self._create(model, source, sha, path, name, attempt=attempt + 1)
        return SyncResult("running", name, None, sha, f"sync Job recreated (attempt {attempt + 1})")

    async def _create(
        self, model: Model, source: HfURI, sha: str, path: str, name: str, attempt: int
    ) -> Mapping[str, Any]:
        try:
            job = await self.kube.create(path, job_manifest(model, source, sha, self.settings, attempt))
            metrics.SYNC_JOBS.labels("created").inc()
        except KubeError as e:
            if e.status != 409:
                raise
            job = await self.kube.get(f"{path}/{name}") or {}  # created meanwhile, or still being deleted
        if job:
            self._jobs[(model.namespace, name)] = job
        await self._delete_stale(model, path, name)
        return job

    async def _secret_missing(self, model: Model, job: str) -> str | None:
        """A message when the Job's pod waits for the Secret ``spec.source.credentialsSecretRef`` names
        (the kubelet's CreateContainerConfigError); None otherwise. The Secret itself is never read."""
        secret = model.credentials_secret
        path = f"/api/v1/namespaces/{model.namespace}/pods"
        pods = await self.kube.request("GET", path, params={"labelSelector": f"job-name={job}"})
        for pod in pods.get("items") or []:
            for container in (pod.get("status") or {}).get("containerStatuses") or []:
                waiting = (container.get("state") or {}).get("waiting") or {}
                config_error = waiting.get("reason") == "CreateContainerConfigError"
                if config_error and f'"{secret}"' in str(waiting.get("message")):
                    return (f"Secret {secret} (spec.source.credentialsSecretRef) not found in namespace "
                            f"{model.namespace}; sync Job {job} starts once it exists")  # fmt: skip
        return None

    async def _revision(self, source: HfURI) -> str:
        """The commit of ``source``: itself when pinned, else resolved (again every revision interval)."""
        if is_commit_sha(source.revision):
            return source.revision or ""
        key = str(source)
        cached = self._revisions.get(key)
        if cached is not None and time.monotonic() - cached[1] < self.settings.revision_interval:
            return cached[0]
        sha, _files = await asyncio.to_thread(resolve, await self._hf(), source)
        self._revisions[key] = (sha, time.monotonic())
        return sha

    async def _hf(self) -> HfSettings:
        """Hub settings for resolving revisions: the token comes from the environment or, like the
        Jobs', from the Secret ``--hf-token-secret`` (re-read every revision interval: rotation)."""
        if self.hf.token or not self.settings.hf_token_secret or not self.secret_namespace:
            return self.hf
        if self._token is None or time.monotonic() - self._token[1] > self.settings.revision_interval:
            path = f"/api/v1/namespaces/{self.secret_namespace}/secrets/{self.settings.hf_token_secret}"
            secret = await self.kube.get(path)
            raw = ((secret or {}).get("data") or {}).get("HF_TOKEN")
            self._token = (base64.b64decode(raw).decode().strip() if raw else None, time.monotonic())
        return HfSettings(self.hf.endpoint, self._token[0])

    async def _delete_stale(self, model: Model, path: str, keep: str) -> None:
        """Delete this model's Jobs for earlier sources or commits."""
        jobs = await self.kube.request("GET", path, params={"labelSelector": f"{MODEL_LABEL}={model.uid}"})
        for job in jobs.get("items") or []:
            name = job["metadata"]["name"]
            if name != keep:
                await self.kube.delete(f"{path}/{name}", {"propagationPolicy": "Background"})


def _already_synced(model: Model, sha: str, resolved: str) -> bool:
    """The status already records this commit synced to the store (its Job may be gone: TTL)."""
    synced = st.condition(model.status, "Synced")
    return (
        model.status.get("revision") == sha
        and model.status.get("resolvedUri") == resolved
        and synced is not None
        and synced.get("status") == "True"
        and synced.get("reason") == st.SYNC_SUCCEEDED
    )


def _failed_at(job: Mapping[str, Any]) -> float:
    """When the Job failed (its Failed condition's transition time), as a Unix time."""
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Failed" and cond.get("lastTransitionTime"):
            return datetime.strptime(cond["lastTransitionTime"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
    return time.time()
