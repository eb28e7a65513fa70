"""A test-only node agent: registers a Node and runs the pods bound to it as local processes.

Each pod gets its own loopback address (127.0.B.2, .3, ...; B is a per-agent
block so several agents can run at once), reported as the pod IP and exported
as `POD_IP`; programs must listen on it. Containers map to local programs
through `lorafleet_devcluster/images.py`; volumes and mount paths through
`lorafleet_devcluster/podspec.py`. Unscheduled pods are bound to this node (no
scheduler), so every pod runs here.

Per container the process gets a clean environment: PATH (venv first), HOME,
LANG, TMPDIR, LORAFLEET_CACHE, PYTHONUNBUFFERED=1, `POD_NAME`, `POD_NAMESPACE`,
`POD_IP`, `NODE_NAME`, `HOSTNAME`, `KUBERNETES_SERVICE_HOST/PORT` (the real
apiserver, there is no kube-proxy) and `KUBECONFIG`: a per-pod kubeconfig with
a TokenRequest token bound to the pod, so programs act as the pod's
ServiceAccount and RBAC applies. Logs: `<workdir>/pods/<ns>/<pod>/<uid>/logs/<container>.log`
(`NodeAgent.logs()`); `kubectl logs` does not work (no kubelet API).

Run standalone: `python -m lorafleet_devcluster.nodeagent --kubeconfig K --workdir D`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import fcntl
import http.client
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from lorafleet_devcluster import images, podman, podspec
from lorafleet_devcluster.cluster import spawn, terminate
from lorafleet_devcluster.kube import JSON, Credentials, Kube, KubeError, write_kubeconfig

HOST_IP = "127.0.0.1"
PASS_ENV = ("HOME", "LANG", "LC_ALL", "TMPDIR", "LORAFLEET_CACHE")
LEASE_SECONDS = 40
RENEW_EVERY = 10.0
STATUS_EVERY = 60.0
TICK = 0.1


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# -- loopback address blocks ----------------------------------------------------------------------------
class AddressBlock:
    """A /24 of 127.0.0.0/8 held (flock) for this agent's lifetime; hands out .2 ... .254."""

    LOCK_DIR = Path("/tmp/lorafleet-nodeagent-addresses")

    def __init__(self) -> None:
        self.LOCK_DIR.mkdir(exist_ok=True)
        for block in range(256):
            handle = open(self.LOCK_DIR / f"127.0.{block}.lock", "w")  # noqa: SIM115 - held until close()
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            self._handle: IO[str] = handle
            self.prefix = f"127.0.{block}."
            break
        else:
            raise RuntimeError("no free 127.0.x.0/24 block")
        self._used: set[int] = set()
        self._lock = threading.Lock()

    def take(self) -> str:
        with self._lock:
            host = next((h for h in range(2, 255) if h not in self._used), None)
            if host is None:
                raise RuntimeError("pod addresses exhausted")
            self._used.add(host)
            return f"{self.prefix}{host}"

    def give(self, ip: str) -> None:
        with self._lock:
            self._used.discard(int(ip.rsplit(".", 1)[1]))

    def close(self) -> None:
        self._handle.close()


# -- probes -------------------------------------------------------------------------------------------------
def _resolve_port(port: int | str, container: JSON) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports", []):
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"named port {port!r} not found")


def run_probe(probe: JSON, container: JSON, pod_ip: str, argv_for: Callable[[list[str]], list[str]]) -> bool:
    """One probe attempt (httpGet, tcpSocket or exec); True on success."""
    timeout = float(probe.get("timeoutSeconds", 1))
    try:
        if "httpGet" in probe:
            spec = probe["httpGet"]
            host, port = spec.get("host") or pod_ip, _resolve_port(spec["port"], container)
            conn: http.client.HTTPConnection
            if spec.get("scheme", "HTTP").upper() == "HTTPS":
                conn = http.client.HTTPSConnection(
                    host, port, timeout=timeout, context=ssl._create_unverified_context()
                )
            else:
                conn = http.client.HTTPConnection(host, port, timeout=timeout)
            try:
                headers = {h["name"]: h["value"] for h in spec.get("httpHeaders", [])}
                conn.request("GET", spec.get("path", "/"), headers=headers)
                return 200 <= conn.getresponse().status < 400
            finally:
                conn.close()
        if "tcpSocket" in probe:
            spec = probe["tcpSocket"]
            port = _resolve_port(spec["port"], container)
            with socket.create_connection((spec.get("host") or pod_ip, port), timeout=timeout):
                return True
        if "exec" in probe:
            done = subprocess.run(argv_for(probe["exec"]["command"]), capture_output=True, timeout=timeout)
            return done.returncode == 0
    except (OSError, ValueError, subprocess.TimeoutExpired, http.client.HTTPException, images.ImageError):
        return False
    return False


