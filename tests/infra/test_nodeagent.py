"""The test node agent: pods as local processes, driven by the real controllers."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from lorafleet_devcluster import images, podspec
from lorafleet_devcluster.cluster import wait_until
from lorafleet_devcluster.kube import JSON
from lorafleet_devcluster.nodeagent import RENEW_EVERY
from lorafleet_devcluster.session import TestCluster

# A tiny HTTP server run as the container of test Deployments (mounted from a ConfigMap at /app).
SERVER = r"""
import json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse, parse_qs

state = {"ready": True, "alive": True}

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def reply(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        url = urlparse(self.path)
        if url.path == "/ready":
            return self.reply(200 if state["ready"] else 503, {})
        if url.path == "/alive":
            return self.reply(200 if state["alive"] else 500, {})
        if url.path == "/set":
            for k, v in parse_qs(url.query).items():
                state[k] = v[0] == "1"
            return self.reply(200, state)
        keys = ["POD_NAME", "POD_NAMESPACE", "POD_IP", "MY_NODE", "GREETING", "LEVEL", "CFG_MODE", "DATA_DIR",
                "LORAFLEET_MOUNT_APP", "KUBERNETES_SERVICE_HOST", "KUBECONFIG", "EXPANDED"]
        body = {k: os.environ.get(k) for k in keys}
        body["argv"] = sys.argv
        body["data_dir_writable"] = os.access(os.environ["DATA_DIR"], os.W_OK)
        body["secret_file"] = open(sys.argv[2]).read()
        return self.reply(200, body)

ThreadingHTTPServer((os.environ["POD_IP"], 8080), H).serve_forever()
"""


# -- pure parts ----------------------------------------------------------------------------------------------
def test_expand_follows_kubelet_rules() -> None:
    env = {"A": "x", "B": "y"}
    assert podspec.expand("$(A)-$(B)/$(C)", env) == "x-y/$(C)"
    assert podspec.expand("$$(A) costs $$5", env) == "$(A) costs $5"


def test_mount_paths_are_rewritten_as_whole_prefixes() -> None:
    rw = podspec.rewriter({"/data": "/tmp/p/data", "/data/cache": "/tmp/p/cache"})
    assert rw("--dir=/data/x") == "--dir=/tmp/p/data/x"
    assert rw("/data/cache/y") == "/tmp/p/cache/y"  # longest mount wins
    assert rw("/database /mydata /data") == "/database /mydata /tmp/p/data"
    env = podspec.mount_env({"/var/cache/lora": "/h/c"})
    assert env["LORAFLEET_MOUNT_VAR_CACHE_LORA"] == "/h/c"
    assert json.loads(env["LORAFLEET_MOUNTS"]) == {"/var/cache/lora": "/h/c"}


def test_volume_items_cannot_escape(tmp_path: Path) -> None:
    with pytest.raises(podspec.ConfigError):
        podspec._write_items(tmp_path, {"k": b"v"}, [{"key": "k", "path": "../../etc/x"}], None)


def test_image_table() -> None:
    assert images.repository("ghcr.io/acme/lorafleet/worker:1.2@sha256:abc") == "ghcr.io/acme/lorafleet/worker"
    assert images.repository("localhost:5000/lorafleet-operator") == "localhost:5000/lorafleet-operator"
    worker = images.resolve("ghcr.io/x/lorafleet/worker:dev", ["/usr/local/bin/lorafleet-worker"], ["serve"])
    assert worker == [str(images.venv_bin() / "lorafleet-worker"), "serve"]
    assert images.resolve("lorafleet/operator:dev", None, None) == [str(images.venv_bin() / "lorafleet-operator")]
    assert images.resolve("busybox:1.36", ["sh", "-c", "true"], None)[1:] == ["-c", "true"]
    with pytest.raises(images.ImageError, match="no local command mapping"):
        images.resolve("nginx:latest", None, None)
    with pytest.raises(images.ImageError, match="not found locally"):
        images.resolve("lorafleet/worker:dev", ["no-such-program"], None)


# -- helpers ----------------------------------------------------------------------------------------------
def _pods(cluster: TestCluster, ns: str, selector: str) -> list[JSON]:
    return list(cluster.get(f"/api/v1/namespaces/{ns}/pods", labelSelector=selector)["items"])


def _ready(pod: JSON) -> bool:
    conds = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def _http(ip: str, path: str, port: int = 8080) -> Any:
    with urllib.request.urlopen(f"http://{ip}:{port}{path}", timeout=5) as resp:
        return json.loads(resp.read())


def _reachable(ip: str) -> bool:
    try:
        _http(ip, "/ready")
    except (urllib.error.URLError, OSError):
        return False
    return True


def _apply(cluster: TestCluster, *objs: JSON) -> None:
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objs)}))


def _deployment(ns: str) -> list[JSON]:
    probe = {"periodSeconds": 1, "timeoutSeconds": 2}
    container = {
        "name": "web",
        "image": "python:3.11-slim",
        "command": ["python", "/app/server.py"],
        "args": ["--data=$(DATA_DIR)", "/etc/greeting/greeting"],
        "ports": [{"name": "http", "containerPort": 8080}],
        "env": [
            {"name": "MY_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "GREETING", "valueFrom": {"secretKeyRef": {"name": "web", "key": "greeting"}}},
            {"name": "LEVEL", "valueFrom": {"configMapKeyRef": {"name": "web-env", "key": "level"}}},
            {"name": "DATA_DIR", "value": "/data/files"},
            {"name": "EXPANDED", "value": "$(POD_NAME)@$(MY_NODE)"},
        ],
        "envFrom": [{"configMapRef": {"name": "web-env"}, "prefix": "CFG_"}],
        "volumeMounts": [
            {"name": "app", "mountPath": "/app"},
            {"name": "data", "mountPath": "/data"},
            {"name": "greeting", "mountPath": "/etc/greeting", "readOnly": True},
        ],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "failureThreshold": 1, **probe},
        "livenessProbe": {
            "httpGet": {"path": "/alive", "port": 8080},
            "initialDelaySeconds": 3,
            "failureThreshold": 3,
            **probe,
        },
    }
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "web-app", "namespace": ns},
            "data": {"server.py": SERVER},
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "web-env", "namespace": ns},
            "data": {"level": "3", "MODE": "fast"},
        },
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "web", "namespace": ns},
            "stringData": {"greeting": "hi"},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "web", "namespace": ns},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {"app": "web"}},
                "template": {
                    "metadata": {"labels": {"app": "web"}},
                    "spec": {
                        "terminationGracePeriodSeconds": 5,
                        "containers": [container],
                        "volumes": [
                            {"name": "app", "configMap": {"name": "web-app"}},
                            {"name": "data", "emptyDir": {}},
                            {"name": "greeting", "secret": {"secretName": "web"}},
                        ],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web", "namespace": ns},
            "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]},
        },
    ]


def _scale(cluster: TestCluster, ns: str, replicas: int) -> list[JSON]:
    """Scale the web Deployment and wait until exactly `replicas` pods run, all Ready, with processes."""
    cluster.kubectl("-n", ns, "scale", "deployment/web", f"--replicas={replicas}")
    assert cluster.agent is not None

    def settled() -> list[JSON] | None:
        pods = _pods(cluster, ns, "app=web")
        dep = cluster.get(f"/apis/apps/v1/namespaces/{ns}/deployments/web")
        ok = (
            len(pods) == replicas
            and all(_ready(p) for p in pods)
            and dep["status"].get("availableReplicas") == replicas
            and len(cluster.agent.pids(ns)) == replicas  # type: ignore[union-attr]
        )
        return pods if ok else None

    result: list[JSON] = wait_until(settled, 120, f"{replicas} ready web pods", interval=0.3)
    return result


# -- behaviour ----------------------------------------------------------------------------------------------
def test_node_is_ready_untainted_with_a_renewed_lease(cluster: TestCluster) -> None:
    assert cluster.agent is not None
    name = cluster.agent.node_name
    node = cluster.get(f"/api/v1/nodes/{name}")
    assert {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"] == "True"
    assert int(node["status"]["allocatable"]["pods"]) > 0
    wait_until(lambda: not cluster.get(f"/api/v1/nodes/{name}")["spec"].get("taints"), 60, "no taints")
    lease_path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}"
    first = cluster.get(lease_path)["spec"]
    assert first["holderIdentity"] == name
    wait_until(lambda: cluster.get(lease_path)["spec"]["renewTime"] != first["renewTime"], 30, "a lease renewal")


def test_the_heartbeat_outlives_an_api_server_outage(cluster: TestCluster) -> None:
    """The node lease is renewed again after kube-apiserver was down for longer than a renewal period
    (the soak found the heartbeat thread dead of a refused connection: 40 s later the node went NotReady
    and every pod on it unready, as if the node had been lost)."""
    assert cluster.agent is not None and cluster.local is not None
    lease_path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{cluster.agent.node_name}"
    cluster.local.restart("kube-apiserver", down=RENEW_EVERY + 2)  # at least one renewal meets the outage
    back = cluster.get(lease_path)["spec"]["renewTime"]
    assert cluster.agent.alive
    wait_until(lambda: cluster.get(lease_path)["spec"]["renewTime"] != back, 2 * RENEW_EVERY + 5, "a renewal after")


def test_deployment_scales_and_readiness_follows_the_probe(cluster: TestCluster) -> None:
    ns = cluster.new_namespace("web")
    _apply(cluster, *_deployment(ns))
    [pod] = _scale(cluster, ns, 1)
    ip = pod["status"]["podIP"]
    body = _http(ip, "/")
    name = pod["metadata"]["name"]
    assert body["POD_NAME"] == name and body["POD_NAMESPACE"] == ns and body["POD_IP"] == ip
    assert body["MY_NODE"] == cluster.agent.node_name  # type: ignore[union-attr]
    assert body["GREETING"] == "hi" and body["LEVEL"] == "3" and body["CFG_MODE"] == "fast"
    assert body["EXPANDED"] == f"{name}@{body['MY_NODE']}"
    assert body["secret_file"] == "hi"  # /etc/greeting/greeting rewritten into the pod's secret volume
    assert body["DATA_DIR"].endswith("/volumes/data/files") and body["argv"][1] == f"--data={body['DATA_DIR']}"
    assert body["LORAFLEET_MOUNT_APP"] == str(Path(body["argv"][0]).parent)
    assert cluster.service_endpoint(ns, "web", 80) == (ip, 8080)

    pods = _scale(cluster, ns, 3)
    ips = {p["status"]["podIP"] for p in pods}
    assert len(ips) == 3 and all(ip.startswith("127.") for ip in ips)
    assert {_http(p["status"]["podIP"], "/")["POD_NAME"] for p in pods} == {p["metadata"]["name"] for p in pods}

    # Readiness follows the probe: the pod leaves the Service's endpoints and comes back.
    victim = pods[0]
    vip, vname = victim["status"]["podIP"], victim["metadata"]["name"]
    _http(vip, "/set?ready=0")

    def endpoint_ready(ip: str) -> bool:
        return (ip, 8080) in cluster.service_endpoints(ns, "web", "http")

    wait_until(lambda: not _ready(cluster.get(f"/api/v1/namespaces/{ns}/pods/{vname}")), 30, "pod NotReady")
    wait_until(lambda: endpoint_ready(vip) is False, 30, "endpoint not ready")
    _http(vip, "/set?ready=1")
    wait_until(lambda: _ready(cluster.get(f"/api/v1/namespaces/{ns}/pods/{vname}")), 30, "pod Ready again")
    wait_until(lambda: endpoint_ready(vip) is True, 30, "endpoint ready again")

    survivors = {p["metadata"]["name"] for p in _scale(cluster, ns, 1)}
    gone = [p["status"]["podIP"] for p in pods if p["metadata"]["name"] not in survivors]
    assert len(gone) == 2 and not any(_reachable(ip) for ip in gone)

    # Liveness failure restarts the container (restartCount counts it) and the pod recovers.
    [pod] = _pods(cluster, ns, "app=web")
    before = pod["status"]["containerStatuses"][0]["restartCount"]
    _http(pod["status"]["podIP"], "/set?alive=0")

    def restarted() -> bool:
        p = cluster.get(f"/api/v1/namespaces/{ns}/pods/{pod['metadata']['name']}")
        status = p["status"]["containerStatuses"][0]
        return status["restartCount"] == before + 1 and bool(status["lastState"].get("terminated")) and _ready(p)

    wait_until(restarted, 60, "a liveness restart")
    assert _http(pod["status"]["podIP"], "/ready") == {}
    cluster.kubectl("delete", "namespace", ns, "--wait=false")


def test_a_held_container_stays_down_then_comes_back_in_its_pod(cluster: TestCluster) -> None:
    """`NodeAgent.hold` (the soak's MinIO outage): the container is killed, not restarted before the hold
    ends, then restarted in the same pod, on the same IP, with its emptyDir volume's files."""
    assert cluster.agent is not None
    ns = cluster.new_namespace("hold")
    _apply(cluster, *_deployment(ns))
    [pod] = _scale(cluster, ns, 1)
    name, ip = pod["metadata"]["name"], pod["status"]["podIP"]
    marker = Path(_http(ip, "/")["DATA_DIR"]).parent / "kept"
    marker.write_text("data")
    before = pod["status"]["containerStatuses"][0]["restartCount"]
    held_at = time.monotonic()
    cluster.agent.hold(ns, name, 6.0)
    wait_until(lambda: not _reachable(ip), 30, "the held container to die")
    wait_until(lambda: _reachable(ip), 60, "the container to come back after its hold")
    assert time.monotonic() - held_at >= 6.0  # not restarted (backoff: 1 s) before the hold ended
    after = cluster.get(f"/api/v1/namespaces/{ns}/pods/{name}")
    wait_until(
        lambda: (
            cluster.get(f"/api/v1/namespaces/{ns}/pods/{name}")["status"]["containerStatuses"][0]["restartCount"]
            == before + 1
        ),
        30,
        "the restart counted",
    )
    assert after["metadata"]["uid"] == pod["metadata"]["uid"] and _http(ip, "/")["POD_IP"] == ip
    assert marker.read_text() == "data"
    cluster.kubectl("delete", "namespace", ns, "--wait=false")


def _job(ns: str, name: str, script: str, *, backoff: int = 0, policy: str = "Never", **spec: Any) -> JSON:
    container = {
        "name": "main",
        "image": "busybox:1.36",
        "command": ["sh", "-c", script],
        "volumeMounts": [{"name": "work", "mountPath": "/work"}],
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "backoffLimit": backoff,
            "template": {
                "spec": {
                    "restartPolicy": policy,
                    "containers": [container],
                    "volumes": [{"name": "work", "emptyDir": {}}],
                    **spec,
                }
            },
        },
    }


def _job_condition(cluster: TestCluster, ns: str, name: str) -> JSON | None:
    job = cluster.get(f"/apis/batch/v1/namespaces/{ns}/jobs/{name}")
    for c in job.get("status", {}).get("conditions", []):
        if c["type"] in ("Complete", "Failed") and c["status"] == "True":
            return {"condition": c, "status": job["status"]}
    return None


def test_jobs_succeed_and_fail_with_real_job_controller_status(cluster: TestCluster) -> None:
    ns = cluster.new_namespace("jobs")
    _apply(
        cluster,
        _job(ns, "ok", "echo hello from $POD_NAME"),
        _job(ns, "bad", "echo failing; exit 3", backoff=1),
        _job(
            ns,
            "retry",
            "if [ -f /work/seen ]; then echo second; exit 0; fi; touch /work/seen; exit 1",
            policy="OnFailure",
            backoff=3,
        ),
    )
    ok = wait_until(lambda: _job_condition(cluster, ns, "ok"), 90, "job ok to finish")
    assert ok["condition"]["type"] == "Complete" and ok["status"]["succeeded"] == 1
    [pod] = _pods(cluster, ns, "job-name=ok")
    assert pod["status"]["phase"] == "Succeeded"
    assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    assert f"hello from {pod['metadata']['name']}" in cluster.logs(ns, pod["metadata"]["name"])

    retry = wait_until(lambda: _job_condition(cluster, ns, "retry"), 90, "job retry to finish")
    assert retry["condition"]["type"] == "Complete"
    [pod] = _pods(cluster, ns, "job-name=retry")
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 1  # OnFailure: restarted in place, emptyDir kept

    bad = wait_until(lambda: _job_condition(cluster, ns, "bad"), 120, "job bad to fail")
    assert bad["condition"]["type"] == "Failed" and bad["condition"]["reason"] == "BackoffLimitExceeded"
    assert bad["status"]["failed"] == 2
    pods = _pods(cluster, ns, "job-name=bad")
    codes = [p["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] for p in pods]
    assert codes == [3] * len(codes) and all(p["status"]["phase"] == "Failed" for p in pods)
    cluster.kubectl("delete", "namespace", ns, "--wait=false")


IDENTITY = """
import os
from kubernetes import client, config
config.load_kube_config()
review = client.AuthenticationV1Api().create_self_subject_review(client.V1SelfSubjectReview())
print("user=" + review.status.user_info.username)
ns = os.environ["POD_NAMESPACE"]
for what, call in (("configmaps", client.CoreV1Api().list_namespaced_config_map),
                   ("secrets", client.CoreV1Api().list_namespaced_secret)):
    try:
        call(ns)
        print(what + "=allowed")
    except client.ApiException as exc:
        print(what + "=" + str(exc.status))
"""


def test_pods_act_as_their_service_account_and_rbac_applies(cluster: TestCluster) -> None:
    ns = cluster.new_namespace("rbac")
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "cm-reader", "namespace": ns},
        "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list"]}],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "runner-cm", "namespace": ns},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "cm-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "runner", "namespace": ns}],
    }
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "runner", "namespace": ns}}
    job = _job(ns, "whoami", "", serviceAccountName="runner")
    job["spec"]["template"]["spec"]["containers"][0].update(image="python:3.11", command=["python", "-c", IDENTITY])
    _apply(cluster, sa, role, binding, job)
    done = wait_until(lambda: _job_condition(cluster, ns, "whoami"), 120, "the identity job")
    [pod] = _pods(cluster, ns, "job-name=whoami")
    out = cluster.logs(ns, pod["metadata"]["name"])
    assert done["condition"]["type"] == "Complete", out
    assert f"user=system:serviceaccount:{ns}:runner" in out
    assert "configmaps=allowed" in out and "secrets=403" in out
    cluster.kubectl("delete", "namespace", ns, "--wait=false")


