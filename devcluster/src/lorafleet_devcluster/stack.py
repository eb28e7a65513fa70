"""lorafleet installed by its Helm chart on a test cluster: install/upgrade, the chart's MinIO,
DynamoModels, and requests through the router's Service. Used by the chart e2e tests and `make demo`.

Only the chart's objects are used: MinIO credentials come from the chart's Secret, requests go
to the router Service (resolved to a ready pod IP on the local cluster, which has no kube-proxy).
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from lorafleet_operator import api

from lorafleet_devcluster.helm import CHART, values_args
from lorafleet_devcluster.session import TestCluster

BASE_MODEL = "Qwen/Qwen3-0.6B"  # the base model Dynamo's example manifest names
JSON = dict[str, Any]


def deep_merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(base))
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def default_values(cluster: TestCluster, *, workers: int = 2, hf_endpoint: str = "") -> dict[str, Any]:
    """Values for a CPU test/demo install: dev images, a tiny generated model, the chart's MinIO.

    Tags are those `make images` builds (`IMAGE_TAG`, default "dev"); the worker is the `-dev` variant,
    whose transformers/peft serve `model.generateTiny`. In process mode the tags are not used.
    """
    pull = "IfNotPresent" if cluster.is_local else "Never"  # kind: images are side-loaded
    tag = os.environ.get("IMAGE_TAG", "dev")
    minio: dict[str, Any] = {}
    if not cluster.is_local and os.environ.get("LORAFLEET_E2E_MINIO_IMAGE"):  # kind without a registry
        repository, _, minio_tag = os.environ["LORAFLEET_E2E_MINIO_IMAGE"].rpartition(":")
        minio = {"minio": {"image": {"repository": repository, "tag": minio_tag, "pullPolicy": pull}}}
    return minio | {
        "image": {
            "operator": {"repository": "lorafleet/operator", "tag": tag, "pullPolicy": pull},
            "worker": {"repository": "lorafleet/worker", "tag": f"{tag}-dev", "pullPolicy": pull},
        },
        "listenOnPodIP": cluster.is_local,  # local pods share the host's network namespace
        "store": {"mode": "minio"},
        "huggingface": {"endpoint": hf_endpoint},
        "operator": {"driftCheckSeconds": 5, "callTimeoutSeconds": 10},
        # Small requests: a real node (kind, 2 CPUs) schedules by them, and its control plane asks for ~1 CPU.
        "workerDefaults": {"resources": {"requests": {"cpu": "100m", "memory": "512Mi"}}},
        "workers": [
            {
                "name": "qwen",
                "baseModelName": BASE_MODEL,
                "replicas": workers,
                "device": "cpu",
                "dtype": "float32",
                "maxLoras": 4,
                "model": {"generateTiny": True, "tinyArch": "qwen3"},
            }
        ],
    }


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.5) -> Any:
    """Poll until `predicate()` is truthy; TimeoutError naming `what` (and the last error) otherwise."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except Exception as exc:  # the condition may fail while things start
            last, value = exc, None
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(
        f"timed out after {timeout:.0f}s waiting for {what}" + (f" (last error: {last})" if last else "")
    )


class RolloutError(RuntimeError):
    """A release did not become ready; the message says which pods wait on what."""