@dataclass
class Prober:
    """Schedules one probe of one container and keeps its thresholds."""

    spec: JSON
    started: float
    next_at: float = 0.0
    successes: int = 0
    failures: int = 0
    ok: bool = False
    pending: Future[bool] | None = None

    def __post_init__(self) -> None:
        self.next_at = self.started + float(self.spec.get("initialDelaySeconds", 0))

    def step(self, now: float, submit: Callable[[], Future[bool]]) -> bool | None:
        """Advance; returns True/False when the verdict changes (threshold crossed), else None."""
        if self.pending is not None:
            if not self.pending.done():
                return None
            success, self.pending = self.pending.result(), None
            if success:
                self.successes, self.failures = self.successes + 1, 0
                if not self.ok and self.successes >= int(self.spec.get("successThreshold", 1)):
                    self.ok = True
                    return True
            else:
                self.failures, self.successes = self.failures + 1, 0
                if self.failures == int(self.spec.get("failureThreshold", 3)):
                    self.ok = False
                    return False
            return None
        if now >= self.next_at:
            self.next_at = now + float(self.spec.get("periodSeconds", 10))
            self.pending = submit()
        return None


# -- containers ------------------------------------------------------------------------------------------------
@dataclass
class Container:
    """Runtime state of one container of a pod."""

    spec: JSON
    init: bool = False
    proc: subprocess.Popen[bytes] | None = None
    state: JSON = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: JSON = field(default_factory=dict)
    restarts: int = 0
    ever_started: bool = False
    next_start: float = 0.0
    backoff: float = 0.0
    done: bool = False
    exit_code: int | None = None
    ready: bool = False
    started_mono: float = 0.0
    kill_deadline: float | None = None
    readiness: Prober | None = None
    liveness: Prober | None = None
    startup: Prober | None = None
    runtime_name: str | None = None  # the podman container's name in container mode
    held_until: float = 0.0  # `NodeAgent.hold`: not restarted before this (monotonic)

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    def container_id(self) -> str:
        """`podman://<name>` in container mode, else `local://<pid>`."""
        if self.runtime_name:
            return f"podman://{self.runtime_name}"
        return f"local://{self.proc.pid if self.proc else 0}"

    def status(self) -> JSON:
        out: JSON = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": "",
            "ready": self.ready,
            "restartCount": self.restarts,
            "started": self.proc is not None and (self.startup is None or self.startup.ok),
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.proc is not None:
            out["containerID"] = self.container_id()
        return out


@dataclass
class PodRun:
    """One pod this agent runs."""

    pod: JSON
    root: Path
    ip: str | None
    inits: list[Container]
    apps: list[Container]
    phase: str = "Pending"
    start_time: str = field(default_factory=now_rfc3339)
    deleting_deadline: float | None = None
    gone: bool = False
    finished: bool = False
    transitions: dict[str, tuple[str, str]] = field(default_factory=dict)
    last_status: JSON | None = None
    kubeconfig: Path | None = None

    @property
    def key(self) -> str:
        return f"{self.pod['metadata']['namespace']}/{self.pod['metadata']['name']}"

    @property
    def containers(self) -> list[Container]:
        return self.inits + self.apps

    @property
    def policy(self) -> str:
        return str(self.pod["spec"].get("restartPolicy", "Always"))


