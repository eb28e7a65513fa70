"""lorafleet installed from plain manifests (not the chart) on a dev cluster: the operator e2e tests and the
operator benchmark build their stack from these: worker and operator Deployments, RBAC with the chart's
rules (rendered by helm: the chart's `_rbac.tpl` is the one list), the DynamoModel CRD, and `RawStack`,
which applies objects and checks HRW convergence and the router.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx
import yaml
from lorafleet_operator import api
from lorafleet_operator.placement import place

from lorafleet_devcluster.cluster import wait_until
from lorafleet_devcluster.helm import chart_rules
from lorafleet_devcluster.paths import REPO_ROOT
from lorafleet_devcluster.session import TestCluster

CRD = REPO_ROOT / "crds" / "dynamomodel.yaml"
BASE = "tiny-llama"
BUCKET = "loras"
PROMPT = [1, 5, 9, 13, 17, 21]
READY_S = 600  # a worker pod imports torch and loads the model: slow on a busy 2-core machine


def install_crd(cluster: TestCluster) -> None:
    """Apply the DynamoModel CRD (server-side) and wait until it is Established."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    # Polled rather than `kubectl wait`: that errors out ("status.conditions accessor error") when it
    # reads the CRD before the API server has written any condition, instead of waiting.
    path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{api.CRD_NAME}"

    def established() -> bool:
        conditions = (cluster.get(path).get("status") or {}).get("conditions") or []
        return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)

    wait_until(established, 60, "the DynamoModel CRD to be Established")


def pod_ready(pod: dict) -> bool:
    """The pod's Ready condition is True."""
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))


def env_var(name: str, value: str | None = None, secret: str | None = None, field_path: str | None = None) -> dict:
    if secret:
        return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": name}}}
    if field_path:
        return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}
    return {"name": name, "value": value}


def deployment(
    name: str,
    image: str,
    command: list[str],
    *,
    sa: str | None = None,
    replicas: int = 1,
    labels: dict[str, str] | None = None,
    env: list[dict] | None = None,
    probe: dict | None = None,
    volumes: bool = False,
) -> dict:
    pod_labels = {"app": name, **(labels or {})}
    container: dict[str, Any] = {
        "name": name,
        "image": image,
        "command": command,
        "env": [env_var("POD_IP", field_path="status.podIP"), *(env or [])],
    }
    if probe:
        container["readinessProbe"] = probe
    spec: dict[str, Any] = {"containers": [container], "terminationGracePeriodSeconds": 5}
    if sa:
        spec["serviceAccountName"] = sa
    if volumes:
        container["volumeMounts"] = [{"name": "cache", "mountPath": "/var/cache/lora"}]
        spec["volumes"] = [{"name": "cache", "emptyDir": {}}]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "strategy": {"type": "Recreate"} if name == "operator" else {"type": "RollingUpdate"},
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": pod_labels}, "spec": spec},
        },
    }


def worker_deployment(
    model_dir: str, base_model: str, labels: dict[str, str], extra_args: list[str], env: list[dict], replicas: int = 3
) -> dict:
    """The Deployment `workers`: `lorafleet-worker serve` on the pod's IP (inference 8000, management 9090),
    LoRA rank <= 16 and 4 slots, an emptyDir adapter cache, Ready when `/ready` answers."""
    command = ["lorafleet-worker", "serve", "--model", model_dir, "--served-model-name", base_model,
               "--host", "$(POD_IP)", "--port", "8000", "--system-port", "9090",
               "--max-lora-rank", "16", "--max-loras", "4", *extra_args]  # fmt: skip
    return deployment(
        "workers",
        "lorafleet/worker:dev",
        command,
        replicas=replicas,
        labels=labels,
        volumes=True,
        env=[env_var("DYN_LORA_PATH", "/var/cache/lora"), *env],
        probe={"httpGet": {"path": "/ready", "port": 9090}, "periodSeconds": 1},
    )


def rbac(name: str, *roles: str) -> list[dict]:
    """ServiceAccount, Role and RoleBinding `name` (in the namespace they are applied to) granting what the
    chart grants its Roles `roles` ("operator", "operator-leader", "router"; see `helm.chart_rules`)."""
    rules = chart_rules(*roles)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": name}, "rules": rules},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name}],
        },
    ]


