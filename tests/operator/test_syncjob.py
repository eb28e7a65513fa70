"""The sync Job manifest and the reading of a Job's state (no cluster)."""

from __future__ import annotations

from lorafleet_operator.resources import Model
from lorafleet_operator.settings import Settings
from lorafleet_operator.syncjob import REVISION_ANNOTATION, job_manifest, job_name, job_state
from lorafleet_sync.uris import HfURI

SHA = "0123456789abcdef0123456789abcdef01234567"


def model(uri: str = "hf://org/repo@main") -> Model:
    return Model("ns", "dm-a", "uid-1", 1, "org/adapter", "base", "lora", uri)


def settings() -> Settings:
    return Settings(store_endpoint="http://minio:9000", store_bucket="loras", store_prefix="synced/",
                    store_secret="store-creds", hf_endpoint="http://hub:8080", hf_token_secret="hf")  # fmt: skip


def test_job_name_is_deterministic_and_valid() -> None:
    a = job_name("org/adapter", "hf://org/repo@main")
    assert a == job_name("org/adapter", "hf://org/repo@main")
    assert a != job_name("org/adapter", "hf://org/repo@v2") != job_name("org/other", "hf://org/repo@main")
    assert a.startswith("lorafleet-sync-") and len(a) <= 63 and a == a.lower()


def test_manifest_pins_the_revision_and_is_owned() -> None:
    job = job_manifest(model(), HfURI("org", "repo", "main"), SHA, settings())
    meta, spec = job["metadata"], job["spec"]
    assert meta["name"] == job_name("org/adapter", "hf://org/repo@main")
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
    done = {"status": {"conditions": [{"type": "Complete", "status": "True"}]}}
    assert job_state(done)[0] == "succeeded"
    failed = {"status": {"conditions": [{"type": "Failed", "status": "True", "reason": "PodFailurePolicy",
                                         "message": "exit code 2"}]}}  # fmt: skip
    state, message = job_state(failed)
    assert state == "failed" and "PodFailurePolicy" in message and "exit code 2" in message
