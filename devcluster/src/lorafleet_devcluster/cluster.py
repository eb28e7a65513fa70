"""A local Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager) on loopback.

The binaries are the ones `make setup` builds into `$LORAFLEET_CACHE/bin/<tool>-<version>`
(versions in `tools/go-tools.versions`). Every instance picks free ports and its
own temporary directory, so several may run at once. `stop()` terminates every
process it started (SIGTERM, then SIGKILL).

CLI (`lorafleet-devcluster up|down|status`, see `lorafleet_devcluster.cli`), which also runs the
node agent: `up` prints the kubeconfig path, `down` stops what `up` started.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from lorafleet_devcluster.certs import CertificateAuthority, CertPair, write_service_account_keys
from lorafleet_devcluster.kube import Credentials, Kube, write_kubeconfig
from lorafleet_devcluster.paths import REPO_ROOT, cache_dir

VERSIONS_FILE = REPO_ROOT / "tools" / "go-tools.versions"
SERVICE_CIDR = "10.0.0.0/24"
# Controllers the tests and the product rely on (canonical names, kube-controller-manager --controllers).
CONTROLLERS = (
    "deployment-controller",
    "replicaset-controller",
    "statefulset-controller",
    "daemonset-controller",
    "job-controller",
    "cronjob-controller",
    "ttl-after-finished-controller",
    "garbage-collector-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "endpoints-controller",
    "endpointslice-controller",
    "endpointslice-mirroring-controller",
    "node-lifecycle-controller",
    "pod-garbage-collector-controller",
    "root-ca-certificate-publisher-controller",
    "clusterrole-aggregation-controller",
    "disruption-controller",
    "resourcequota-controller",
)


def versions() -> dict[str, str]:
    """The pinned tool versions (`KUBERNETES_VERSION`, `ETCD_VERSION`, `HELM_VERSION`)."""
    pairs = (line.split("=", 1) for line in VERSIONS_FILE.read_text().splitlines() if "=" in line)
    return {k.strip(): v.strip() for k, v in pairs if not k.startswith("#")}


def tool_path(tool: str) -> Path:
    """`$LORAFLEET_CACHE/bin/<tool>-<version>`; raises FileNotFoundError (run `make setup`) if absent."""
    v = versions()
    version = {"etcd": v["ETCD_VERSION"], "helm": v["HELM_VERSION"]}.get(tool, v["KUBERNETES_VERSION"])
    path = cache_dir() / "bin" / f"{tool}-{version}"
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f"{path} is missing: run `make setup` (tools/build-go-tools.sh)")
    return path


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports on 127.0.0.1 that are free right now."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


class ToolError(subprocess.CalledProcessError):
    """A CLI failed; unlike CalledProcessError its message includes the stderr."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nstderr: {(self.stderr or '').strip()[-2000:]}"


class ProcessExited(RuntimeError):
    """A component died; waiting for it is pointless (wait_until re-raises this at once)."""


def run_tool(
    argv: Sequence[str], *, input: str | None = None, check: bool = True, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """Run a CLI (kubectl, helm) capturing text output; ToolError (a CalledProcessError) if `check` fails."""
    done = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise ToolError(done.returncode, list(argv), done.stdout, done.stderr)
    return done


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll `predicate` until it returns a truthy value (returned) or `timeout` passes (TimeoutError)."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            result = predicate()
            if result:
                return result
        except ProcessExited:
            raise
        except Exception as exc:  # the condition may raise while the system comes up
            last_error = exc
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what} (last error: {last_error})")
        time.sleep(interval)


_LIBC = ctypes.CDLL("libc.so.6", use_errno=True)  # loaded here: no dlopen between fork and exec


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL the child when the thread that started it exits (Linux prctl)."""
    _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def spawn(
    argv: Sequence[str], log: Path, *, env: dict[str, str] | None = None, cwd: Path | None = None, tie: bool = True
) -> subprocess.Popen[bytes]:
    """Start `argv` in its own process group, stdout+stderr appended to `log`.

    With `tie`, the child is SIGKILLed when the calling *thread* exits (so a crashed
    test run leaves nothing behind); only tie from a thread that outlives the child.
    """
    with open(log, "ab") as out:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_die_with_parent if tie else None,
        )


def terminate(procs: Sequence[subprocess.Popen[bytes]], grace: float = 10.0) -> None:
    """SIGTERM each process group, SIGKILL whatever is left after `grace` seconds, and reap."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # also children left in the group
        p.wait()


def tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except FileNotFoundError:
        return "(no log)"


