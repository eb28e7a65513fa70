"""Chaos soak: the chart on the local dev cluster under router traffic while a seeded
fault schedule runs; convergence sampled throughout; invariants checked at the end; a JSON report
with the seed and a timeline plot (tools/soak_report.py).

    python tools/soak.py --minutes 3 --seed 7 --report soak-report.json     (or: make soak SOAK_MINUTES=3)

Faults (one every ``--fault-every`` seconds, in a seeded order; ``--faults`` picks the kinds): a worker
container SIGKILLed (an OOM kill), a worker pod force-deleted, the operator's leader SIGKILLed, a
router SIGKILLed, a 50-object apply-then-delete storm, a hot swap (an adapter's source changes), and
three outages, each alone (the next fault waits for its end): MinIO down for ``--minio-down`` s (its
container killed and held down by the node agent, then restarted on the same address and data),
kube-apiserver stopped for ``--apiserver-down`` s and restarted (same port, certificates, etcd), and
the Hub's file downloads failing (``--hub-error``) for ``--hub-down`` s while a new ``hf://``
DynamoModel syncs (its sync Job fails, is retried with backoff, and must complete once the Hub
recovers; then the object is deleted).
Traffic: client threads over every adapter, streamed and not, each request through one of the router
pods (the router list is cached, so traffic goes on while the API server is down).

Invariants (the report's ``invariants``; exit status 1 if one fails):
- ``nonstream_failures``: non-streamed requests that failed as the client saw them, except through a
  router that was killed while they were in flight (a client-side retry is not counted as success);
- ``streams_broken``: streams that broke; each must have been in flight when a worker or router was
  killed (``soak_report.unexplained_breaks``), and they are counted;
- ``converged``: within ``--converge-timeout`` s of the last fault (and then for ``--settle`` s: no
  flapping) every DynamoModel is Ready for its
  generation with its replicas, each worker holds exactly the adapters placed on it, storm objects
  are gone (no stuck finalizer); the report has each object's convergence time after the last fault;
- ``sync_recovery``: each Hub-outage object showed the failure in its status, became Ready after the
  Hub recovered, and was gone within 120 s of its deletion (no stuck finalizer);
- ``tracebacks``: no traceback in any operator, router or worker log;
- ``rss``: each component's RSS grew less than ``--rss-growth`` (MiB) between warm-up and the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from lorafleet_devcluster.hfhub import LocalHub
from lorafleet_devcluster.rawstack import pod_ready
from lorafleet_devcluster.session import TestCluster, shared_cluster
from lorafleet_devcluster.stack import BASE_MODEL, Release, deep_merge, default_values, wait_for
from lorafleet_worker_dev.tiny import make_tiny_adapter, make_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
import soak_report  # tools/ is not a package: its directory is on the path

FAULTS = (
    "worker-kill", "pod-delete", "leader-kill", "router-kill", "storm", "hot-swap",
    "minio-down", "apiserver-restart", "hub-outage",
)  # fmt: skip
GROUP_PATH = "/apis/nvidia.com/v1alpha1/namespaces/{ns}/dynamomodels"
HUB_REPO = "soak/flaky"
SYNC_FAILURE_REASONS = {"SyncJobRetrying", "SyncFailed", "RevisionResolveFailed"}


@dataclass
class Outcome:
    started: float
    ended: float
    adapter: str
    stream: bool
    router: str
    result: str  # "ok" | "http-<status>" | "connect" | "broken" | "error"


@dataclass
class Fault:
    at: float
    kind: str
    target: str
    ended: float = 0.0


@dataclass
class SyncCheck:
    """One Hub-outage object: what its status showed, when it became Ready, when it was gone."""

    name: str
    created: float
    hub_recovered: float
    states: list[tuple[float, str, str, str]] = field(default_factory=list)  # (t, phase, Synced reason, message)
    ready_at: float | None = None
    gone_at: float | None = None

    @property
    def showed_failure(self) -> bool:
        return any(reason in SYNC_FAILURE_REASONS for _, _, reason, _ in self.states)


@dataclass
class Soak:
    release: Release
    rng: random.Random
    adapters: dict[str, str]  # modelName -> DynamoModel name
    sources: dict[str, str]  # adapter version -> s3 URI
    args: argparse.Namespace
    hub: LocalHub
    hub_adapter: Path  # what each Hub outage commits to its own repo
    t0: float = field(default_factory=time.monotonic)
    outcomes: list[Outcome] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)  # {"t", "ok": {name: bool} | None}
    syncs: list[SyncCheck] = field(default_factory=list)
    followers: list[threading.Thread] = field(default_factory=list)  # one per SyncCheck
    killed_routers: list[tuple[str, float]] = field(default_factory=list)  # (router url, when)
    known_routers: list[str] = field(default_factory=list)  # the last router list read (the API may be down)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    # ---- cluster views ------------------------------------------------------------------
    @property
    def ns(self) -> str:
        return str(self.release.namespace)

    def routers(self) -> list[str]:
        name = f"{self.release.fullname}-router"
        return [f"http://{h}:{p}" for h, p in self.release.cluster.service_endpoints(self.ns, name, "http")]

    def pid_of(self, pod: dict[str, Any]) -> int | None:
        for status in pod["status"].get("containerStatuses") or []:
            cid = status.get("containerID", "")
            if cid.startswith("local://") and status.get("state", {}).get("running"):
                return int(cid.removeprefix("local://"))
        return None

    def models(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.release.cluster.get(GROUP_PATH.format(ns=self.ns))["items"]
        return items

    # ---- traffic ------------------------------------------------------------------------
    def client(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=120, headers=self.release.inference_headers()) as http:
            while not self.stop.is_set():
                routers = self._routers_or_none()
                if not routers:
                    time.sleep(0.5)
                    continue
                router, adapter, stream = rng.choice(routers), rng.choice(sorted(self.adapters)), rng.random() < 0.5
                body = {"model": adapter, "prompt": "The fleet", "max_tokens": 24, "temperature": 0, "stream": stream}
                started = self.now()
                result = self._send(http, router, body, stream)
                with self.lock:
                    self.outcomes.append(Outcome(started, self.now(), adapter, stream, router, result))

    def _routers_or_none(self) -> list[str]:
        """The ready router pods; the last list read while the API server cannot be read."""
        with contextlib.suppress(Exception):
            self.known_routers = self.routers()
        return self.known_routers

    @staticmethod
    def _send(http: httpx.Client, router: str, body: dict[str, Any], stream: bool) -> str:
        try:
            if not stream:
                r = http.post(f"{router}/v1/completions", json=body)
                return "ok" if r.status_code == 200 and r.json()["choices"][0]["text"] else f"http-{r.status_code}"
            with http.stream("POST", f"{router}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return f"http-{r.status_code}"
                lines = [line.strip() for line in r.iter_lines()]
                if any(line.startswith('data: {"error"') for line in lines):
                    return "error-in-stream"  # the worker failed after its status line (e.g. its engine died)
                return "ok" if "data: [DONE]" in lines else "broken"
        except httpx.ConnectError:
            return "connect"
        except (httpx.RemoteProtocolError, httpx.ReadError):
            return "broken"
        except Exception as e:
            return f"error-{type(e).__name__}"

    # ---- faults -------------------------------------------------------------------------
    def inject(self, kind: str) -> Fault:
        """Run one fault; an outage's ``ended`` is when the component is back (in the future for MinIO
        and the Hub, which come back by themselves)."""
        fault = Fault(self.now(), kind, "")
        try:
            done = getattr(self, "_" + kind.replace("-", "_"))()
            fault.target, until = done if isinstance(done, tuple) else (done, 0.0)
            fault.ended = max(self.now(), until)
        except Exception as e:
            fault.target, fault.ended = f"skipped: {type(e).__name__}: {e}", self.now()
        self.faults.append(fault)
        print(f"[{fault.at:7.1f}s] {kind}: {fault.target}", flush=True)
        return fault

    def _kill_pod(self, component: str, pick: str | None = None) -> str:
        pods = self.release.pods(component)
        pod = next((p for p in pods if p["metadata"]["name"] == pick), None) if pick else self.rng.choice(pods)
        if pod is None:
            raise LookupError(f"no {component} pod {pick}")
        pid = self.pid_of(pod)
        if pid is None:
            raise LookupError(f"{pod['metadata']['name']} has no running container")
        os.kill(pid, signal.SIGKILL)
        return str(pod["metadata"]["name"])

    def _worker_kill(self) -> str:
        return self._kill_pod("worker")

    def _pod_delete(self) -> str:
        pod = self.rng.choice(self.release.pods("worker"))["metadata"]["name"]
        self.release.kubectl("delete", "pod", pod, "--grace-period=0", "--force", "--wait=false")
        return str(pod)

    def _leader_kill(self) -> str:
        lease = self.release.cluster.get(f"/apis/coordination.k8s.io/v1/namespaces/{self.ns}/leases/lorafleet-operator")
        return self._kill_pod("operator", str(lease["spec"]["holderIdentity"]))

    def _router_kill(self) -> str:
        pod = self.rng.choice(self.release.pods("router"))
        with self.lock:
            self.killed_routers.append((f"http://{pod['status']['podIP']}:", self.now()))
        return self._kill_pod("router", pod["metadata"]["name"])

    def _storm(self) -> str:
        names = [f"storm-{i:02d}" for i in range(50)]
        uri = next(iter(self.sources.values()))
        docs = [yaml.safe_load(manifest_doc(n, f"storm/{n}", uri, 1)) for n in names]
        self.release.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
        self.release.kubectl("delete", "dm", *names, "--wait=false")
        return "50 applied, then deleted"

    def _hot_swap(self) -> str:
        model = self.rng.choice(sorted(self.adapters))
        name = self.adapters[model]
        uris = sorted(set(self.sources.values()))
        current = self.release.model(name)["spec"]["source"]["uri"]
        new = next(u for u in uris if u != current)
        self.release.kubectl("patch", "dm", name, "--type=merge", "-p", json.dumps({"spec": {"source": {"uri": new}}}))
        return f"{name} -> {new}"

    def _minio_down(self) -> tuple[str, float]:
        """The store's container killed and kept down (the node agent restarts it after the hold)."""
        agent = self.release.cluster.agent
        if agent is None:
            raise LookupError("MinIO outages need the local node agent")
        pod = self.release.pods("minio")[0]["metadata"]["name"]
        agent.hold(self.ns, pod, self.args.minio_down)
        return f"{pod} down for {self.args.minio_down:.0f}s", self.now() + self.args.minio_down

    def _apiserver_restart(self) -> str:
        """kube-apiserver stopped, kept down, restarted on the same port; returns once it is ready."""
        local = self.release.cluster.local
        if local is None:
            raise LookupError("restarting the API server needs the local control plane")
        t = time.monotonic()
        local.restart("kube-apiserver", down=self.args.apiserver_down)
        return f"down {self.args.apiserver_down:.0f}s, ready again after {time.monotonic() - t:.0f}s"

    def _hub_outage(self) -> tuple[str, float]:
        """A new hf:// DynamoModel while the Hub's downloads fail; a thread follows it to Ready, then deletes it.
        Each outage syncs a repo of its own, committed just before: a revision already in the store would
        sync without downloading anything (the sync Job skips it), and the outage would test nothing."""
        name = f"flaky-{len(self.syncs):02d}"
        repo = f"{HUB_REPO}-{len(self.syncs):02d}"
        self.hub.commit(repo, self.hub_adapter)
        self.hub.failing_downloads = self.args.hub_error
        recovered = self.now() + self.args.hub_down
        check = SyncCheck(name, self.now(), recovered)
        self.syncs.append(check)
        self.release.kubectl("apply", "-f", "-", input=manifest_doc(name, f"soak/{name}", f"hf://{repo}@main", 1))
        self.followers.append(threading.Thread(target=self._follow_sync, args=(check,), daemon=True))
        self.followers[-1].start()
        outage = f"Hub downloads answer {self.args.hub_error} for {self.args.hub_down:.0f}s"
        return f"{name} from hf://{repo}, {outage}", recovered

    def _follow_sync(self, check: SyncCheck) -> None:
        """End the Hub outage on time; record the object's states until it is Ready; then delete it and
        record when it is gone."""
        path = f"{GROUP_PATH.format(ns=self.ns)}/{check.name}"
        deadline = check.hub_recovered + self.args.converge_timeout + 180
        while check.ready_at is None and self.now() < deadline and not self.stop.is_set():
            if self.now() >= check.hub_recovered:
                self._end_hub_outage(check)
            with contextlib.suppress(Exception):  # the API server may be down
                self._record_sync_state(check, self.release.cluster.get(path))
            time.sleep(1)
        self._end_hub_outage(check)
        if check.ready_at is None:
            return
        self.release.kubectl("delete", "dm", check.name, "--wait=false", check=False)
        while self.now() < check.ready_at + 120:
            if not self.release.cluster.exists(path):
                check.gone_at = self.now()
                return
            time.sleep(1)

    def _end_hub_outage(self, check: SyncCheck) -> None:
        """The Hub answers again, unless a later outage (another object's) is on now: that one is its own."""
        if self.syncs[-1] is check:
            self.hub.failing_downloads = None

    def _record_sync_state(self, check: SyncCheck, dm: dict[str, Any]) -> None:
        status = dm.get("status") or {}
        synced: dict[str, Any] = next((c for c in status.get("conditions") or [] if c.get("type") == "Synced"), {})
        state = (str(status.get("phase")), str(synced.get("reason")), str(synced.get("message", ""))[:200])
        if not check.states or check.states[-1][1:] != state:
            check.states.append((self.now(), *state))
        if model_ok(dm) and self.now() >= check.hub_recovered:
            check.ready_at = self.now()

    # ---- convergence, sampled while the soak runs -------------------------------------------
    def sample(self) -> None:
        """Every ``--sample-every`` s: which DynamoModels are converged (None while the API cannot be read)."""
        while not self.stop.is_set():
            t = self.now()
            try:
                ok: dict[str, bool | None] | None = self.object_states()
            except Exception:
                ok = None
            with self.lock:
                self.samples.append({"t": t, "ok": ok})
            self.stop.wait(self.args.sample_every)

    def object_states(self) -> dict[str, bool | None]:
        """Per DynamoModel: Ready for its generation with its replicas, and held pinned by exactly its placement;
        None (no evidence) when it is Ready but a pod of its placement did not answer its listing in time."""
        items = self.models()
        held = {p["metadata"]["name"]: self._held(p) for p in self.release.pods("worker")}
        out: dict[str, bool | None] = {}
        for dm in items:
            status, model = dm.get("status") or {}, dm["spec"]["modelName"]
            placement = set(status.get("placement") or [])
            holders = {pod for pod, loras in held.items() if loras is not None and model in loras}
            unknown = any(held.get(pod, set()) is None for pod in placement)
            ready = model_ok(dm)
            out[dm["metadata"]["name"]] = ready and (holders == placement or (None if unknown else False))
        return out

    def _held(self, pod: dict[str, Any]) -> set[str] | None:
        """What a worker pod holds: nothing while it cannot be reached (killed, restarting); None when it
        was reached but did not answer in time (busy, e.g. loading a storm's adapters)."""
        try:
            return self.release.worker_adapters(pod)[0]
        except httpx.TimeoutException:
            return None
        except httpx.HTTPError:
            return set()

    # ---- invariants -----------------------------------------------------------------------
    def converged(self) -> tuple[bool, str]:
        """Every worker pod back and Ready (a killed one's return moves adapters back: part of recovering),
        every DynamoModel ``model_ok``, every worker holding exactly what placement says pinned, no storm object.
        Copies a worker loaded on demand (a request the router sent to an adapter's rendezvous pod while
        its holders failed) are the worker's LRU cache, not placement: the operator leaves them, and so
        does this check; the message names them."""
        workers = self.release.pods("worker")
        ready = [p for p in workers if pod_ready(p)]  # `pods` leaves out terminating pods
        if len(ready) != self.args.workers or len(workers) != self.args.workers:
            return False, f"{len(ready)}/{self.args.workers} worker pods Ready ({len(workers)} pods)"
        items = self.models()
        if any(i["metadata"]["name"].startswith("storm-") for i in items):
            return False, "storm objects remain"
        placed: dict[str, set[str]] = {}
        for dm in items:
            status = dm.get("status") or {}
            if not model_ok(dm):
                return False, f"{dm['metadata']['name']}: {status.get('phase')} {status.get('readyEndpoints')}"
            for pod in status.get("placement") or []:
                placed.setdefault(pod, set()).add(dm["spec"]["modelName"])
        on_demand: dict[str, list[str]] = {}
        for pod in self.release.pods("worker"):
            name = pod["metadata"]["name"]
            held, extra = self.release.worker_adapters(pod)
            if held != placed.get(name, set()):
                return False, f"{name} holds {sorted(held)}, placement says {sorted(placed.get(name, set()))}"
            if extra:
                on_demand[name] = sorted(extra)
        return True, f"ok; loaded on demand besides: {on_demand}" if on_demand else "ok"

    def diagnostics(self) -> dict[str, Any]:
        """What a failed convergence looked like: each DynamoModel's status, the worker pods, the leader's log tail."""
        models = {
            dm["metadata"]["name"]: {k: (dm.get("status") or {}).get(k) for k in
                                     ("phase", "placement", "readyEndpoints", "totalEndpoints", "observedGeneration")}
            for dm in self.models()
        }  # fmt: skip
        pods = {}
        for pod in self.release.pods("worker"):
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])
            restarts = sum(c.get("restartCount", 0) for c in pod["status"].get("containerStatuses") or [])
            pods[pod["metadata"]["name"]] = {"ready": ready, "restarts": restarts, "ip": pod["status"].get("podIP")}
            if not ready:  # why it is not back: what its probes answer now, and the tail of its log
                pods[pod["metadata"]["name"]]["probes"] = self.probe_answers(pod)
                pods[pod["metadata"]["name"]]["log_tail"] = self.release.cluster.logs(
                    self.ns, pod["metadata"]["name"]
                ).splitlines()[-30:]
        lease = self.release.cluster.get(f"/apis/coordination.k8s.io/v1/namespaces/{self.ns}/leases/lorafleet-operator")
        leader = str(lease["spec"].get("holderIdentity") or "")
        log = self.release.cluster.logs(self.ns, leader).splitlines()[-60:] if leader else []
        return {"models": models, "worker_pods": pods, "leader": leader, "leader_log_tail": log}

    def probe_answers(self, pod: dict[str, Any]) -> dict[str, Any]:
        """A worker's /ready and /health as its kubelet asks them, with how long each answer took
        (a probe times out after its timeoutSeconds, which a slow answer alone can fail)."""
        out: dict[str, Any] = {}
        with self.release.pod_port(pod, 9090) as base:
            for path in ("/ready", "/health"):
                t0 = time.monotonic()
                try:
                    r = httpx.get(base + path, timeout=30)
                    answer: Any = {"status": r.status_code, "body": r.text[:300]}
                except httpx.HTTPError as exc:
                    answer = {"error": repr(exc)}
                out[path] = {**answer, "seconds": round(time.monotonic() - t0, 3)}
        return out

    def rss(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for component in ("operator", "router", "worker"):
            for pod in self.release.pods(component):
                pid = self.pid_of(pod)
                if pid is not None:
                    out[pod["metadata"]["name"]] = _rss_mib(pid)
        return out

    def tracebacks(self) -> tuple[dict[str, dict[str, int]], dict[str, str]]:
        """Per pod: each distinct traceback (the log line before it, then its exception line) and its count;
        and the whole text of each one's first occurrence, with the lines before it (to read in the report)."""
        out: dict[str, dict[str, int]] = {}
        texts: dict[str, str] = {}
        for component in ("operator", "router", "worker"):
            for pod in self.release.pods(component):
                lines = self.release.cluster.logs(self.ns, pod["metadata"]["name"]).splitlines()
                found: Counter[str] = Counter()
                for i, line in enumerate(lines):
                    if line.startswith("Traceback (most recent call last)"):
                        end = next((j for j in range(i + 1, len(lines)) if not lines[j].startswith((" ", "\t"))), i)
                        before = lines[i - 1][-160:] if i else ""
                        key = f"{before} | {lines[end][:200] if end < len(lines) else ''}"
                        found[key] += 1
                        texts.setdefault(key, "\n".join(lines[max(0, i - 5) : end + 1][-80:]))
                if found:
                    out[pod["metadata"]["name"]] = dict(found)
        return out, texts


def model_ok(dm: dict[str, Any]) -> bool:
    """Ready for its generation on as many endpoints as it asks for (autoscaled: within its bounds), all ready."""
    status, spec = dm.get("status") or {}, dm["spec"]
    current = status.get("observedGeneration") == dm["metadata"]["generation"]
    total = status.get("totalEndpoints")
    if "autoscaling" in spec:
        bounds = spec["autoscaling"]
        wanted = isinstance(total, int) and bounds.get("minReplicas", 1) <= total <= bounds.get("maxReplicas", total)
    else:
        wanted = total == spec.get("replicas", 2)
    return bool(status.get("phase") == "Ready" and current and wanted and status.get("readyEndpoints") == total)


def _rss_mib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 0


def manifest_doc(name: str, model_name: str, uri: str, replicas: int | dict[str, int]) -> str:
    """A DynamoModel with a fixed ``replicas`` count, or ``spec.autoscaling`` when given a dict."""
    spec: dict[str, Any] = {"modelName": model_name, "baseModelName": BASE_MODEL, "modelType": "lora",
                            "source": {"uri": uri}}  # fmt: skip
    spec["autoscaling" if isinstance(replicas, dict) else "replicas"] = replicas
    doc = {"apiVersion": "nvidia.com/v1alpha1", "kind": "DynamoModel", "metadata": {"name": name}, "spec": spec}
    return yaml.safe_dump(doc)


def replicas_of(i: int, args: argparse.Namespace) -> int | dict[str, int]:
    """Adapter i's replicas: the last ``--autoscaled`` adapters scale with demand (1 to 3 pods), the others
    have 1 or 2 fixed replicas."""
    if i >= args.adapters - args.autoscaled:
        return {"minReplicas": 1, "maxReplicas": 3, "target": 2}
    return 1 + i % 2


def install(cluster: TestCluster, workdir: Path, workers: int, hub: LocalHub) -> tuple[Release, dict[str, str]]:
    """The chart (2 operators, 2 routers, `workers` workers, the Hub as its HF endpoint); two adapter
    versions in the store (hot swaps alternate between them); each Hub outage commits the first to the Hub."""
    release = Release(cluster, cluster.new_namespace("soak"), log=lambda m: print(m, flush=True))
    values = deep_merge(
        default_values(cluster, workers=workers, hf_endpoint=hub.url),
        {"operator": {"replicas": 2}, "router": {"replicas": 2}, "workerDefaults": {"healthStallTimeoutSeconds": 30}},
    )
    release.deploy(values)
    base = make_tiny_model(workdir / "base", "qwen3")
    sources = {}
    for i in range(2):
        adapter = make_tiny_adapter(workdir / f"a{i}", base, rank=4, seed=100 + i, strength=2.0)
        sources[f"v{i}"] = f"s3://soak/v{i}"
        release.upload(adapter, sources[f"v{i}"])
    return release, sources


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=float(os.environ.get("SOAK_MINUTES", "3")))
    parser.add_argument("--seed", type=int, default=int(os.environ.get("SOAK_SEED", "0")) or random.randrange(1 << 30))
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--adapters", type=int, default=20)
    parser.add_argument("--autoscaled", type=int, default=4, help="how many of the adapters scale with demand")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--fault-every", type=float, default=25.0, help="seconds between faults")
    parser.add_argument("--faults", default=",".join(FAULTS), help="comma-separated kinds to draw from")
    parser.add_argument("--minio-down", type=float, default=60.0, help="seconds MinIO stays down")
    parser.add_argument("--apiserver-down", type=float, default=10.0, help="seconds kube-apiserver stays down")
    parser.add_argument("--hub-down", type=float, default=60.0, help="seconds the Hub's downloads fail")
    parser.add_argument(
        "--hub-error",
        type=int,
        default=404,
        help="the status the Hub's downloads answer meanwhile: 404 (a file the branch names is not uploaded "
        "yet: each Job fails at once and the operator recreates it with backoff) or 503 (the Job's pods retry)",
    )
    parser.add_argument("--sample-every", type=float, default=3.0, help="seconds between convergence samples")
    parser.add_argument(
        "--converge-timeout",
        type=float,
        default=60.0,
        help="seconds after the last fault to converge (waits 120 s more to measure)",
    )
    parser.add_argument(
        "--settle", type=float, default=45.0, help="seconds after convergence in which every sample must stay converged"
    )
    parser.add_argument("--rss-growth", type=int, default=200, help="MiB a component may grow")
    parser.add_argument("--report", type=Path, default=Path("soak-report.json"))
    parser.add_argument("--plot", type=Path, default=None, help="timeline PNG (default: the report's name, .png)")
    args = parser.parse_args(argv)
    unknown = set(args.faults.split(",")) - set(FAULTS)
    if unknown:
        parser.error(f"unknown faults {sorted(unknown)}; choose from {', '.join(FAULTS)}")
    return args