def test_deletion_escalates_to_sigkill_and_unknown_images_wait(cluster: TestCluster) -> None:
    ns = cluster.new_namespace("del")
    stubborn = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "stubborn", "namespace": ns},
        "spec": {
            "terminationGracePeriodSeconds": 2,
            "containers": [
                {"name": "c", "image": "busybox", "command": ["sh", "-c", "trap '' TERM; echo up; sleep 600"]}
            ],
        },
    }
    unknown = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "unknown", "namespace": ns},
        "spec": {"containers": [{"name": "c", "image": "nginx:1.27"}]},
    }
    _apply(cluster, stubborn, unknown)

    def running_pid() -> int | None:
        st = cluster.get(f"/api/v1/namespaces/{ns}/pods/stubborn")["status"]
        cs = st.get("containerStatuses") or [{}]
        return (
            int(cs[0]["containerID"].split("//")[1])
            if st.get("phase") == "Running" and "up" in cluster.logs(ns, "stubborn")
            else None
        )

    pid = wait_until(running_pid, 60, "the stubborn pod to run")
    cluster.kube.delete(f"/api/v1/namespaces/{ns}/pods/stubborn")
    wait_until(lambda: not cluster.exists(f"/api/v1/namespaces/{ns}/pods/stubborn"), 30, "the pod to be deleted")
    assert not os.path.exists(f"/proc/{pid}") or Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"

    def waiting_reason() -> str | None:
        cs = cluster.get(f"/api/v1/namespaces/{ns}/pods/unknown")["status"].get("containerStatuses") or [{}]
        return cs[0].get("state", {}).get("waiting", {}).get("reason")

    assert wait_until(lambda: waiting_reason() == "ErrImagePull", 30, "ErrImagePull")
    msg = cluster.get(f"/api/v1/namespaces/{ns}/pods/unknown")["status"]["containerStatuses"][0]["state"]["waiting"][
        "message"
    ]
    assert "nginx:1.27" in msg
    cluster.kubectl("delete", "namespace", ns, "--wait=false")