class NodeAgent:
    """Registers a Node, keeps its lease, binds unscheduled pods and runs bound pods as processes."""

    def __init__(
        self,
        creds: Credentials,
        workdir: Path,
        *,
        node_name: str = "lorafleet-node",
        backoff: tuple[float, float] = (1.0, 30.0),
    ) -> None:
        self.creds = creds
        self.workdir = workdir
        self.node_name = node_name
        self.backoff_base, self.backoff_max = backoff
        self.kube = Kube(creds)
        self._watch_kube = Kube(creds, timeout=90)
        self._beat_kube = Kube(creds)
        self._stop_grace = 5.0
        self._deleted: dict[str, float] = {}
        self.ca_pem = creds.ca_file.read_bytes()
        self.addresses = AddressBlock()
        self.runs: dict[str, PodRun] = {}  # pod uid -> run
        self._pods: dict[str, JSON] = {}  # uid -> latest pod from the watch
        self._pods_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._probes = ThreadPoolExecutor(max_workers=8, thread_name_prefix="probe")
        self._bind_tried: dict[str, float] = {}
        self._synced = threading.Event()
        self._holds: list[tuple[str, str, str | None, float]] = []  # (ns, pod, container, until), under _pods_lock

    # -- life cycle ---------------------------------------------------------------------------------------
    def start(self) -> NodeAgent:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._register_node()
        for target in (self._heartbeat, self._watch_pods, self._loop):
            t = threading.Thread(target=target, name=f"nodeagent-{target.__name__}", daemon=True)
            t.start()
            self._threads.append(t)
        self._synced.wait(30)
        return self

    @property
    def alive(self) -> bool:
        """Every agent thread (heartbeat, pod watch, sync loop) is still running."""
        return bool(self._threads) and all(t.is_alive() for t in self._threads)

    def stop(self, grace: float = 5.0) -> None:
        """Stop every pod process (SIGTERM, SIGKILL after `grace`), then the threads."""
        self._stop_grace = grace
        self._stop.set()
        for t in self._threads:
            if t.name != "nodeagent-_watch_pods":  # blocked in a long poll; it ends when its client closes
                t.join(timeout=grace + 30)
        self._probes.shutdown(wait=False, cancel_futures=True)
        self.addresses.close()
        for kube in (self.kube, self._beat_kube, self._watch_kube):
            kube.close()

    def _shutdown_pods(self) -> None:
        """Runs on the loop thread, which the pod processes are tied to."""
        terminate([c.proc for r in self.runs.values() for c in r.containers if c.proc is not None], self._stop_grace)
        for r in self.runs.values():
            for c in r.containers:
                c.proc = None
                self._remove_container(c)

    def __enter__(self) -> NodeAgent:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- queries for tests ------------------------------------------------------------------------------
    def pids(self, namespace: str | None = None) -> list[int]:
        """PIDs of the container processes running now (of one namespace if given)."""
        runs = [r for r in list(self.runs.values()) if namespace in (None, r.pod["metadata"]["namespace"])]
        return [c.proc.pid for r in runs for c in r.containers if c.proc is not None]

    def logs(self, namespace: str, name: str, container: str | None = None) -> str:
        """The captured output of a pod's container (newest pod of that name). By default its first app
        container, as `kubectl logs` picks (not an init container), where the pod still runs here; else the
        first log by name."""
        uids = sorted((self.workdir / "pods" / namespace / name).glob("*/logs"), key=lambda p: p.stat().st_mtime)
        if not uids:
            return ""
        if container is None:
            run = next((r for r in self.runs.values() if r.key == f"{namespace}/{name}" and not r.gone), None)
            container = run.apps[0].name if run is not None and run.apps else None
        logs = sorted(uids[-1].glob("*.log"))
        chosen = next((p for p in logs if p.stem == container), None) if container else (logs[0] if logs else None)
        return chosen.read_text(errors="replace") if chosen else ""

    # -- faults for tests ---------------------------------------------------------------------------------
    def hold(self, namespace: str, name: str, seconds: float, container: str | None = None) -> None:
        """An outage of a pod's container (its first by default): SIGKILLed at the next tick and not
        restarted for `seconds`, then restarted as after a crash, with the pod's IP, ports and volumes."""
        with self._pods_lock:
            self._holds.append((namespace, name, container, time.monotonic() + seconds))

    def _apply_holds(self) -> None:
        """Loop thread: kill each held container (its process group) and keep it down until its time."""
        with self._pods_lock:
            holds, self._holds = self._holds, []
        for namespace, name, container, until in holds:
            run = next((r for r in self.runs.values() if r.key == f"{namespace}/{name}" and not r.gone), None)
            c = None if run is None else next((c for c in run.apps if container in (None, c.name)), None)
            if c is None:
                print(f"nodeagent: hold {namespace}/{name}: no such pod or container here", file=sys.stderr)
                continue
            c.held_until = until
            if c.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.proc.pid, signal.SIGKILL)

    # -- node ---------------------------------------------------------------------------------------------
    def _node_status(self) -> JSON:
        beat = now_rfc3339()
        cond = [
            ("Ready", "True", "KubeletReady", "local node agent is ready"),
            ("MemoryPressure", "False", "KubeletHasSufficientMemory", ""),
            ("DiskPressure", "False", "KubeletHasNoDiskPressure", ""),
            ("PIDPressure", "False", "KubeletHasSufficientPID", ""),
            ("NetworkUnavailable", "False", "RouteCreated", ""),
        ]
        resources = {"cpu": "64", "memory": "256Gi", "pods": "250", "ephemeral-storage": "1Ti"}
        return {
            "conditions": [
                {
                    "type": t,
                    "status": s,
                    "reason": r,
                    "message": m,
                    "lastHeartbeatTime": beat,
                    "lastTransitionTime": self._node_since,
                }
                for t, s, r, m in cond
            ],
            "capacity": resources,
            "allocatable": resources,
            "addresses": [{"type": "InternalIP", "address": HOST_IP}, {"type": "Hostname", "address": self.node_name}],
            "nodeInfo": {
                "kubeletVersion": "v0.0.0-lorafleet-nodeagent",
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
                "containerRuntimeVersion": "local://processes",
                "osImage": "local processes",
                "kernelVersion": os.uname().release,
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
            },
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
        }

    def _register_node(self) -> None:
        self._node_since = now_rfc3339()
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.node_name,
                "labels": {
                    "kubernetes.io/hostname": self.node_name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "lorafleet.dev/node-agent": "true",
                },
            },
        }
        try:
            self.kube.post("/api/v1/nodes", node)
        except KubeError as exc:
            if exc.status != 409:
                raise
        self.kube.merge_patch(f"/api/v1/nodes/{self.node_name}/status", {"status": self._node_status()})
        self._renew_lease(self.kube)
        self._clear_not_ready_taint(self.kube)

    def _clear_not_ready_taint(self, kube: Kube) -> None:
        """The node-lifecycle controller removes it too; doing it here avoids waiting for its next pass."""
        node = kube.get(f"/api/v1/nodes/{self.node_name}")
        taints = node["spec"].get("taints") or []
        keep = [t for t in taints if t["key"] not in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")]
        if len(keep) != len(taints):
            with contextlib.suppress(KubeError):
                kube.request(
                    "PATCH",
                    f"/api/v1/nodes/{self.node_name}",
                    [
                        {
                            "op": "test",
                            "path": "/metadata/resourceVersion",
                            "value": node["metadata"]["resourceVersion"],
                        },
                        {"op": "replace", "path": "/spec/taints", "value": keep},
                    ],
                    content_type="application/json-patch+json",
                )

    def _renew_lease(self, kube: Kube) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.node_name}"
        spec = {"holderIdentity": self.node_name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": now_micro()}
        try:
            kube.merge_patch(path, {"spec": spec})
        except KubeError as exc:
            if exc.status != 404:
                raise
            node = kube.get(f"/api/v1/nodes/{self.node_name}")
            owner = {"apiVersion": "v1", "kind": "Node", "name": self.node_name, "uid": node["metadata"]["uid"]}
            lease = {"metadata": {"name": self.node_name, "ownerReferences": [owner]}, "spec": spec}
            kube.post("/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases", lease)

    def _heartbeat(self) -> None:
        last_status = time.monotonic()
        while not self._stop.wait(RENEW_EVERY):
            try:
                self._renew_lease(self._beat_kube)
                if time.monotonic() - last_status >= STATUS_EVERY:
                    self._beat_kube.merge_patch(
                        f"/api/v1/nodes/{self.node_name}/status", {"status": self._node_status()}
                    )
                    last_status = time.monotonic()
                self._clear_not_ready_taint(self._beat_kube)
            except Exception as exc:  # the API server down (a refused connection), a 5xx...: beat again later
                print(f"nodeagent: heartbeat failed: {exc}", file=sys.stderr)

    # -- pod watch ----------------------------------------------------------------------------------------
    def _watch_pods(self) -> None:
        while not self._stop.is_set():
            try:
                listing = self._watch_kube.get("/api/v1/pods")
                with self._pods_lock:
                    self._pods = {p["metadata"]["uid"]: p for p in listing["items"]}
                self._synced.set()
                rv = listing["metadata"]["resourceVersion"]
                while not self._stop.is_set():
                    for event in self._watch_kube.watch("/api/v1/pods", rv, timeout_seconds=30):
                        obj = event["object"]
                        if event["type"] == "ERROR":
                            raise KubeError(int(obj.get("code", 500)), str(obj.get("message")))
                        rv = obj["metadata"]["resourceVersion"]
                        with self._pods_lock:
                            if event["type"] == "DELETED":
                                self._pods.pop(obj["metadata"]["uid"], None)
                            elif event["type"] in ("ADDED", "MODIFIED"):
                                self._pods[obj["metadata"]["uid"]] = obj
            except Exception as exc:  # relist on anything (410 Gone, connection reset, ...)
                if not self._stop.is_set():
                    print(f"nodeagent: pod watch restarting: {exc}", file=sys.stderr)
                    self._stop.wait(0.5)

    # -- main loop ----------------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._run_loop()
        finally:
            self._shutdown_pods()

    def _run_loop(self) -> None:
        while not self._stop.wait(TICK):
            self._apply_holds()
            with self._pods_lock:
                pods = dict(self._pods)
            for uid, pod in pods.items():
                try:
                    self._sync_pod(uid, pod)
                except Exception as exc:  # one broken pod must not stop the others
                    print(
                        f"nodeagent: {pod['metadata']['namespace']}/{pod['metadata']['name']}: {exc!r}", file=sys.stderr
                    )
            for uid, run in list(self.runs.items()):
                if uid not in pods:
                    run.gone = True
                    self._sync_run(run)
                    if not any(c.proc for c in run.containers):
                        self._release(run)
                        del self.runs[uid]

    def _sync_pod(self, uid: str, pod: JSON) -> None:
        spec, meta = pod["spec"], pod["metadata"]
        if not spec.get("nodeName"):
            if not meta.get("deletionTimestamp"):
                self._bind(pod)
            return
        if spec["nodeName"] != self.node_name:
            return
        run = self.runs.get(uid)
        if run is None:
            if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                return
            if meta.get("deletionTimestamp"):
                self._delete_now(pod)
                return
            run = self.runs[uid] = self._new_run(pod)
        run.pod = pod
        self._sync_run(run)

    def _bind(self, pod: JSON) -> None:
        uid = pod["metadata"]["uid"]
        if time.monotonic() - self._bind_tried.get(uid, -1e9) < 1.0:
            return
        self._bind_tried[uid] = time.monotonic()
        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        binding = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": name, "uid": uid},
            "target": {"apiVersion": "v1", "kind": "Node", "name": self.node_name},
        }
        with contextlib.suppress(KubeError):  # 409: bound meanwhile; the watch shows the result
            self.kube.post(f"/api/v1/namespaces/{ns}/pods/{name}/binding", binding)

    def _new_run(self, pod: JSON) -> PodRun:
        meta = pod["metadata"]
        root = self.workdir / "pods" / meta["namespace"] / meta["name"] / meta["uid"]
        (root / "logs").mkdir(parents=True, exist_ok=True)
        inits = [Container(c, init=c.get("restartPolicy") != "Always") for c in pod["spec"].get("initContainers", [])]
        apps = [Container(c) for c in pod["spec"]["containers"]]
        sidecars = [c for c in inits if not c.init]
        return PodRun(pod, root, None, [c for c in inits if c.init], sidecars + apps)

    # -- running a pod ------------------------------------------------------------------------------------
    def _sync_run(self, run: PodRun) -> None:
        now = time.monotonic()
        if run.gone or run.pod["metadata"].get("deletionTimestamp"):
            self._terminate(run, now)
            return
        if run.finished:
            return
        if run.ip is None:
            run.ip = self.addresses.take()
        pending_init = next((c for c in run.inits if not c.done), None)
        for c in [pending_init] if pending_init else run.apps:
            self._step_container(run, c, now)
        if pending_init and pending_init.done and pending_init.exit_code != 0:
            run.phase = "Failed"
        elif not pending_init:
            self._update_phase(run)
        if run.phase in ("Succeeded", "Failed") and not any(c.proc for c in run.containers):
            run.finished = True
            self._post_status(run)
            self._release(run)
            return
        self._post_status(run)

    def _update_phase(self, run: PodRun) -> None:
        if run.policy != "Always" and all(c.done for c in run.apps):
            run.phase = "Succeeded" if all(c.exit_code == 0 for c in run.apps) else "Failed"
        elif all(c.ever_started for c in run.apps):
            run.phase = "Running"

    def _step_container(self, run: PodRun, c: Container, now: float) -> None:
        if c.proc is not None:
            code = c.proc.poll()
            if code is not None:
                self._on_exit(run, c, code)
            else:
                self._probe(run, c, now)
                if c.kill_deadline is not None and now > c.kill_deadline:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(c.proc.pid, signal.SIGKILL)
        elif not c.done and now >= max(c.next_start, c.held_until):
            self._launch(run, c, now)

    def _launch(self, run: PodRun, c: Container, now: float) -> None:
        try:
            argv, env, cwd = self._prepare(run, c)
        except (images.ImageError, podspec.ConfigError, KubeError) as exc:
            reason = "CreateContainerConfigError" if isinstance(exc, KubeError) else exc.reason
            c.state = {"waiting": {"reason": reason, "message": str(exc)}}
            c.next_start = now + 2.0
            return
        log = run.root / "logs" / f"{c.name}.log"
        with open(log, "ab") as f:
            f.write(f"--- {now_rfc3339()} start #{c.restarts + int(c.ever_started)}: {argv}\n".encode())
        if c.ever_started:
            c.restarts += 1
        c.proc = spawn(argv, log, env=env, cwd=cwd, tie=True)  # tied to the loop thread
        c.ever_started, c.started_mono, c.kill_deadline = True, now, None
        c.state = {"running": {"startedAt": now_rfc3339()}}
        spec = c.spec
        c.readiness = Prober(spec["readinessProbe"], now) if "readinessProbe" in spec else None
        c.liveness = Prober(spec["livenessProbe"], now) if "livenessProbe" in spec else None
        c.startup = Prober(spec["startupProbe"], now) if "startupProbe" in spec else None
        c.ready = not c.init and c.readiness is None and c.startup is None

    def _on_exit(self, run: PodRun, c: Container, code: int) -> None:
        exit_code = 128 - code if code < 0 else code  # killed by signal N -> 128+N
        finished: JSON = {
            "exitCode": exit_code,
            "reason": "Completed" if exit_code == 0 else "Error",
            "startedAt": c.state.get("running", {}).get("startedAt", now_rfc3339()),
            "finishedAt": now_rfc3339(),
            "containerID": c.container_id(),
        }
        if c.proc is not None:
            with contextlib.suppress(ProcessLookupError):  # leftovers of the container's process group
                os.killpg(c.proc.pid, signal.SIGKILL)
        c.proc, c.ready, c.exit_code, c.kill_deadline = None, False, exit_code, None
        self._remove_container(c)
        policy = c.spec.get("restartPolicy") or run.policy
        restart = policy == "Always" or (policy == "OnFailure" and exit_code != 0)
        if c.init and exit_code == 0:
            restart = False
        if not restart:
            c.done = True
            c.state = {"terminated": finished}
            return
        ran = time.monotonic() - c.started_mono
        c.backoff = self.backoff_base if ran > 60 or not c.backoff else min(c.backoff * 2, self.backoff_max)
        c.next_start = time.monotonic() + c.backoff
        c.last_state = {"terminated": finished}
        c.state = {
            "waiting": {
                "reason": "CrashLoopBackOff",
                "message": f"back-off {c.backoff:.0f}s restarting failed container={c.name}",
            }
        }

    def _probe(self, run: PodRun, c: Container, now: float) -> None:
        assert run.ip is not None and c.proc is not None
        ip = run.ip

        def exec_argv(cmd: list[str]) -> list[str]:
            if c.runtime_name:
                return podman.exec_argv(c.runtime_name, cmd)
            return images.resolve(c.spec["image"], cmd, None)

        def submitter(p: Prober) -> Callable[[], Future[bool]]:
            return lambda: self._probes.submit(run_probe, p.spec, c.spec, ip, exec_argv)

        if c.startup is not None and not c.startup.ok:
            verdict = c.startup.step(now, submitter(c.startup))
            if verdict is False:
                self._kill_for_restart(run, c, now)
            if not c.startup.ok:
                return
            c.ready = c.readiness is None
        if c.liveness is not None and c.liveness.step(now, submitter(c.liveness)) is False:
            self._kill_for_restart(run, c, now)
        if c.readiness is not None:
            verdict = c.readiness.step(now, submitter(c.readiness))
            if verdict is not None:
                c.ready = verdict

    def _kill_for_restart(self, run: PodRun, c: Container, now: float) -> None:
        if c.proc is None or c.kill_deadline is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(c.proc.pid, signal.SIGTERM)
        c.kill_deadline = now + float(run.pod["spec"].get("terminationGracePeriodSeconds", 30))

    def _terminate(self, run: PodRun, now: float) -> None:
        """Graceful deletion: SIGTERM, SIGKILL after the grace period, then delete with grace 0."""
        if run.deleting_deadline is None:
            grace = run.pod["metadata"].get("deletionGracePeriodSeconds")
            if grace is None:
                grace = run.pod["spec"].get("terminationGracePeriodSeconds", 30)
            run.deleting_deadline = now + float(grace)
            for c in run.containers:
                if c.proc is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(c.proc.pid, signal.SIGTERM)
        for c in run.containers:
            if c.proc is not None and c.proc.poll() is not None:
                self._on_exit(run, c, c.proc.returncode)
                c.done = True
            elif c.proc is not None and now > run.deleting_deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.proc.pid, signal.SIGKILL)
        if not any(c.proc for c in run.containers) and not run.gone:
            run.finished = True
            self._release(run)
            self._delete_now(run.pod)

    def _delete_now(self, pod: JSON) -> None:
        """DELETE with grace 0 (at most once a second per pod; the watch shows when it is gone)."""
        meta = pod["metadata"]
        if time.monotonic() - self._deleted.get(meta["uid"], -1e9) < 1.0:
            return
        self._deleted[meta["uid"]] = time.monotonic()
        body = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": meta["uid"]},
        }
        with contextlib.suppress(KubeError):
            self.kube.delete(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}", body)

    @staticmethod
    def _remove_container(c: Container) -> None:
        """Container mode: remove what a killed `podman run` may have left running."""
        if c.runtime_name:
            podman.remove(c.runtime_name)
            c.runtime_name = None

    def _release(self, run: PodRun) -> None:
        if run.ip is not None:
            self.addresses.give(run.ip)
            run.ip = None

    # -- container configuration ---------------------------------------------------------------------------
    def _prepare(self, run: PodRun, c: Container) -> tuple[list[str], dict[str, str], Path]:
        pod, ip = run.pod, run.ip or ""
        meta = pod["metadata"]
        reader = podspec.ObjectReader(self.kube, meta["namespace"])

        def fields(path: str) -> str:
            return podspec.field_ref(pod, path, ip, HOST_IP)

        base = {k: os.environ[k] for k in PASS_ENV if k in os.environ}
        base.update(
            PATH=f"{images.venv_bin()}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            PYTHONUNBUFFERED="1",
            HOSTNAME=meta["name"],
            POD_NAME=meta["name"],
            POD_NAMESPACE=meta["namespace"],
            POD_IP=ip,
            NODE_NAME=self.node_name,
            KUBERNETES_SERVICE_HOST=HOST_IP,
            KUBERNETES_SERVICE_PORT=self.creds.server.rsplit(":", 1)[1],
            KUBERNETES_SERVICE_PORT_HTTPS=self.creds.server.rsplit(":", 1)[1],
        )
        if pod["spec"].get("automountServiceAccountToken", True):
            base["KUBECONFIG"] = str(self._pod_kubeconfig(run))
        ctx = podspec.VolumeContext(
            reader, fields, lambda aud, exp: self._token(pod, aud, exp), self.ca_pem, self.workdir / "claims"
        )
        volumes = podspec.materialise_volumes(pod, run.root / "volumes", ctx)
        mounts = podspec.mount_map(c.spec, volumes)
        if podman.runs_in_container(c.spec["image"]):
            return self._prepare_container(run, c, base, reader, fields, volumes, mounts)
        base.update(podspec.mount_env(mounts))
        own = podspec.container_env(c.spec, base, reader, fields)
        rewrite = podspec.rewriter(mounts)
        # Expand with the pod's own (container-side) values, then map mount paths once.
        command = [rewrite(podspec.expand(a, {**base, **own})) for a in c.spec.get("command") or []]
        args = [rewrite(podspec.expand(a, {**base, **own})) for a in c.spec.get("args") or []]
        env = {**base, **{k: rewrite(v) for k, v in own.items()}}
        argv = images.resolve(c.spec["image"], command, args)
        cwd = Path(rewrite(c.spec["workingDir"])) if c.spec.get("workingDir") else run.root / "cwd"
        cwd.mkdir(parents=True, exist_ok=True)
        return argv, env, cwd

    def _prepare_container(
        self,
        run: PodRun,
        c: Container,
        base: dict[str, str],
        reader: podspec.ObjectReader,
        fields: podspec.FieldResolver,
        volumes: dict[str, Path],
        mounts: dict[str, str],
    ) -> tuple[list[str], dict[str, str], Path]:
        """Container mode: `podman run` of the container's image; mount paths are real, nothing rewritten."""
        podman.require_image(c.spec["image"])
        inside = {k: v for k, v in base.items() if k not in ("PATH", *PASS_ENV)}  # the image's PATH and HOME
        inside.update(podspec.mount_env({p: p for p in mounts}))
        extra = podman.volume_args(run.pod, c.spec, volumes, mounts)
        if "KUBECONFIG" in inside:
            Path(inside["KUBECONFIG"]).chmod(0o644)  # readable by the container's user, like the token volume
            extra += ["-v", f"{inside['KUBECONFIG']}:{podman.KUBECONFIG_PATH}:ro"]
            inside["KUBECONFIG"] = podman.KUBECONFIG_PATH
        extra += podman.security_args(run.pod, c.spec) + podman.resource_args(c.spec)
        own = podspec.container_env(c.spec, inside, reader, fields)
        env = {**inside, **own}
        command = [podspec.expand(a, env) for a in c.spec.get("command") or []]
        args = [podspec.expand(a, env) for a in c.spec.get("args") or []]
        env_file, env_names = podman.write_env_file(run.root / f"{c.name}.env", env)
        c.runtime_name = f"lf-{run.pod['metadata']['uid'][:8]}-{c.name}-{c.restarts + int(c.ever_started)}"
        podman.remove(c.runtime_name)  # a leftover of an agent that was killed
        argv = podman.run_argv(
            name=c.runtime_name,
            image=c.spec["image"],
            command=command,
            args=args,
            env_file=env_file,
            env_names=env_names,
            extra=extra,
            workdir=c.spec.get("workingDir"),
        )
        cwd = run.root / "cwd"
        cwd.mkdir(parents=True, exist_ok=True)
        return argv, {**podman.podman_env(), **{n: env[n] for n in env_names}}, cwd

    def _token(self, pod: JSON, audience: str | None, expiration: int | None) -> str:
        meta, sa = pod["metadata"], pod["spec"].get("serviceAccountName") or "default"
        spec: JSON = {
            "expirationSeconds": max(int(expiration or 3607), 600),
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]},
        }
        if audience:
            spec["audiences"] = [audience]
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
        result = self.kube.post(f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{sa}/token", body)
        return str(result["status"]["token"])

    def _pod_kubeconfig(self, run: PodRun) -> Path:
        """A kubeconfig with a token bound to the pod (3607 s: the apiserver extends such tokens to a year)."""
        if run.kubeconfig is None:
            token = self._token(run.pod, None, 3607)
            run.kubeconfig = write_kubeconfig(
                run.root / "kubeconfig",
                server=self.creds.server,
                ca_pem=self.ca_pem,
                user={"token": token},
                namespace=run.pod["metadata"]["namespace"],
            )
        return run.kubeconfig

    # -- status -----------------------------------------------------------------------------------------------
    def _condition(self, run: PodRun, kind: str, ok: bool) -> JSON:
        status = "True" if ok else "False"
        previous = run.transitions.get(kind)
        if previous is None or previous[0] != status:
            run.transitions[kind] = (status, now_rfc3339())
        return {"type": kind, "status": status, "lastProbeTime": None, "lastTransitionTime": run.transitions[kind][1]}

    def _post_status(self, run: PodRun) -> None:
        inits_done = all(c.done for c in run.inits)
        ready = inits_done and run.phase == "Running" and all(c.ready for c in run.apps)
        # Ready also waits for the pod's readiness gates: conditions other controllers set (kept by the
        # strategic merge patch below, as the kubelet's status manager keeps them)
        gates = [g.get("conditionType") for g in (run.pod.get("spec") or {}).get("readinessGates") or []]
        others = {c.get("type"): c.get("status") for c in (run.pod.get("status") or {}).get("conditions") or []}
        gates_open = all(others.get(g) == "True" for g in gates)
        status: JSON = {
            "phase": run.phase,
            "hostIP": HOST_IP,
            "hostIPs": [{"ip": HOST_IP}],
            "startTime": run.start_time,
            "conditions": [
                self._condition(run, "PodReadyToStartContainers", True),
                self._condition(run, "Initialized", inits_done),
                self._condition(run, "ContainersReady", ready),
                self._condition(run, "Ready", ready and gates_open),
                self._condition(run, "PodScheduled", True),
            ],
            "containerStatuses": [c.status() for c in run.apps],
            "initContainerStatuses": [c.status() for c in run.inits],
        }
        if run.ip:
            status.update(podIP=run.ip, podIPs=[{"ip": run.ip}])
        if status == run.last_status:
            return
        meta = run.pod["metadata"]
        try:
            self.kube.request(
                "PATCH",
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                {"status": status},
                content_type="application/strategic-merge-patch+json",
            )
        except KubeError as exc:
            if exc.status != 404:
                raise
        run.last_status = status


def main(argv: list[str] | None = None) -> int:
    from lorafleet_devcluster.kube import load_kubeconfig

    parser = argparse.ArgumentParser(
        prog="python -m lorafleet_devcluster.nodeagent", description="run the test node agent"
    )
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--node-name", default="lorafleet-node")
    args = parser.parse_args(argv)
    agent = NodeAgent(load_kubeconfig(args.kubeconfig), args.workdir, node_name=args.node_name).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"nodeagent: node {args.node_name} running pods on {agent.addresses.prefix}x", flush=True)
    stop.wait()
    agent.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