def schedule(args: argparse.Namespace, rng: random.Random) -> list[str]:
    """Rounds of every chosen kind once, each round in a seeded order, as many faults as could fit the
    soak's length (a short soak still runs each kind once if it has the time)."""
    kinds = args.faults.split(",")
    plan: list[str] = []
    while len(plan) < max(1, int(args.minutes * 60 // args.fault_every)):
        plan += rng.sample(kinds, len(kinds))
    return plan


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    print(f"soak: seed {args.seed}, {args.minutes} min, {args.workers} workers, {args.adapters} adapters", flush=True)
    with (
        tempfile.TemporaryDirectory(prefix="lorafleet-soak-") as tmp,
        LocalHub(Path(tmp) / "hub") as hub,
        shared_cluster() as cluster,
    ):
        release, sources = install(cluster, Path(tmp), args.workers, hub)
        adapters = {f"soak/a{i:02d}": f"a{i:02d}" for i in range(args.adapters)}
        docs = [
            manifest_doc(n, m, sources[f"v{i % 2}"], replicas_of(i, args)) for i, (m, n) in enumerate(adapters.items())
        ]
        release.kubectl("apply", "-f", "-", input="---\n".join(docs))
        soak = Soak(release, rng, adapters, sources, args, hub, Path(tmp) / "a0")
        wait_for(lambda: soak.converged()[0], 600, "every adapter Ready before the soak", interval=2)
        soak.t0 = time.monotonic()
        rss_start = soak.rss()
        threads = [threading.Thread(target=soak.client, args=(s,), daemon=True)
                   for s in range(args.seed, args.seed + args.clients)]  # fmt: skip
        threads.append(threading.Thread(target=soak.sample, daemon=True))
        for t in threads:
            t.start()
        deadline = time.monotonic() + args.minutes * 60
        for kind in schedule(args, rng):
            if time.monotonic() + args.fault_every > deadline:
                break
            time.sleep(args.fault_every)
            fault = soak.inject(kind)
            time.sleep(max(0.0, fault.ended - soak.now()))  # an outage runs alone
        last_fault = max((f.ended for f in soak.faults), default=soak.now())
        try:
            wait_for(lambda: soak.converged()[0], args.converge_timeout + 120, "convergence after the last fault", 2)
            converged_after: float | None = round(soak.now() - last_fault, 1)
        except TimeoutError:
            converged_after = None
        reason = soak.converged()[1]
        in_time = converged_after is not None and converged_after <= args.converge_timeout
        diagnostics = {} if in_time else soak.diagnostics()
        settle_until = time.monotonic() + args.settle  # converged must stay converged (no flapping)
        time.sleep(max(0.0, max(deadline, settle_until) - time.monotonic()))
        for follower in soak.followers:  # each Hub-outage object: Ready, then deleted and gone
            follower.join(args.converge_timeout + 300)
        soak.stop.set()
        for t in threads:
            t.join(150)
        with contextlib.suppress(Exception):  # a last sample, so that each object's convergence time is known
            soak.samples.append({"t": soak.now(), "ok": soak.object_states()})
        report = build_report(soak, args, rss_start, converged_after, reason, last_fault)
        report["diagnostics"] = diagnostics
        args.report.write_text(json.dumps(report, indent=1) + "\n")
        plot = args.plot or args.report.with_suffix(".png")
        soak_report.plot_timeline(report, plot)
        print(json.dumps(report["invariants"], indent=1))
        print(f"soak: report {args.report.resolve()}, timeline {plot.resolve()}", flush=True)
        print(verdict(report["invariants"]), flush=True)  # last, so that a log's tail names what failed
        release.helm("uninstall", release.name, check=False)
        cluster.kubectl("delete", "namespace", release.namespace, "--wait=false", check=False)
    return 0 if all(v["ok"] for v in report["invariants"].values()) else 1


def verdict(invariants: dict[str, dict[str, Any]], width: int = 600) -> str:
    """One line naming each invariant that failed with its figures (each cut to ``width`` characters), so
    that the tail of a log (all CI keeps) says what failed."""
    failed = {name: {k: v for k, v in inv.items() if k != "ok"} for name, inv in invariants.items() if not inv["ok"]}
    if not failed:
        return f"soak: every invariant held ({', '.join(invariants)})"
    return "soak: FAILED " + "; ".join(f"{name} {json.dumps(fields)[:width]}" for name, fields in failed.items())


def build_report(
    soak: Soak,
    args: argparse.Namespace,
    rss_start: dict[str, int],
    converged_after: float | None,
    reason: str,
    last_fault: float,
) -> dict[str, Any]:
    def through_killed_router(o: Outcome) -> bool:
        """A connection-level failure (no HTTP answer) in flight when its router was killed, or sent to it before
        its pod turned unready (30 s). An HTTP status came from a live router: never excused."""
        if o.result.startswith("http-"):
            return False
        return any(o.router.startswith(url) and o.started - 30 <= t <= o.ended + 1 for url, t in soak.killed_routers)

    outcomes = soak.outcomes
    since = None if converged_after is None else last_fault + converged_after
    flaps = [] if since is None else soak_report.flaps(soak.samples, since)
    nonstream_failed = [o for o in outcomes if not o.stream and o.result != "ok" and not through_killed_router(o)]
    broken = [o for o in outcomes if o.stream and o.result != "ok"]
    unexplained = soak_report.unexplained_breaks(
        [asdict(o) for o in broken if not through_killed_router(o)], [asdict(f) for f in soak.faults]
    )
    rss_end = soak.rss()
    growth = {k: rss_end[k] - v for k, v in rss_start.items() if k in rss_end}
    tracebacks, traceback_texts = soak.tracebacks()
    timeline = [asdict(o) for o in outcomes]
    seconds = soak_report.seconds_of({"timeline": timeline, "faults": [asdict(f) for f in soak.faults]})
    syncs = [{**asdict(c), "showed_failure": c.showed_failure} for c in soak.syncs]
    return {
        "seed": args.seed,
        "minutes": args.minutes,
        "workers": args.workers,
        "adapters": args.adapters,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "requests": dict(Counter(f"{'stream' if o.stream else 'plain'}:{o.result}" for o in outcomes)),
        "faults": [asdict(f) for f in soak.faults],
        "outcomes_per_second": soak_report.outcome_series(timeline, seconds),
        "convergence": {
            "last_fault_ended": last_fault,
            "seconds_after_last_fault": soak_report.convergence_times(soak.samples, last_fault),
            "samples": soak.samples,
        },
        "sync_outages": syncs,
        "invariants": {
            "nonstream_failures": {
                "ok": not nonstream_failed,
                "count": len(nonstream_failed),
                "first": [asdict(o) for o in nonstream_failed[:5]],
            },
            "streams_broken": {
                "ok": not unexplained,
                "count": len(broken),
                "without_a_kill": len(unexplained),
                "first": [asdict(o) for o in broken[:5]],
            },
            "converged": {
                "ok": converged_after is not None and converged_after <= args.converge_timeout and not flaps,
                "seconds_after_last_fault": converged_after,
                "flaps_after_convergence": flaps[:10],
                "bound_s": args.converge_timeout,
                "state": reason,
            },
            "sync_recovery": {
                "ok": all(c.showed_failure and c.ready_at is not None and c.gone_at is not None for c in soak.syncs),
                "objects": len(soak.syncs),
            },
            "tracebacks": {"ok": not tracebacks, "by_pod": tracebacks, "texts": traceback_texts},
            "rss": {
                "ok": all(g < args.rss_growth for g in growth.values()),
                "growth_mib": growth,
                "bound_mib": args.rss_growth,
            },
        },
        "timeline": timeline,
    }


if __name__ == "__main__":
    sys.exit(main())
