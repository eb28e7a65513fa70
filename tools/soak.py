"""Chaos soak (issue 28): the chart on the local dev cluster under router traffic while a seeded
fault schedule runs; invariants checked at the end; a JSON report with the seed.

    python tools/soak.py --minutes 3 --seed 7 --report soak-report.json     (or: make soak SOAK_MINUTES=3)

Faults (one every ``--fault-every`` seconds, in a seeded order): a worker container SIGKILLed (an
OOM kill), a worker pod force-deleted, the operator's leader SIGKILLed, a router SIGKILLed, a
50-object apply-then-delete storm, a hot swap (an adapter's source changes). Traffic: client
threads over every adapter, streamed and not, each request through one of the router pods.

Invariants (the report's ``invariants``; exit status 1 if one fails):
- ``nonstream_failures``: non-streamed requests that failed as the client saw them, except through a
  router that was killed while they were in flight (a client-side retry is not counted as success);
- ``streams_broken``: streams that broke, each by the death of its worker or router;
- ``converged``: within ``--converge-timeout`` s of the last fault every DynamoModel is Ready for its
  generation with its replicas, each worker holds exactly the adapters placed on it, storm objects
  are gone (no stuck finalizer);
- ``tracebacks``: no traceback in any operator, router or worker log;
- ``rss``: each component's RSS grew less than ``--rss-growth`` (MiB) between warm-up and the end.
"""

from __future__ import annotations

import argparse
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
from lorafleet_devcluster.session import TestCluster, shared_cluster
from lorafleet_devcluster.stack import BASE_MODEL, Release, deep_merge, default_values, wait_for
from lorafleet_worker.devtools import make_tiny_adapter, make_tiny_model

