"""The node agent's container mode (`LORAFLEET_NODE_RUNTIME=podman`, run by `make e2e-images`): a pod of the
built operator image runs in podman with the pod's env, volumes as bind mounts, its securityContext and
limits, on its own loopback address, acting as its ServiceAccount; deleting it leaves no container."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import httpx
import pytest
from lorafleet_devcluster import podman
from lorafleet_devcluster.cluster import wait_until
from lorafleet_devcluster.session import TestCluster

IMAGE = "lorafleet/operator:dev"

# Runs inside the container: reports what it sees, then serves it on $POD_IP:8080.
PROGRAM = r"""
import json, os, pathlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

def can_write(path):
    try:
        pathlib.Path(path, "probe").write_text("x")
        return True
    except OSError:
        return False

from kubernetes import client, config
config.load_kube_config()
review = client.AuthenticationV1Api().create_self_subject_review({"apiVersion": "authentication.k8s.io/v1",
                                                                  "kind": "SelfSubjectReview"})
report = {
    "uid": os.getuid(), "gid": os.getgid(), "pod_ip": os.environ["POD_IP"], "secret": os.environ["FROM_SECRET"],
    "config": pathlib.Path("/etc/app/greeting").read_text(), "tmp_writable": can_write("/tmp"),
    "root_writable": can_write("/opt"), "config_writable": can_write("/etc/app"),
    "user": review.status.user_info.username,
    "no_new_privs": pathlib.Path("/proc/self/status").read_text().split("NoNewPrivs:")[1].split()[0],
    "cap_eff": pathlib.Path("/proc/self/status").read_text().split("CapEff:")[1].split()[0],
    "memory_limit": next((pathlib.Path(p).read_text().strip() for p in
                          ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
                          if pathlib.Path(p).exists()), None),
}

class H(BaseHTTPRequestHandler):
    def do_GET(self):
        data = json.dumps(report).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

ThreadingHTTPServer((os.environ["POD_IP"], 8080), H).serve_forever()
"""

pytestmark = pytest.mark.skipif(
    not podman.enabled(), reason="container mode: run by `make e2e-images` (LORAFLEET_NODE_RUNTIME=podman)"
)


def podman_names() -> set[str]:
    done = subprocess.run(
        [podman.podman(), "ps", "-a", "--format", "{{.Names}}"],
        env=podman.podman_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    return set(done.stdout.split())


def test_pod_runs_from_its_image_with_volumes_security_and_identity(cluster: TestCluster) -> None:
    ns = cluster.new_namespace("podman")
    docs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "app"}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}, "stringData": {"token": "s3cret"}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"greeting": "hello"}},
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "app"},
            "spec": {
                "serviceAccountName": "app",
                "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001},
                "terminationGracePeriodSeconds": 5,
                "containers": [
                    {
                        "name": "app",
                        "image": IMAGE,
                        "command": ["python", "-c", PROGRAM],
                        "env": [
                            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                            {"name": "FROM_SECRET", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}},
                        ],
                        "readinessProbe": {"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 1},
                        "resources": {"limits": {"cpu": "500m", "memory": "256Mi"}},
                        "securityContext": {
                            "readOnlyRootFilesystem": True,
                            "allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]},
                        },
                        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, {"name": "c", "mountPath": "/etc/app"}],
                    }
                ],
                "volumes": [{"name": "tmp", "emptyDir": {}}, {"name": "c", "configMap": {"name": "c"}}],
            },
        },
    ]
    cluster.kubectl("apply", "-n", ns, "-f", "-", input="\n---\n".join(json.dumps(d) for d in docs))
    pod = wait_until(
        lambda: (
            (p := cluster.get(f"/api/v1/namespaces/{ns}/pods/app"))
            and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
            and p
        ),
        180,
        "the podman pod to be Ready",
    )
    container_id = pod["status"]["containerStatuses"][0]["containerID"]
    assert container_id.startswith("podman://"), container_id
    name = container_id.removeprefix("podman://")
    assert name in podman_names()
    ip = pod["status"]["podIP"]
    report = httpx.get(f"http://{ip}:8080/", timeout=10, trust_env=False).json()
    assert (report["uid"], report["gid"], report["pod_ip"]) == (10001, 10001, ip)
    assert (report["secret"], report["config"]) == ("s3cret", "hello")
    assert report["tmp_writable"] and not report["root_writable"] and not report["config_writable"]
    assert report["user"] == f"system:serviceaccount:{ns}:app"
    assert report["no_new_privs"] == "1" and int(report["cap_eff"], 16) == 0
    assert report["memory_limit"] == str(256 * 2**20)
    assert "s3cret" not in cluster.logs(ns, "app")  # env goes in through a file, not the logged command line

    cluster.kubectl("delete", "pod", "app", "-n", ns, "--wait=true", "--timeout=60s")
    wait_until(lambda: name not in podman_names(), 30, "the container to be removed")


def test_missing_image_waits_with_err_image_pull(cluster: TestCluster) -> None:
    ns = cluster.new_namespace("podman-missing")
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "nope"},
        "spec": {"containers": [{"name": "c", "image": "lorafleet/operator:no-such-tag"}]},
    }
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(pod))
    waiting = wait_until(
        lambda: (
            cluster.get(f"/api/v1/namespaces/{ns}/pods/nope")["status"]
            .get("containerStatuses", [{}])[0]
            .get("state", {})
            .get("waiting")
        ),
        60,
        "a waiting state",
    )
    assert waiting["reason"] == "ErrImagePull" and "make images" in waiting["message"]
