"""The sync Job manifest and the reading of a Job's state (no cluster)."""

from __future__ import annotations

import base64
import dataclasses
import time
from datetime import UTC, datetime
from pathlib import Path

from lorafleet_devcluster.hfhub import LocalHub
from lorafleet_operator.resources import Model
from lorafleet_operator.settings import OperatorSettings
from lorafleet_operator.syncjob import REVISION_ANNOTATION, SyncJobs, job_manifest, job_name, job_state
from lorafleet_sync.hf import HfSettings
from lorafleet_sync.uris import HfURI

SHA = "0123456789abcdef0123456789abcdef01234567"


def model(uri: str = "hf://org/repo@main") -> Model:
    return Model("ns", "dm-a", "uid-1", 1, "org/adapter", "base", "lora", uri)


def settings() -> OperatorSettings:
    return OperatorSettings(store_endpoint="http://minio:9000", store_bucket="loras", store_prefix="synced/",
                    store_secret="store-creds", hf_endpoint="http://hub:8080", hf_token_secret="hf")  # fmt: skip


def test_job_name_is_deterministic_and_valid() -> None:
    a = job_name("org/adapter", "hf://org/repo@main")
    assert a == job_name("org/adapter", "hf://org/repo@main")
    assert a != job_name("org/adapter", "hf://org/repo@v2") != job_name("org/other", "hf://org/repo@main")
    assert a.startswith("lorafleet-sync-") and len(a) <= 63 and a == a.lower()


def test_manifest_pins_the_revision_and_is_owned() -> None:
    job = job_manifest(model(), HfURI("org", "repo", "main"), SHA, settings())
    meta, spec = job["metadata"], job["spec"]
    assert meta["name"] == job_name("org/adapter", "hf://org/repo@main", SHA)
    assert meta["annotations"][REVISION_ANNOTATION] == SHA
    (owner,) = meta["ownerReferences"]
    assert owner["kind"] == "DynamoModel" and owner["uid"] == "uid-1" and owner["controller"]
    (container,) = spec["template"]["spec"]["containers"]
    assert container["command"] == ["lorafleet-sync", "--source", f"hf://org/repo@{SHA}", "--dest", "s3://loras/synced"]
    env = {e["name"]: e for e in container["env"]}
    assert env["AWS_ENDPOINT_URL_S3"]["value"] == "http://minio:9000" and env["AWS_ALLOW_HTTP"]["value"] == "true"
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "store-creds"
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "HF_TOKEN", "optional": True}
    assert all("value" not in env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN"))
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    (rule,) = spec["podFailurePolicy"]["rules"]
    assert rule["action"] == "FailJob" and rule["onExitCodes"] == {"containerName": "sync", "operator": "NotIn",
                                                                     "values": [75]}  # fmt: skip


def test_job_state() -> None:
    assert job_state({})[0] == "running"
    assert job_state({"status": {"active": 1}}) == ("running", "sync Job running (1 active pod(s))")
    state, message = job_state({"status": {"active": 1, "failed": 2}})  # pods failed on a retryable error
    assert state == "running" and "2 pod(s) failed" in message
    done = {"status": {"conditions": [{"type": "Complete", "status": "True"}]}}
    assert job_state(done)[0] == "succeeded"
    failed = {"status": {"conditions": [{"type": "Failed", "status": "True", "reason": "PodFailurePolicy",
                                         "message": "exit code 2"}]}}  # fmt: skip
    state, message = job_state(failed)
    assert state == "failed" and "PodFailurePolicy" in message and "exit code 2" in message


class Kube:
    """The few Kubernetes calls SyncJobs makes, on a dict of Jobs (the real ones run in e2e)."""

    def __init__(self) -> None:
        self.jobs: dict[str, dict] = {}
        self.secrets: dict[str, dict] = {}  # "namespace/name" -> Secret
        self.deleted: list[str] = []
        self.job_gets = 0
        self.pods: list[dict] = []  # the sync Jobs' pods
        self.secret_reads: list[str] = []

    async def get(self, path: str) -> dict | None:
        self.job_gets += "/jobs/" in path
        if "/secrets/" in path:
            self.secret_reads.append(path)
            parts = path.split("/")
            return self.secrets.get(f"{parts[4]}/{parts[6]}")
        return self.jobs.get(path.rsplit("/", 1)[1])

    async def create(self, path: str, body: dict) -> dict:
        if path.endswith("/secrets"):  # a Secret copied where the Job runs (store_credentials)
            self.secrets[f"{body['metadata']['namespace']}/{body['metadata']['name']}"] = body
        else:
            self.jobs[body["metadata"]["name"]] = body
        return body

    async def delete(self, path: str, body: dict | None = None) -> None:
        name = path.rsplit("/", 1)[1]
        self.deleted.append(name)
        self.jobs.pop(name, None)

    async def request(self, method: str, path: str, params: dict | None = None) -> dict:
        if path.endswith("/pods"):
            job = (params or {})["labelSelector"].removeprefix("job-name=")
            return {"items": [p for p in self.pods if p["metadata"]["labels"]["job-name"] == job]}
        return {"items": list(self.jobs.values())}


def fail(job: dict, seconds_ago: float) -> None:
    at = datetime.fromtimestamp(time.time() - seconds_ago, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    job["status"] = {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                     "lastTransitionTime": at}]}  # fmt: skip