class LocalCluster:
    """etcd + kube-apiserver + kube-controller-manager on 127.0.0.1 with generated certificates."""

    def __init__(self, workdir: Path | None = None, *, detach: bool = False) -> None:
        self._own_dir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="lorafleet-cluster-")) if workdir is None else workdir
        self.detach = detach
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._argv: dict[str, list[str]] = {}  # how each process was started (for `restart`)
        self.port = 0
        self.kubeconfig = self.workdir / "admin.kubeconfig"
        self.ca: CertificateAuthority | None = None
        self.admin: CertPair | None = None

    # -- life cycle ---------------------------------------------------------------------------------
    def start(self, timeout: float = 180.0) -> LocalCluster:
        """Start everything and wait until the API answers `/readyz` and controllers work."""
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout: float) -> None:
        binaries = {t: tool_path(t) for t in ("etcd", "kube-apiserver", "kube-controller-manager")}
        pki = self.workdir / "pki"
        pki.mkdir(parents=True, exist_ok=True)
        self.ca = ca = CertificateAuthority(pki)
        sa = write_service_account_keys(pki)
        self.port, etcd_port, peer_port, kcm_port = free_ports(4)
        serving = ca.issue(
            "apiserver",
            "kube-apiserver",
            server_names=("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"),
            server_ips=("127.0.0.1", "10.0.0.1"),
        )
        self.admin = ca.issue("admin", "admin", orgs=("system:masters",))
        kcm = ca.issue("controller-manager", "system:kube-controller-manager")
        write_kubeconfig(self.kubeconfig, server=self.server, ca_pem=ca.pem, user=self._cert_user(self.admin))
        kcm_kubeconfig = write_kubeconfig(
            self.workdir / "controller-manager.kubeconfig", server=self.server, ca_pem=ca.pem, user=self._cert_user(kcm)
        )

        etcd_url, peer_url = f"http://127.0.0.1:{etcd_port}", f"http://127.0.0.1:{peer_port}"
        self._run(
            "etcd",
            binaries["etcd"],
            "--name=lorafleet",
            f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls={etcd_url}",
            f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=lorafleet={peer_url}",
            "--unsafe-no-fsync",
            "--log-level=warn",
        )
        wait_until(
            lambda: (
                self._alive("etcd") and httpx.get(f"{etcd_url}/health", timeout=2, trust_env=False).status_code == 200
            ),
            timeout,
            "etcd /health",
        )
        self._run(
            "kube-apiserver",
            binaries["kube-apiserver"],
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={self.port}",
            f"--cert-dir={self.workdir / 'apiserver'}",
            f"--tls-cert-file={serving.cert}",
            f"--tls-private-key-file={serving.key}",
            f"--client-ca-file={ca.pair.cert}",
            f"--service-account-issuer={self.server}",
            f"--service-account-key-file={sa.cert}",
            f"--service-account-signing-key-file={sa.key}",
            "--authorization-mode=Node,RBAC",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true",
            "--profiling=false",
        )
        wait_until(lambda: self._alive("kube-apiserver") and self._get("/readyz") == "ok", timeout, "apiserver /readyz")
        self._run(
            "kube-controller-manager",
            binaries["kube-controller-manager"],
            f"--kubeconfig={kcm_kubeconfig}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={kcm_port}",
            f"--cert-dir={self.workdir / 'controller-manager'}",
            f"--root-ca-file={ca.pair.cert}",
            f"--service-account-private-key-file={sa.key}",
            "--use-service-account-credentials=true",
            f"--controllers={','.join(CONTROLLERS)}",
            "--profiling=false",
        )
        # The serviceaccount controller creating `default` means controllers run (pods need it).
        with Kube(self.credentials()) as kube:
            wait_until(
                lambda: (
                    self._alive("kube-controller-manager")
                    and kube.get("/api/v1/namespaces/default/serviceaccounts/default")
                ),
                timeout,
                "the controller-manager to create the default ServiceAccount",
            )

    def stop(self) -> None:
        """Stop every process (reverse start order); the temp dir is removed if this instance made it.

        The apiserver and controller-manager hold no state and the apiserver's graceful
        shutdown can wait long on open watches, so they get 3 s; etcd gets 10 s.
        """
        stateless = [p for name, p in self.procs.items() if name != "etcd"]
        terminate(list(reversed(stateless)), grace=3.0)
        terminate([p for name, p in self.procs.items() if name == "etcd"])
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def restart(self, name: str, down: float = 0.0, timeout: float = 180.0) -> None:
        """Stop one process (SIGTERM; kube-apiserver or kube-controller-manager), keep it down for `down`
        seconds (an outage), start it again with the same flags (port, certificates) and, for the
        apiserver, wait until it answers `/readyz` again."""
        argv = self._argv[name]
        terminate([self.procs[name]], grace=3.0)
        time.sleep(down)  # the outage itself
        self._run(name, Path(argv[0]), *argv[1:])
        if name == "kube-apiserver":
            wait_until(lambda: self._alive(name) and self._get("/readyz") == "ok", timeout, "apiserver /readyz")

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- access -------------------------------------------------------------------------------------
    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.procs.items()}

    def credentials(self) -> Credentials:
        assert self.ca and self.admin, "cluster not started"
        return Credentials(self.server, self.ca.pair.cert, self.admin.cert, self.admin.key)

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run the pinned kubectl against this cluster (raises CalledProcessError with stderr if `check`)."""
        return run_tool([str(tool_path("kubectl")), f"--kubeconfig={self.kubeconfig}", *args], input=input, check=check)

    def log(self, component: str, lines: int = 30) -> str:
        """The last lines of a component's log (etcd, kube-apiserver, kube-controller-manager)."""
        return tail(self.workdir / "logs" / f"{component}.log", lines)

    # -- internals ----------------------------------------------------------------------------------
    @staticmethod
    def _cert_user(pair: CertPair) -> dict[str, str]:
        return {"client-certificate": str(pair.cert), "client-key": str(pair.key)}

    def _run(self, name: str, binary: Path, *flags: str) -> None:
        logs = self.workdir / "logs"
        logs.mkdir(exist_ok=True)
        tie = not self.detach and threading.current_thread() is threading.main_thread()
        self._argv[name] = [str(binary), *flags]
        self.procs[name] = spawn(self._argv[name], logs / f"{name}.log", tie=tie)

    def _alive(self, name: str) -> bool:
        if self.procs[name].poll() is not None:
            raise ProcessExited(f"{name} exited ({self.procs[name].returncode}):\n{self.log(name)}")
        return True

    def _get(self, path: str) -> str:
        creds = self.credentials()
        return httpx.get(self.server + path, verify=creds.ssl_context(), timeout=5, trust_env=False).text