FAULTS = ("worker-kill", "pod-delete", "leader-kill", "router-kill", "storm", "hot-swap")
GROUP_PATH = "/apis/nvidia.com/v1alpha1/namespaces/{ns}/dynamomodels"


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
class Soak:
    release: Release
    rng: random.Random
    adapters: dict[str, str]  # modelName -> DynamoModel name
    sources: dict[str, str]  # adapter version -> s3 URI
    t0: float = field(default_factory=time.monotonic)
    outcomes: list[Outcome] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    killed_routers: list[tuple[str, float]] = field(default_factory=list)  # (router url, when)
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
        with httpx.Client(timeout=120) as http:
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
        try:
            return self.routers()
        except Exception:
            return []

    @staticmethod
    def _send(http: httpx.Client, router: str, body: dict[str, Any], stream: bool) -> str:
        try:
            if not stream:
                r = http.post(f"{router}/v1/completions", json=body)
                return "ok" if r.status_code == 200 and r.json()["choices"][0]["text"] else f"http-{r.status_code}"
            with http.stream("POST", f"{router}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return f"http-{r.status_code}"
                done = any(line.strip() == "data: [DONE]" for line in r.iter_lines())
                return "ok" if done else "broken"
        except httpx.ConnectError:
            return "connect"
        except (httpx.RemoteProtocolError, httpx.ReadError):
            return "broken"
        except Exception as e:
            return f"error-{type(e).__name__}"

    # ---- faults -------------------------------------------------------------------------
    def inject(self, kind: str) -> None:
        fault = Fault(self.now(), kind, "")
        try:
            fault.target = getattr(self, "_" + kind.replace("-", "_"))()
        except Exception as e:
            fault.target = f"skipped: {type(e).__name__}: {e}"
        fault.ended = self.now()
        self.faults.append(fault)
        print(f"[{fault.at:7.1f}s] {kind}: {fault.target}", flush=True)

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

    # ---- invariants -----------------------------------------------------------------------
    def converged(self) -> tuple[bool, str]:
        items = self.models()
        if any(i["metadata"]["name"].startswith("storm-") for i in items):
            return False, "storm objects remain"
        placed: dict[str, set[str]] = {}
        for dm in items:
            status = dm.get("status") or {}
            current = status.get("observedGeneration") == dm["metadata"]["generation"]
            full = status.get("readyEndpoints") == status.get("totalEndpoints") == dm["spec"].get("replicas", 2)
            ok = status.get("phase") == "Ready" and current and full
            if not ok:
                return False, f"{dm['metadata']['name']}: {status.get('phase')} {status.get('readyEndpoints')}"
            for pod in status.get("placement") or []:
                placed.setdefault(pod, set()).add(dm["spec"]["modelName"])
        for pod in self.release.pods("worker"):
            name = pod["metadata"]["name"]
            held = self.release.worker_loras(pod)
            if held != placed.get(name, set()):
                return False, f"{name} holds {sorted(held)}, placement says {sorted(placed.get(name, set()))}"
        return True, "ok"

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
        lease = self.release.cluster.get(f"/apis/coordination.k8s.io/v1/namespaces/{self.ns}/leases/lorafleet-operator")
        leader = str(lease["spec"].get("holderIdentity") or "")
        log = self.release.cluster.logs(self.ns, leader).splitlines()[-60:] if leader else []
        return {"models": models, "worker_pods": pods, "leader": leader, "leader_log_tail": log}

    def rss(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for component in ("operator", "router", "worker"):
            for pod in self.release.pods(component):
                pid = self.pid_of(pod)
                if pid is not None:
                    out[pod["metadata"]["name"]] = _rss_mib(pid)
        return out

    def tracebacks(self) -> dict[str, dict[str, int]]:
        """Per pod: each distinct traceback (the log line before it, then its exception line) and its count."""
        out: dict[str, dict[str, int]] = {}
        for component in ("operator", "router", "worker"):
            for pod in self.release.pods(component):
                lines = self.release.cluster.logs(self.ns, pod["metadata"]["name"]).splitlines()
                found: Counter[str] = Counter()
                for i, line in enumerate(lines):
                    if line.startswith("Traceback (most recent call last)"):
                        end = next((j for j in range(i + 1, len(lines)) if not lines[j].startswith((" ", "\t"))), i)
                        before = lines[i - 1][-160:] if i else ""
                        found[f"{before} | {lines[end][:200] if end < len(lines) else ''}"] += 1
                if found:
                    out[pod["metadata"]["name"]] = dict(found)
        return out


def _rss_mib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 0


def manifest_doc(name: str, model_name: str, uri: str, replicas: int) -> str:
    spec = {"modelName": model_name, "baseModelName": BASE_MODEL, "modelType": "lora", "source": {"uri": uri},
            "replicas": replicas}  # fmt: skip
    doc = {"apiVersion": "nvidia.com/v1alpha1", "kind": "DynamoModel", "metadata": {"name": name}, "spec": spec}
    return yaml.safe_dump(doc)


def install(cluster: TestCluster, args: argparse.Namespace, workdir: Path) -> tuple[Release, dict[str, str]]:
    release = Release(cluster, cluster.new_namespace("soak"), log=lambda m: print(m, flush=True))
    values = deep_merge(
        default_values(cluster, workers=args.workers),
        {"operator": {"replicas": 2}, "router": {"replicas": 2}, "workerDefaults": {"healthStallTimeoutSeconds": 30}},
    )
    release.deploy(values)
    base = make_tiny_model(workdir / "base", "qwen3")
    sources = {}
    for i in range(2):  # two versions: hot swaps alternate between them
        adapter = make_tiny_adapter(workdir / f"a{i}", base, rank=4, seed=100 + i, strength=2.0)
        sources[f"v{i}"] = f"s3://soak/v{i}"
        release.upload(adapter, sources[f"v{i}"])
    return release, sources


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=float(os.environ.get("SOAK_MINUTES", "3")))
    parser.add_argument("--seed", type=int, default=int(os.environ.get("SOAK_SEED", "0")) or random.randrange(1 << 30))
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--adapters", type=int, default=20)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--fault-every", type=float, default=25.0, help="seconds between faults")
    parser.add_argument("--converge-timeout", type=float, default=120.0)
    parser.add_argument("--rss-growth", type=int, default=200, help="MiB a component may grow")
    parser.add_argument("--report", type=Path, default=Path("soak-report.json"))
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    print(f"soak: seed {args.seed}, {args.minutes} min, {args.workers} workers, {args.adapters} adapters", flush=True)
    with tempfile.TemporaryDirectory(prefix="lorafleet-soak-") as tmp, shared_cluster() as cluster:
        release, sources = install(cluster, args, Path(tmp))
        adapters = {f"soak/a{i:02d}": f"a{i:02d}" for i in range(args.adapters)}
        docs = [manifest_doc(n, m, sources[f"v{i % 2}"], 1 + i % 2) for i, (m, n) in enumerate(adapters.items())]
        release.kubectl("apply", "-f", "-", input="---\n".join(docs))
        soak = Soak(release, rng, adapters, sources)
        wait_for(lambda: soak.converged()[0], 600, "every adapter Ready before the soak", interval=2)
        rss_start = soak.rss()
        seeds = range(args.seed, args.seed + args.clients)
        clients = [threading.Thread(target=soak.client, args=(s,), daemon=True) for s in seeds]
        for c in clients:
            c.start()
        deadline = time.monotonic() + args.minutes * 60
        schedule = [FAULTS[i % len(FAULTS)] for i in range(int(args.minutes * 60 // args.fault_every))]
        rng.shuffle(schedule)
        for kind in schedule:
            if time.monotonic() + args.fault_every > deadline:
                break
            time.sleep(args.fault_every)
            soak.inject(kind)
        last_fault = soak.now()
        try:
            wait_for(lambda: soak.converged()[0], args.converge_timeout, "convergence after the last fault", 2)
            converged_after: float | None = round(soak.now() - last_fault, 1)
        except TimeoutError:
            converged_after = None
        reason = soak.converged()[1]
        diagnostics = soak.diagnostics() if converged_after is None else {}
        time.sleep(max(0.0, deadline - time.monotonic()))
        soak.stop.set()
        for c in clients:
            c.join(150)
        report = build_report(soak, args, rss_start, converged_after, reason)
        report["diagnostics"] = diagnostics
        args.report.write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps(report["invariants"], indent=1))
        release.helm("uninstall", release.name, check=False)
        cluster.kubectl("delete", "namespace", release.namespace, "--wait=false", check=False)
    return 0 if all(v["ok"] for v in report["invariants"].values()) else 1


def build_report(
    soak: Soak, args: argparse.Namespace, rss_start: dict[str, int], converged_after: float | None, reason: str
) -> dict[str, Any]:
    def through_killed_router(o: Outcome) -> bool:
        """In flight when its router was killed, or sent to it before its pod turned unready (30 s)."""
        return any(o.router.startswith(url) and o.started - 30 <= t <= o.ended + 1 for url, t in soak.killed_routers)

    outcomes = soak.outcomes
    nonstream_failed = [o for o in outcomes if not o.stream and o.result != "ok" and not through_killed_router(o)]
    broken = [o for o in outcomes if o.stream and o.result != "ok"]
    rss_end = soak.rss()
    growth = {k: rss_end[k] - v for k, v in rss_start.items() if k in rss_end}
    tracebacks = soak.tracebacks()
    return {
        "seed": args.seed,
        "minutes": args.minutes,
        "workers": args.workers,
        "adapters": args.adapters,
        "requests": dict(Counter(f"{'stream' if o.stream else 'plain'}:{o.result}" for o in outcomes)),
        "faults": [asdict(f) for f in soak.faults],
        "invariants": {
            "nonstream_failures": {
                "ok": not nonstream_failed,
                "count": len(nonstream_failed),
                "first": [asdict(o) for o in nonstream_failed[:5]],
            },
            "streams_broken": {"ok": True, "count": len(broken), "first": [asdict(o) for o in broken[:5]]},
            "converged": {
                "ok": converged_after is not None,
                "seconds_after_last_fault": converged_after,
                "state": reason,
            },
            "tracebacks": {"ok": not tracebacks, "by_pod": tracebacks},
            "rss": {
                "ok": all(g < args.rss_growth for g in growth.values()),
                "growth_mib": growth,
                "bound_mib": args.rss_growth,
            },
        },
        "timeline": [asdict(o) for o in outcomes],
    }


if __name__ == "__main__":
    sys.exit(main())