@dataclass
class RawStack:
    """lorafleet's pods in namespace `ns` of a dev cluster: kubectl helpers, readiness, HRW convergence, router."""

    cluster: TestCluster
    ns: str
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=60), kw_only=True)

    # -- kubectl helpers ----------------------------------------------------------------------
    def apply(self, *docs: dict) -> None:
        self.cluster.kubectl("apply", "-n", self.ns, "-f", "-", input=yaml.safe_dump_all(docs))

    def dm_doc(self, name: str, model_name: str, uri: str, **spec: Any) -> dict:
        return {
            "apiVersion": api.API_VERSION,
            "kind": api.KIND,
            "metadata": {"name": name, "labels": spec.pop("labels", {})},
            "spec": {
                "modelName": model_name,
                "baseModelName": BASE,
                "modelType": "lora",
                "source": {"uri": uri},
                **spec,
            },
        }

    def dms(self, selector: str | None = None) -> dict[str, dict]:
        params = {"labelSelector": selector} if selector else {}
        items = self.cluster.get(api.models_path(self.ns), **params)["items"]
        return {i["metadata"]["name"]: i for i in items}

    def dm(self, name: str) -> dict:
        return self.cluster.get(api.model_path(self.ns, name))

    def pods(self, app: str) -> list[dict]:
        return self.cluster.get(f"/api/v1/namespaces/{self.ns}/pods", labelSelector=f"app={app}")["items"]

    def ready_workers(self) -> dict[str, str]:
        """name -> pod IP of the Ready, not terminating worker pods."""
        out = {}
        for p in self.pods("workers"):
            st = p.get("status", {})
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions", []))
            if ready and st.get("podIP") and not p["metadata"].get("deletionTimestamp"):
                out[p["metadata"]["name"]] = st["podIP"]
        return out

    def scale(self, replicas: int) -> dict[str, str]:
        self.cluster.kubectl("scale", "-n", self.ns, "deployment/workers", f"--replicas={replicas}")
        return wait_until(
            lambda: (w := self.ready_workers()) and len(w) == replicas and len(self.pods("workers")) == replicas and w,
            READY_S,
            f"{replicas} Ready workers",
        )

    def loras(self, ip: str) -> set[str]:
        return set(self.http.get(f"http://{ip}:9090/v1/loras").json()["loras"])

    def loads(self) -> float:
        """Successful adapter loads summed over the Ready workers (`lorafleet_lora_loads_total`)."""
        total = 0.0
        for ip in self.ready_workers().values():
            for line in self.http.get(f"http://{ip}:9090/metrics").text.splitlines():
                if line.startswith("lorafleet_lora_loads_total") and 'outcome="success"' in line:
                    total += float(line.rsplit(" ", 1)[1])
        return total

    # -- expectations ---------------------------------------------------------------------------
    def converged(self, names: list[str] | None = None) -> bool:
        """Every (given) LoRA model is Ready on exactly its HRW placement over the Ready workers."""
        workers = self.ready_workers()
        held = {name: self.loras(ip) for name, ip in workers.items()}
        for obj in self.dms().values():
            if (names is not None and obj["metadata"]["name"] not in names) or obj["spec"]["modelType"] != "lora":
                continue
            st = obj.get("status") or {}
            if st.get("phase") == "Failed":
                continue
            want = place(obj["spec"]["modelName"], workers, obj["spec"].get("replicas") or 2)
            if st.get("phase") != "Ready" or st.get("placement") != want or st.get("readyEndpoints") != len(want):
                return False
            if {p for p, names_ in held.items() if obj["spec"]["modelName"] in names_} != set(want):
                return False
        return True

    def wait_converged(self, names: list[str] | None = None, timeout: float = 300) -> None:
        wait_until(lambda: self.converged(names), timeout, f"models {names or 'all'} converged on HRW placements")

    # -- router ---------------------------------------------------------------------------------
    @property
    def router(self) -> str:
        ip = wait_until(
            lambda: next((p["status"].get("podIP") for p in self.pods("router") if p["status"].get("podIP")), None),
            120,
            "router pod IP",
        )
        return f"http://{ip}:8000"

    def complete(self, model: str, **kw: Any) -> httpx.Response:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **kw}
        return self.http.post(f"{self.router}/v1/completions", json=body)

    def text(self, model: str) -> str:
        r = self.complete(model)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["text"])
