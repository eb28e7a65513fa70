"""The cluster object the pytest fixtures hand to tests (local control plane or an existing cluster).

`shared_cluster()` starts one local control plane + node agent per test session
(reference-counted, so the e2e and infra fixtures share it). With
`LORAFLEET_E2E_CLUSTER=kubeconfig` it uses the current kubeconfig instead
(`KUBECONFIG` or `~/.kube/config`, e.g. a kind cluster) and starts nothing.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes

from lorafleet_devcluster.cluster import LocalCluster, run_tool, tool_path, wait_until
from lorafleet_devcluster.kube import JSON, Kube, KubeError, load_kubeconfig
from lorafleet_devcluster.nodeagent import NodeAgent


def _target_port(pod: JSON, target: int | str) -> int | None:
    if isinstance(target, int):
        return target
    for c in pod["spec"]["containers"]:
        for p in c.get("ports") or []:
            if p.get("name") == target:
                return int(p["containerPort"])
    return None


def service_endpoints(kube: Kube, namespace: str, name: str, port: int | str) -> list[tuple[str, int]]:
    """Every ready (pod IP, target port) behind Service `name`'s port `port` (number or name), sorted.

    There is no kube-proxy, so ClusterIPs lead nowhere. And the API server refuses
    loopback addresses in EndpointSlices/Endpoints (127.0.0.0/8 is invalid there), so
    the endpointslice controller cannot publish our pod IPs: this applies its rule
    itself: pods matching the selector, Ready (or `publishNotReadyAddresses`), not
    terminating, with a pod IP; named target ports resolved from the container ports.
    """
    svc = kube.get(f"/api/v1/namespaces/{namespace}/services/{name}")
    spec = svc["spec"]
    svc_port = next((p for p in spec["ports"] if port in (p.get("port"), p.get("name"))), None)
    if svc_port is None:
        raise LookupError(f"service {namespace}/{name} has no port {port!r}")
    selector = ",".join(f"{k}={v}" for k, v in (spec.get("selector") or {}).items())
    if not selector:
        raise LookupError(f"service {namespace}/{name} has no selector")
    pods = kube.get(f"/api/v1/namespaces/{namespace}/pods", labelSelector=selector)["items"]
    out = []
    for pod in pods:
        status = pod.get("status", {})
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", []))
        if not status.get("podIP") or pod["metadata"].get("deletionTimestamp"):
            continue
        if not (ready or spec.get("publishNotReadyAddresses")):
            continue
        target = _target_port(pod, svc_port.get("targetPort", svc_port["port"]))
        if target is not None:
            out.append((str(status["podIP"]), target))
    return sorted(out)


def service_endpoint(kube: Kube, namespace: str, name: str, port: int | str) -> tuple[str, int]:
    """One ready (pod IP, target port) of the Service (see `service_endpoints`); LookupError if none."""
    found = service_endpoints(kube, namespace, name, port)
    if not found:
        raise LookupError(f"service {namespace}/{name} port {port!r} has no ready endpoint")
    return found[0]


class TestCluster:
    """What tests get: kubeconfig, `kubectl()`, `helm()`, a kubernetes client, a JSON client, helpers."""

    __test__ = False  # not a pytest test class

    def __init__(self, kubeconfig: Path, *, local: LocalCluster | None = None, agent: NodeAgent | None = None) -> None:
        self.kubeconfig = kubeconfig
        self.local = local
        self.agent = agent
        self.kube = Kube(local.credentials()) if local else Kube(load_kubeconfig(kubeconfig))
        self.client: kubernetes.client.ApiClient = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        self._forwards: list[subprocess.Popen[str]] = []

    @property
    def is_local(self) -> bool:
        return self.local is not None

    @property
    def test_server_host(self) -> str:
        """The address a test's own servers (e.g. the Hub stand-in) listen on so that pods reach them:
        loopback locally (pods share the host's network); on kind, the kind network's gateway
        (`LORAFLEET_E2E_HOST_ADDRESS`, set by `make e2e-kind`)."""
        if self.local:
            return "127.0.0.1"
        return os.environ.get("LORAFLEET_E2E_HOST_ADDRESS", "127.0.0.1")

    def _binary(self, tool: str) -> str:
        try:
            return str(tool_path(tool))
        except FileNotFoundError:
            if self.local or not shutil.which(tool):
                raise
            return tool

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run kubectl against the cluster; CalledProcessError (with stderr) on failure if `check`."""
        return run_tool([self._binary("kubectl"), f"--kubeconfig={self.kubeconfig}", *args], input=input, check=check)

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run the pinned helm against the cluster (same error handling as `kubectl`)."""
        return run_tool([self._binary("helm"), f"--kubeconfig={self.kubeconfig}", *args], check=check, timeout=300)

    def new_namespace(self, prefix: str = "t") -> str:
        """Create a uniquely named namespace and wait for its `default` ServiceAccount."""
        name = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self.kube.post("/api/v1/namespaces", {"metadata": {"name": name}})
        wait_until(lambda: self.kube.get(f"/api/v1/namespaces/{name}/serviceaccounts/default"), 60, "default SA")
        return name

    def get(self, path: str, **params: Any) -> JSON:
        return self.kube.get(path, **params)

    def exists(self, path: str) -> bool:
        try:
            self.kube.get(path)
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def service_endpoint(self, namespace: str, name: str, port: int | str) -> tuple[str, int]:
        """A host:port that reaches the Service (local: a ready pod IP; kubeconfig mode: a port-forward)."""
        if self.local:
            return service_endpoint(self.kube, namespace, name, port)
        return self._port_forward(namespace, name, port)

    def service_endpoints(self, namespace: str, name: str, port: int | str) -> list[tuple[str, int]]:
        """All ready endpoints (local control plane only)."""
        return service_endpoints(self.kube, namespace, name, port)

    def _port_forward(self, namespace: str, name: str, port: int | str) -> tuple[str, int]:
        proc, local_port = self.port_forward(namespace, f"svc/{name}", port)
        self._forwards.append(proc)  # kept for the session
        return "127.0.0.1", local_port

    def port_forward(self, namespace: str, target: str, port: int | str) -> tuple[subprocess.Popen[str], int]:
        """`kubectl port-forward TARGET :PORT` (TARGET: svc/NAME or pod/NAME) on a free loopback port:
        the process (the caller stops it) and that port; LookupError if kubectl does not say it forwards."""
        argv = [self._binary("kubectl"), f"--kubeconfig={self.kubeconfig}", "-n", namespace, "port-forward"]
        proc = subprocess.Popen([*argv, target, f":{port}"], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "Forwarding from 127.0.0.1:NNNN -> PORT"
        m = re.search(r"127\.0\.0\.1:(\d+)", line)
        if not m:
            proc.terminate()
            proc.wait()
            raise LookupError(f"kubectl port-forward {target}: {line!r}")
        return proc, int(m.group(1))

    def logs(self, namespace: str, pod: str, container: str | None = None) -> str:
        """A pod's output: the node agent's capture locally, `kubectl logs` elsewhere."""
        if self.agent:
            return self.agent.logs(namespace, pod, container)
        extra = ["-c", container] if container else []
        return self.kubectl("logs", "-n", namespace, pod, *extra, check=False).stdout

    def pod_report(self, namespace: str, log_lines: int = 15) -> str:
        """What keeps a namespace's pods from being ready, for a failed wait's message: each pod
        not ready with its phase and container states, the log tail of a container that has
        exited, the namespace's Warning events, and every node not Ready."""
        lines: list[str] = []
        for node in self.get("/api/v1/nodes")["items"]:
            ready = {c["type"]: c for c in node.get("status", {}).get("conditions", [])}.get("Ready", {})
            if ready.get("status") != "True":
                lines.append(f"node {node['metadata']['name']} not Ready: {ready.get('message', '')}")
        for pod in self.get(f"/api/v1/namespaces/{namespace}/pods")["items"]:
            name, status = pod["metadata"]["name"], pod.get("status", {})
            conditions = {c["type"]: c for c in status.get("conditions", [])}
            if conditions.get("Ready", {}).get("status") == "True":
                continue
            scheduled = conditions.get("PodScheduled", {})
            lines.append(
                f"pod {name}: {status.get('phase')}"
                + (f", unscheduled: {scheduled.get('message', '')}" if scheduled.get("status") == "False" else "")
            )
            for cs in status.get("initContainerStatuses", []) + status.get("containerStatuses", []):
                state: JSON = cs.get("state") or {"unknown": {}}
                kind, detail = next(iter(state.items()))
                last = cs.get("lastState", {}).get("terminated")
                lines.append(
                    f"  container {cs['name']}: {kind} {detail.get('reason', '')} {detail.get('message', '')}".rstrip()
                    + f", restarts {cs.get('restartCount', 0)}"
                    + (f", last exit {last.get('exitCode')} {last.get('reason', '')}" if last else "")
                )
                if last or kind == "terminated":
                    tail = self.logs(namespace, name, cs["name"]).strip().splitlines()[-log_lines:]
                    lines.extend(f"    | {line}" for line in tail)
        events = self.get(f"/api/v1/namespaces/{namespace}/events", fieldSelector="type=Warning")["items"]
        for event in events[-10:]:
            obj = event.get("involvedObject", {})
            lines.append(f"event {obj.get('kind')}/{obj.get('name')} {event.get('reason')}: {event.get('message', '')}")
        return "\n".join(lines) or f"every pod in {namespace} is ready"

    def close(self) -> None:
        for proc in self._forwards:
            proc.terminate()
            proc.wait()
        self.kube.close()
        self.client.close()


def _start_local() -> tuple[TestCluster, contextlib.ExitStack]:
    stack = contextlib.ExitStack()
    workdir = Path(tempfile.mkdtemp(prefix="lorafleet-e2e-"))
    stack.callback(shutil.rmtree, workdir, True)
    local = LocalCluster(workdir / "cluster").start()
    stack.callback(local.stop)
    agent = NodeAgent(local.credentials(), workdir / "node").start()
    stack.callback(agent.stop)
    handle = TestCluster(local.kubeconfig, local=local, agent=agent)
    stack.callback(handle.close)
    return handle, stack


_shared: tuple[TestCluster, contextlib.ExitStack] | None = None
_refs = 0


@contextlib.contextmanager
def shared_cluster() -> Iterator[TestCluster]:
    """The session's cluster, started on first use and stopped when the last user is done."""
    global _shared, _refs
    if _shared is None:
        if os.environ.get("LORAFLEET_E2E_CLUSTER") == "kubeconfig":
            path = Path(os.environ.get("KUBECONFIG", Path.home() / ".kube" / "config"))
            handle = TestCluster(path)
            stack = contextlib.ExitStack()
            stack.callback(handle.close)
            _shared = handle, stack
        else:
            _shared = _start_local()
    _refs += 1
    try:
        yield _shared[0]
    finally:
        _refs -= 1
        if _refs == 0:
            done, _shared = _shared[1], None
            done.close()