def _shell_pod(ns: str, name: str, *, main: str, init: str | None = None) -> JSON:
    """A busybox pod whose container `main` (and init container `a-init`) runs a shell script."""
    shell = {"image": "busybox:1.36"}
    spec: JSON = {"containers": [{**shell, "name": "main", "command": ["sh", "-c", main]}]}
    if init is not None:
        spec["initContainers"] = [{**shell, "name": "a-init", "command": ["sh", "-c", init]}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns}, "spec": spec}


def test_logs_default_to_the_app_container_not_the_init_container(cluster: TestCluster) -> None:
    """As `kubectl logs` does: the soak's not-Ready diagnostics read a worker's log this way."""
    ns = cluster.new_namespace("logs")
    _apply(cluster, _shell_pod(ns, "two", main="echo said by main; sleep 600", init="echo said by init"))

    def main_said() -> str | None:
        text = cluster.logs(ns, "two")
        return text if "said by main" in text else None

    out = wait_until(main_said, 90, "the main container's output")
    assert "said by init" not in out
    assert "said by init" in cluster.logs(ns, "two", "a-init")
    cluster.kubectl("delete", "namespace", ns, "--wait=false")


def test_a_pod_report_names_what_a_pod_waits_on(cluster: TestCluster) -> None:
    """A failed rollout's message (Release.apply_values) says which pod is not ready and why."""
    ns = cluster.new_namespace("report")
    _apply(cluster, _shell_pod(ns, "dies", main="echo cannot open config; exit 3"))

    def restarted() -> str | None:
        report = cluster.pod_report(ns)
        return report if "last exit 3" in report else None

    report = wait_until(restarted, 90, "the container's first exit in the report")
    assert "pod dies: " in report and "container main: " in report
    assert "| cannot open config" in report
    cluster.kubectl("delete", "namespace", ns, "--wait=false")
    assert "every pod in" in cluster.pod_report(cluster.new_namespace("empty"))
