"""The local control plane: start/stop hygiene, CRD validation through the real apiserver, real GC."""

from __future__ import annotations

import json
import os
import ssl
from pathlib import Path

import httpx
import pytest
from lorafleet_devcluster.cluster import LocalCluster, versions, wait_until
from lorafleet_devcluster.kube import Kube
from lorafleet_devcluster.nodeagent import NodeAgent
from lorafleet_devcluster.session import TestCluster


def _processes_mentioning(text: str) -> list[int]:
    """PIDs of live (non-zombie) processes whose command line contains `text`."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().split(") ", 1)[1][0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(int(proc.name))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_start_stop_leaves_no_process(tmp_path: Path, cluster: TestCluster) -> None:
    """A second cluster (next to the shared one) starts on its own ports and stops without leftovers."""
    local = LocalCluster(tmp_path / "c2").start()
    agent = None
    try:
        assert cluster.local is not None and local.server != cluster.local.server
        assert local.kubectl("get", "--raw", "/readyz").stdout.strip() == "ok"
        shared_ns = cluster.new_namespace("iso")  # separate etcd: invisible in the second cluster
        assert local.kubectl("get", "namespace", shared_ns, check=False).returncode != 0
        agent = NodeAgent(local.credentials(), tmp_path / "node").start()
        ns = "default"
        pod = {
            "metadata": {"name": "sleeper"},
            "spec": {"containers": [{"name": "c", "image": "busybox", "command": ["sleep", "600"]}]},
        }
        with Kube(local.credentials()) as kube:
            kube.post(f"/api/v1/namespaces/{ns}/pods", pod)
            wait_until(
                lambda: kube.get(f"/api/v1/namespaces/{ns}/pods/sleeper")["status"].get("phase") == "Running",
                60,
                "the pod to run",
            )
        pids = [*local.pids.values(), *agent.pids()]
        assert len(pids) == 4 and all(_alive(p) for p in pids)
        assert _processes_mentioning(str(tmp_path))  # etcd, apiserver, controller-manager name the dir
    finally:
        if agent:
            agent.stop()
        local.stop()
    assert not any(_alive(p) for p in pids), "a process survived stop()"
    assert _processes_mentioning(str(tmp_path)) == []
    with pytest.raises(httpx.ConnectError):
        httpx.get(local.server + "/readyz", verify=False, timeout=2)


CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.test.lorafleet.dev"},
    "spec": {
        "group": "test.lorafleet.dev",
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "description": "Desired widget settings.",
                                "x-kubernetes-validations": [
                                    {
                                        "rule": "self.minSize <= self.maxSize",
                                        "message": "minSize must not exceed maxSize",
                                    }
                                ],
                                "properties": {
                                    "minSize": {
                                        "type": "integer",
                                        "description": "Smallest size the widget may shrink to.",
                                    },
                                    "maxSize": {
                                        "type": "integer",
                                        "description": "Largest size the widget may grow to.",
                                    },
                                },
                                "required": ["minSize", "maxSize"],
                            }
                        },
                    }
                },
            }
        ],
    },
}


def test_apiserver_restart_keeps_its_port_and_the_cluster_state(tmp_path: Path) -> None:
    """`LocalCluster.restart` (the soak's API server outage): stopped, down, started with the same flags;
    the same URL and certificates answer again and what was stored in etcd is still there."""
    local = LocalCluster(tmp_path / "c3").start()
    try:
        local.kubectl("create", "namespace", "kept")
        before = local.pids["kube-apiserver"]
        local.restart("kube-apiserver", down=1.0)
        assert local.pids["kube-apiserver"] != before and not _alive(before)
        assert local.kubectl("get", "--raw", "/readyz").stdout.strip() == "ok"  # same port, same kubeconfig
        assert local.kubectl("get", "namespace", "kept", "-o", "name").stdout.strip() == "namespace/kept"
    finally:
        local.stop()


def test_crd_cel_validation_and_explain(cluster: TestCluster) -> None:
    cluster.kubectl("apply", "-f", "-", input=json.dumps(CRD))
    cluster.kubectl("wait", "--for=condition=Established", "crd/widgets.test.lorafleet.dev", "--timeout=60s")
    ns = cluster.new_namespace("crd")

    def widget(name: str, lo: int, hi: int) -> str:
        obj = {"apiVersion": "test.lorafleet.dev/v1", "kind": "Widget", "metadata": {"name": name, "namespace": ns}}
        return json.dumps({**obj, "spec": {"minSize": lo, "maxSize": hi}})

    cluster.kubectl("apply", "-f", "-", input=widget("good", 1, 3))
    bad = cluster.kubectl("apply", "-f", "-", input=widget("bad", 5, 2), check=False)
    assert bad.returncode != 0
    assert "minSize must not exceed maxSize" in bad.stderr
    assert not cluster.exists(f"/apis/test.lorafleet.dev/v1/namespaces/{ns}/widgets/bad")

    def explained() -> str | None:
        out = cluster.kubectl("explain", "widgets.spec.minSize", check=False)
        return out.stdout if "Smallest size the widget may shrink to." in out.stdout else None

    text = wait_until(explained, 60, "kubectl explain to show the CRD field docs", interval=1.0)
    assert "<integer>" in text


def test_owner_references_are_garbage_collected(cluster: TestCluster) -> None:
    ns = cluster.new_namespace("gc")
    owner = cluster.kube.post(f"/api/v1/namespaces/{ns}/configmaps", {"metadata": {"name": "owner"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}
    for i in range(3):
        child = {"metadata": {"name": f"child-{i}", "ownerReferences": [ref]}}
        cluster.kube.post(f"/api/v1/namespaces/{ns}/configmaps", child)
    orphan = cluster.kube.post(f"/api/v1/namespaces/{ns}/configmaps", {"metadata": {"name": "unrelated"}})
    cluster.kube.delete(f"/api/v1/namespaces/{ns}/configmaps/owner")

    def children_gone() -> bool:
        names = {c["metadata"]["name"] for c in cluster.kube.get(f"/api/v1/namespaces/{ns}/configmaps")["items"]}
        return not any(n.startswith("child-") for n in names)

    wait_until(children_gone, 60, "the garbage collector to delete the children")
    assert (
        cluster.kube.get(f"/api/v1/namespaces/{ns}/configmaps/unrelated")["metadata"]["uid"]
        == orphan["metadata"]["uid"]
    )


def test_foreground_deletion_waits_for_children(cluster: TestCluster) -> None:
    """Foreground deletion: the owner stays (foregroundDeletion finalizer) until the GC removed its children."""
    ns = cluster.new_namespace("gcfg")
    owner = cluster.kube.post(f"/api/v1/namespaces/{ns}/configmaps", {"metadata": {"name": "owner"}})
    ref = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "owner",
        "uid": owner["metadata"]["uid"],
        "blockOwnerDeletion": True,
    }
    cluster.kube.post(f"/api/v1/namespaces/{ns}/configmaps", {"metadata": {"name": "child", "ownerReferences": [ref]}})
    cluster.kube.delete(f"/api/v1/namespaces/{ns}/configmaps/owner", {"propagationPolicy": "Foreground"})
    wait_until(lambda: not cluster.exists(f"/api/v1/namespaces/{ns}/configmaps/owner"), 60, "the owner to go")
    assert not cluster.exists(f"/api/v1/namespaces/{ns}/configmaps/child")


def test_admin_only_api_rejects_anonymous(cluster: TestCluster) -> None:
    assert cluster.local is not None
    resp = httpx.get(
        cluster.local.server + "/api/v1/secrets",
        verify=ssl.create_default_context(cafile=str(cluster.local.credentials().ca_file)),
        trust_env=False,
    )
    assert resp.status_code in (401, 403)


def test_kubectl_version_is_stamped(cluster: TestCluster) -> None:
    out = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    want = versions()["KUBERNETES_VERSION"]
    assert out["clientVersion"]["gitVersion"] == want
    assert out["serverVersion"]["gitVersion"] == want