@dataclass
class Release:
    """One Helm release of the chart in `namespace`."""

    cluster: TestCluster
    namespace: str
    name: str = "lf"
    values: dict[str, Any] = field(default_factory=dict)
    log: Callable[[str], None] = lambda _msg: None

    @property
    def fullname(self) -> str:
        return f"{self.name}-lorafleet"

    # -- helm ----------------------------------------------------------------------------------
    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.cluster.helm(*args, "--namespace", self.namespace, check=check)

    def apply_values(self, values: Mapping[str, Any], *, wait: bool = True, timeout: str = "280s") -> None:
        """`helm upgrade --install [--wait]` with exactly `values` (kept as self.values); with `wait`,
        also until every Deployment is fully rolled out (helm's --wait accepts `replicas - maxUnavailable`)."""
        self.values = copy.deepcopy(dict(values))
        waiting = ["--wait", "--timeout", timeout] if wait else []
        try:
            self.helm("upgrade", "--install", self.name, str(CHART), *waiting, *values_args(self.values))
            if wait:
                wait_for(self.rolled_out, float(timeout.rstrip("s")), "every Deployment rolled out")
        except (subprocess.CalledProcessError, TimeoutError) as err:
            if not wait:
                raise
            try:
                report = self.cluster.pod_report(self.namespace)
            except Exception as failed:  # the API may be what is down: keep the first error in front
                report = f"(no pod report: {failed!r})"
            raise RolloutError(f"{err}\n{report}") from err

    def rolled_out(self) -> bool:
        """Every Deployment of the release has all its replicas updated and ready, and no old pod left."""
        path = f"/apis/apps/v1/namespaces/{self.namespace}/deployments"
        items = self.cluster.get(path, labelSelector=f"app.kubernetes.io/instance={self.name}")["items"]
        return bool(items) and all(
            (d.get("status") or {}).get(field, 0) == d["spec"]["replicas"]
            for d in items
            for field in ("updatedReplicas", "readyReplicas", "replicas")
        )

    def deploy(self, values: Mapping[str, Any], *, timeout: str = "280s") -> None:
        """Install with MinIO first, then the worker groups (`workers`, `vllmWorkers`; `timeout`: how long
        they may take to roll out). On the local cluster (no Service DNS) the store endpoint is the MinIO
        pod's address, known once it runs."""
        groups = {kind: values.get(kind, []) for kind in ("workers", "vllmWorkers")}
        self.log("helm install: operator, router, MinIO")
        self.apply_values(deep_merge(values, {kind: [] for kind in groups}))
        if self.cluster.is_local and values.get("store", {}).get("mode", "minio") == "minio":
            host, port = self.endpoint(f"{self.fullname}-minio", 9000)
            values = deep_merge(values, {"store": {"endpoint": f"http://{host}:{port}"}})
        pods = sum(w.get("replicas", 2) for group in groups.values() for w in group)
        self.log(f"helm upgrade: {pods} worker pod(s)")
        self.apply_values(deep_merge(values, groups), timeout=timeout)

    def uninstall(self) -> None:
        self.helm("uninstall", self.name, "--wait", "--timeout", "180s")

    # -- cluster access ------------------------------------------------------------------------
    def endpoint(self, service: str, port: int | str) -> tuple[str, int]:
        return wait_for(
            lambda: self.cluster.service_endpoint(self.namespace, service, port),
            120,
            f"a ready endpoint of service {service}",
        )

    def secret(self, name: str) -> dict[str, str]:
        data = self.cluster.get(f"/api/v1/namespaces/{self.namespace}/secrets/{name}")["data"]
        return {k: base64.b64decode(v).decode() for k, v in data.items()}

    def s3(self) -> Any:
        """A boto3 client for the chart's MinIO, with the chart Secret's credentials."""
        import boto3
        from botocore.config import Config

        host, port = self.endpoint(f"{self.fullname}-minio", 9000)
        creds = self.secret(f"{self.fullname}-store")
        return boto3.client(
            "s3",
            endpoint_url=f"http://{host}:{port}",
            region_name="us-east-1",
            aws_access_key_id=creds["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=creds["AWS_SECRET_ACCESS_KEY"],
            config=Config(s3={"addressing_style": "path"}),
        )

    def upload(self, directory: Path, uri: str) -> None:
        """Copy an adapter directory to `s3://bucket/prefix` (creating the bucket)."""
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        s3 = self.s3()
        if bucket not in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:
            s3.create_bucket(Bucket=bucket)
        for path in sorted(p for p in directory.rglob("*") if p.is_file()):
            s3.upload_file(str(path), bucket, f"{prefix.rstrip('/')}/{path.relative_to(directory).as_posix()}")

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl("-n", self.namespace, *args, input=input, check=check)

    def pods(self, component: str) -> list[JSON]:
        selector = f"app.kubernetes.io/instance={self.name},app.kubernetes.io/component={component}"
        items = self.cluster.get(f"/api/v1/namespaces/{self.namespace}/pods", labelSelector=selector)["items"]
        return [p for p in items if not p["metadata"].get("deletionTimestamp")]

    # -- DynamoModels --------------------------------------------------------------------------
    def apply(self, manifest: Path | str) -> None:
        text = manifest.read_text() if isinstance(manifest, Path) else manifest
        self.kubectl("apply", "-f", "-", input=text)

    def model(self, name: str) -> JSON:
        return self.cluster.get(api.model_path(self.namespace, name))

    def wait_ready(self, name: str, *, total: int | None = None, timeout: float = 240) -> JSON:
        """Wait until DynamoModel `name` is Ready (with `total` endpoints, if given) for its generation."""

        def ready() -> JSON | None:
            dm = self.model(name)
            status = dm.get("status") or {}
            cond = {c["type"]: c for c in status.get("conditions", [])}.get("Ready", {})
            ok = (
                status.get("phase") == "Ready"
                and cond.get("status") == "True"
                and status.get("observedGeneration") == dm["metadata"]["generation"]
                and status.get("readyEndpoints") == status.get("totalEndpoints")
                and (total is None or status.get("totalEndpoints") == total)
            )
            return dm if ok else None

        try:
            return wait_for(ready, timeout, f"DynamoModel {name} Ready")
        except TimeoutError as exc:
            status = json.dumps(self.model(name).get("status"), indent=1)
            raise TimeoutError(f"{exc}\nstatus: {status}\noperator log:\n{self.operator_log()[-3000:]}") from None

    def wait_gone(self, name: str, timeout: float = 120) -> None:
        path = api.model_path(self.namespace, name)
        wait_for(lambda: not self.cluster.exists(path), timeout, f"DynamoModel {name} to be deleted")

    def table(self) -> str:
        return self.kubectl("get", "dm").stdout

    def operator_log(self) -> str:
        pods = self.pods("operator")
        return "\n".join(self.cluster.logs(self.namespace, p["metadata"]["name"]) for p in pods)

    # -- the OpenAI API through the router Service ----------------------------------------------
    def router_url(self) -> str:
        host, port = self.endpoint(f"{self.fullname}-router", "http")
        return f"http://{host}:{port}"

    def api_key(self) -> str | None:
        """The inference API key the release's router and workers require (values `auth.apiKey`, with the
        chart's precedence: existingSecret, value, the operator-generated Secret), or None."""
        spec = (self.values.get("auth") or {}).get("apiKey") or {}
        key = spec.get("key") or "api-key"
        if spec.get("existingSecret"):
            return self.secret(spec["existingSecret"])[key]
        if spec.get("value"):
            return str(spec["value"])
        if spec.get("generate"):
            return self.secret(f"{self.fullname}-api-key")[key]
        return None

    def inference_headers(self) -> dict[str, str]:
        """What an OpenAI client of this release sends: `Authorization: Bearer <key>` when it has a key."""
        key = self.api_key()
        return {"Authorization": f"Bearer {key}"} if key else {}

    def complete(self, model: str, prompt: str = "The fleet", max_tokens: int = 8) -> str:
        """Greedy completion text through the router (raises httpx.HTTPStatusError on errors)."""
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        r = httpx.post(f"{self.router_url()}/v1/completions", json=body, headers=self.inference_headers(), timeout=60)
        r.raise_for_status()
        return str(r.json()["choices"][0]["text"])

    def models(self) -> set[str]:
        r = httpx.get(f"{self.router_url()}/v1/models", headers=self.inference_headers(), timeout=30)
        r.raise_for_status()
        return {m["id"] for m in r.json()["data"]}

    def worker_loras(self, pod: JSON) -> set[str]:
        """Adapters a worker pod holds, however they were loaded."""
        pinned, on_demand = self.worker_adapters(pod)
        return pinned | on_demand

    def worker_adapters(self, pod: JSON) -> tuple[set[str], set[str]]:
        """A worker pod's adapters from its management API (with the chart's admin token), as (pinned: loaded
        through ``POST /v1/loras``, the operator's placement; loaded on demand: the worker's LRU cache)."""
        token = self.secret(f"{self.fullname}-admin-token")["token"]
        with self.pod_port(pod, 9090) as base:
            r = httpx.get(f"{base}/v1/loras", headers={"Authorization": f"Bearer {token}"}, timeout=10)
        r.raise_for_status()
        listing = r.json()
        on_demand = {name for name, kept in (listing.get("pinned") or {}).items() if kept is False}
        return set(listing["loras"]) - on_demand, on_demand & set(listing["loras"])

    @contextlib.contextmanager
    def pod_port(self, pod: JSON, port: int) -> Iterator[str]:
        """`http://host:port` reaching a pod's port: its IP locally, a port-forward elsewhere (kind)."""
        if self.cluster.is_local:
            yield f"http://{pod['status']['podIP']}:{port}"
            return
        proc, local_port = self.cluster.port_forward(self.namespace, f"pod/{pod['metadata']['name']}", port)
        try:
            yield f"http://127.0.0.1:{local_port}"
        finally:
            proc.terminate()
            proc.wait()


def manifest(name: str, model_name: str, uri: str, *, replicas: int | None = None) -> str:
    spec: JSON = {"modelName": model_name, "baseModelName": BASE_MODEL, "modelType": "lora", "source": {"uri": uri}}
    if replicas is not None:
        spec["replicas"] = replicas
    return yaml.safe_dump({"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": name}, "spec": spec})