# -- CLI ---------------------------------------------------------------------------------------------
def default_dir() -> Path:
    """Where `up` records the cluster it starts."""
    return cache_dir() / "run" / "local-cluster"


def _cmd_up(workdir: Path) -> int:
    state = workdir / "state.json"
    if state.exists():
        print(f"a cluster is already recorded in {state}; run `down` first", file=sys.stderr)
        return 1
    workdir.mkdir(parents=True, exist_ok=True)
    cluster = LocalCluster(workdir, detach=True).start()
    agent_log = workdir / "logs" / "nodeagent.log"
    agent = spawn(
        [
            sys.executable,
            "-m",
            "lorafleet_devcluster.nodeagent",
            "--kubeconfig",
            str(cluster.kubeconfig),
            "--workdir",
            str(workdir / "node"),
        ],
        agent_log,
        cwd=REPO_ROOT,
        tie=False,
    )
    pids = {**cluster.pids, "nodeagent": agent.pid}
    state.write_text(json.dumps({"pids": pids, "kubeconfig": str(cluster.kubeconfig), "server": cluster.server}))
    with Kube(cluster.credentials()) as kube:
        try:
            wait_until(lambda: _node_ready(kube), 60, "the node agent's Node to be Ready")
        except TimeoutError:
            print(tail(agent_log), file=sys.stderr)
            _cmd_down(workdir)
            raise
    print(cluster.kubeconfig)
    return 0


def _node_ready(kube: Kube) -> bool:
    nodes = kube.get("/api/v1/nodes")["items"]
    return any(
        c["type"] == "Ready" and c["status"] == "True" for n in nodes for c in n.get("status", {}).get("conditions", [])
    )


def _cmd_down(workdir: Path) -> int:
    state = workdir / "state.json"
    if not state.exists():
        print(f"no cluster recorded in {state}", file=sys.stderr)
        return 0
    pids: dict[str, int] = json.loads(state.read_text())["pids"]
    order = (("nodeagent",), ("kube-controller-manager", "kube-apiserver"), ("etcd",))
    for names, grace in zip(order, (15.0, 3.0, 10.0), strict=True):
        _stop_groups([pids[n] for n in names if n in pids], grace)
    shutil.rmtree(workdir, ignore_errors=True)
    print(f"stopped {', '.join(pids)}")
    return 0


def _cmd_status(workdir: Path) -> int:
    """Print each recorded process (running or gone) and the kubeconfig; 0 when all run, 1 otherwise."""
    state = workdir / "state.json"
    if not state.exists():
        print(f"no cluster recorded in {state}")
        return 1
    recorded = json.loads(state.read_text())
    alive = {name: _pid_alive(pid) for name, pid in recorded["pids"].items()}
    for name, pid in recorded["pids"].items():
        print(f"{name:<24} pid {pid:<8} {'running' if alive[name] else 'GONE'}")
    print(f"server     {recorded['server']}\nkubeconfig {recorded['kubeconfig']}")
    return 0 if all(alive.values()) else 1


COMMANDS: dict[str, Callable[[Path], int]] = {"up": _cmd_up, "down": _cmd_down, "status": _cmd_status}


def _stop_groups(pids: Sequence[int], grace: float) -> None:
    """SIGTERM the process groups of `pids` (not our children), SIGKILL after `grace` seconds."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
    with contextlib.suppress(TimeoutError):
        wait_until(lambda: not any(_pid_alive(p) for p in pids), grace, "processes to exit")
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (not yet reaped by init) counts as gone.
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    return False