async def test_failed_job_is_recreated_with_backoff_and_ttl_never_resyncs() -> None:
    kube = Kube()
    jobs = SyncJobs(kube, OperatorSettings(store_bucket="loras", retry_base=1.0), HfSettings("http://hub", None))  # type: ignore[arg-type]
    pinned = model(f"hf://org/repo@{SHA}")
    source = HfURI("org", "repo", SHA)
    first = await jobs.ensure(pinned, source)
    assert first.state == "running" and first.revision == SHA
    (job,) = kube.jobs.values()
    assert job["spec"]["activeDeadlineSeconds"] == 3600 and job["spec"]["ttlSecondsAfterFinished"] == 3600
    job["status"] = {"active": 1, "failed": 1}  # a pod exited 75 (the hub failing): the Job retries it
    retrying = await jobs.ensure(pinned, source)
    assert retrying.state == "running" and retrying.reason == "SyncJobRetrying"
    assert "1 pod(s) failed" in retrying.message
    fail(job, seconds_ago=5)  # first backoff: 30 s
    gets = kube.job_gets
    waiting = await jobs.ensure(pinned, source)
    assert kube.job_gets == gets  # the Job comes from the cache the watch keeps, not a GET
    assert waiting.state == "failed" and "attempt 1, next try at" in waiting.message
    assert waiting.retry_after is not None and 20 < waiting.retry_after <= 25
    fail(job, seconds_ago=31)
    again = await jobs.ensure(pinned, source)
    assert again.state == "running" and kube.deleted == [first.job_name]
    assert kube.jobs[first.job_name]["metadata"]["annotations"]["lorafleet.nvidia.com/attempt"] == "2"
    fail(kube.jobs[first.job_name], seconds_ago=31)  # second backoff: 60 s
    assert (await jobs.ensure(pinned, source)).state == "failed"
    kube.jobs[first.job_name]["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    done = await jobs.ensure(pinned, source)
    assert done.state == "succeeded" and done.resolved_uri == f"s3://loras/org/repo/{SHA}"
    status = {"revision": SHA, "resolvedUri": done.resolved_uri, "syncJob": done.job_name,
              "conditions": [{"type": "Synced", "status": "True", "reason": "SyncSucceeded"}]}  # fmt: skip
    kube.jobs.clear()  # ttlSecondsAfterFinished removed it
    after_ttl = await jobs.ensure(dataclasses.replace(pinned, status=status), source)
    assert after_ttl.state == "succeeded" and not kube.jobs


FILES = {"adapter_config.json": b'{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}',
         "adapter_model.safetensors": b"weights"}  # fmt: skip


async def test_private_repo_resolves_with_the_token_secret_and_a_moved_branch_syncs_again(tmp_path: Path) -> None:
    hub = LocalHub(tmp_path / "hub", token="hf_secret_token").start()
    try:
        first = hub.commit("org/private", FILES)
        kube = Kube()
        cfg = OperatorSettings(store_bucket="loras", hf_token_secret="hf-token", revision_interval=0)
        jobs = SyncJobs(kube, cfg, HfSettings(hub.url, None), secret_namespace="lorafleet")  # type: ignore[arg-type]
        source = HfURI("org", "private", "main")
        m = model("hf://org/private@main")
        missing = await jobs.ensure(m, source)  # no Secret yet: the hub refuses, clearly
        assert missing.state == "failed" and missing.reason == "RevisionResolveFailed" and not kube.jobs
        assert "hf_secret_token" not in missing.message
        kube.secrets["lorafleet/hf-token"] = {"data": {"HF_TOKEN": base64.b64encode(b"hf_secret_token").decode()}}
        jobs._token = None  # the Secret appeared (re-read every revision interval anyway)
        ok = await jobs.ensure(m, source)
        assert ok.state == "running" and ok.revision == first
        # the Job runs in the DynamoModel's namespace, where its pod reads HF_TOKEN: a copy is made there
        assert kube.secrets["ns/hf-token"]["data"] == kube.secrets["lorafleet/hf-token"]["data"]
        assert kube.secrets["ns/hf-token"]["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "lorafleet-operator"
        assert kube.jobs[ok.job_name]["metadata"]["annotations"][REVISION_ANNOTATION] == first
        moved = hub.commit("org/private", {**FILES, "adapter_model.safetensors": b"new weights"})
        again = await jobs.ensure(m, source)  # re-resolved: a new commit, a new Job
        assert again.revision == moved != first and again.job_name != ok.job_name
        assert kube.deleted == [ok.job_name]  # the older commit's Job
    finally:
        hub.stop()


async def test_per_model_credentials_reach_the_job_and_a_missing_secret_is_a_clear_condition() -> None:
    from lorafleet_operator import status as st

    kube = Kube()
    jobs = SyncJobs(kube, settings(), HfSettings("http://hub", None))  # type: ignore[arg-type]
    pinned = dataclasses.replace(model(f"hf://org/private@{SHA}"), credentials_secret="team-hf")
    source = HfURI("org", "private", SHA)
    first = await jobs.ensure(pinned, source)
    assert first.state == "running" and first.reason == ""
    job = kube.jobs[first.job_name]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["envFrom"] == [{"secretRef": {"name": "team-hf"}}]
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "team-hf", "key": "HF_TOKEN", "optional": True}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "store-creds"  # the store's own
    assert "envFrom" not in job_manifest(model(), HfURI("org", "repo", "main"), SHA, settings())["spec"][
        "template"]["spec"]["containers"][0]  # fmt: skip
    # the kubelet cannot start the pod without the Secret: the condition says which Secret, where
    waiting = {"reason": "CreateContainerConfigError", "message": 'secret "team-hf" not found'}
    kube.pods.append({"metadata": {"labels": {"job-name": first.job_name}},
                      "status": {"containerStatuses": [{"name": "sync", "state": {"waiting": waiting}}]}})  # fmt: skip
    missing = await jobs.ensure(pinned, source)
    assert missing.state == "running" and missing.reason == st.CREDENTIALS_MISSING
    assert "team-hf" in missing.message and "namespace ns" in missing.message
    assert not any("team-hf" in path for path in kube.secret_reads)  # never read, so never logged
    kube.pods[0]["status"] = {"containerStatuses": [{"name": "sync", "state": {"running": {}}}]}  # it appeared
    assert (await jobs.ensure(pinned, source)).reason == ""
