"""Operator at scale: 10,000 DynamoModels over 200 stand-in workers (issue 13, outcome 6).

What is measured is the operator, not the engine: the 200 "workers" are one aiohttp process of
this script serving the management API (``POST/GET/DELETE /v1/loras``) on 200 loopback
addresses (port 9090), each with its own adapter table. Their Pod objects exist in the API
server of the local control plane (bound to a stand-in Node whose heartbeat this script keeps,
status set to Running/Ready with that address), so the operator sees real watch events.
The operator runs as its own process (``lorafleet-operator``) against that API server.

Reported (bench/operator_scale.json): time to converge from a cold start (operator started
with every model and pod present), after +1 pod and after -1 pod; operator CPU seconds per
drift interval in a steady state (and as % of one core); the operator's peak RSS; API server
requests per minute in that steady state (``apiserver_request_total``, which also counts this
script's node heartbeat: 12 a minute). "Converged": every model Ready on exactly its HRW
placement over the Ready pods, and every stand-in holds exactly the adapters placed on it.
Targets: steady CPU < 10 % of a core, +1 pod < 10 s, cold start < 120 s. The operator's CPU
seconds for the cold start and the +1 pod are reported too, with the 1-minute load average:
on a shared machine the wall times are upper bounds, the CPU seconds are the operator's own cost.

    python bench/bench_operator_scale.py [--models 10000] [--workers 200] [--drift-interval 30]
    LORAFLEET_BENCH_SMOKE=1 ...   (500 models, 20 workers, 5 s drift: checks the script)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
from common import SMOKE, log, machine, write_json  # noqa: E402

BASE = "bench/base"
NODE = "lorafleet-bench-standin"
MGMT_PORT = 9090


class StandIns:
    """Many workers' management APIs in one process: one adapter table per address."""

    def __init__(self) -> None:
        self.loras: defaultdict[str, dict[str, str]] = defaultdict(dict)
        self.calls = 0
        self.runner: web.AppRunner | None = None

    def _ip(self, request: web.Request) -> str:
        return str(request.transport.get_extra_info("sockname")[0]) if request.transport else ""

    async def load(self, request: web.Request) -> web.Response:
        self.calls += 1
        body = await request.json()
        self.loras[self._ip(request)][body["lora_name"]] = body["source"]["uri"]
        return web.json_response({"status": "success", "message": "ok", "lora_name": body["lora_name"], "lora_id": 1})

    async def list(self, request: web.Request) -> web.Response:
        self.calls += 1
        names = self.loras[self._ip(request)]
        return web.json_response({"status": "success", "loras": dict.fromkeys(names, 1), "count": len(names)})

    async def unload(self, request: web.Request) -> web.Response:
        self.calls += 1
        name = request.match_info["name"]
        if self.loras[self._ip(request)].pop(name, None) is None:
            return web.json_response({"status": "error", "message": "not loaded"}, status=404)
        return web.json_response({"status": "success", "message": "unloaded", "lora_name": name, "lora_id": 1})

    async def start(self, addresses: list[str]) -> None:
        app = web.Application()
        app.add_routes([web.post("/v1/loras", self.load), web.get("/v1/loras", self.list),
                        web.delete("/v1/loras/{name:.+}", self.unload)])  # fmt: skip
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        for ip in addresses:
            await web.TCPSite(self.runner, ip, MGMT_PORT).start()


def pod_doc(name: str) -> dict[str, Any]:
    from lorafleet_sync.ids import BASE_MODEL_HASH_LABEL, base_model_hash

    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {BASE_MODEL_HASH_LABEL: base_model_hash(BASE), "app": "standin"}},
            "spec": {"nodeName": NODE, "containers": [{"name": "w", "image": "standin"}]}}  # fmt: skip


def model_doc(i: int) -> dict[str, Any]:
    return {"apiVersion": "nvidia.com/v1alpha1", "kind": "DynamoModel", "metadata": {"name": f"m-{i:05d}"},
            "spec": {"modelName": f"scale/lora-{i:05d}", "baseModelName": BASE, "modelType": "lora",
                     "source": {"uri": f"s3://bench/lora-{i % 16}"}}}  # fmt: skip


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Bench:
    def __init__(self, kube: Any, ns: str, standins: StandIns) -> None:
        self.kube, self.ns, self.standins = kube, ns, standins
        self.pods: dict[str, str] = {}  # pod name -> address
        self._held: tuple[object, defaultdict[str, set[str]]] = (None, defaultdict(set))  # expected -> per address
        self.polls = 0  # LISTs of the DynamoModels by ``converged`` (left out of the operator's requests)

    async def heartbeat(self) -> None:
        """Keep the stand-in Node Ready (Lease + condition) so no controller marks its pods NotReady."""
        lease_path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{NODE}"
        while True:
            stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            cond = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "stand-in",
                    "lastHeartbeatTime": now(), "lastTransitionTime": now()}  # fmt: skip
            try:  # a slow or failed beat must not end the loop: the node would go NotReady with its pods
                await self.kube.merge_patch(lease_path, {"spec": {"renewTime": stamp}})
                await self.kube.request("PATCH", f"/api/v1/nodes/{NODE}/status", {"status": {"conditions": [cond]}},
                                        content_type="application/strategic-merge-patch+json")  # fmt: skip
            except Exception as e:
                log(f"node heartbeat failed (retrying in 2 s): {e!r}")
                await asyncio.sleep(2)
                continue
            await asyncio.sleep(10)

    async def add_node(self) -> None:
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": {"lorafleet/standin": "1"}}}
        if await self.kube.get(f"/api/v1/nodes/{NODE}") is None:
            await self.kube.create("/api/v1/nodes", node)
        lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": NODE},
                 "spec": {"holderIdentity": NODE, "leaseDurationSeconds": 40, "renewTime": None}}  # fmt: skip
        if await self.kube.get(f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{NODE}") is None:
            await self.kube.create("/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases", lease)

    async def add_pod(self, name: str, ip: str) -> None:
        await self.kube.create(f"/api/v1/namespaces/{self.ns}/pods", pod_doc(name))
        status = {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                  "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now()}]}  # fmt: skip
        await self.kube.merge_patch(f"/api/v1/namespaces/{self.ns}/pods/{name}/status", {"status": status})
        self.pods[name] = ip

    async def remove_pod(self, name: str) -> None:
        await self.kube.request("DELETE", f"/api/v1/namespaces/{self.ns}/pods/{name}", {"gracePeriodSeconds": 0})
        self.pods.pop(name)

    async def create_all(self, docs: list[dict[str, Any]], path: str, concurrency: int = 32) -> None:
        queue = list(reversed(docs))

        async def worker() -> None:
            while queue:
                await self.kube.create(path, queue.pop())

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    def held_as_placed(self, expected: dict[str, list[str]]) -> bool:
        """Every stand-in holds exactly the adapters placed on it (read in this process: free)."""
        if self._held[0] is not expected:
            held: defaultdict[str, set[str]] = defaultdict(set)
            for name, pods in expected.items():
                for pod in pods:
                    held[self.pods[pod]].add(name)
            self._held = (expected, held)
        held = self._held[1]
        return all(self.standins.loras[ip].keys() == held[ip] for ip in self.pods.values())

    async def converged(self, expected: dict[str, list[str]]) -> bool:
        # Converged needs both the workers and the statuses; the LIST of every DynamoModel (tens of
        # MB, a CPU second or more of the API server and of this script on the 2 cores the operator
        # shares) is only asked once the workers already hold what they should.
        if not self.held_as_placed(expected):
            return False
        self.polls += 1
        listing = await self.kube.request("GET", f"/apis/nvidia.com/v1alpha1/namespaces/{self.ns}/dynamomodels",
                                          timeout=120)  # fmt: skip
        items = listing.get("items") or []
        for item in items:
            status = item.get("status") or {}
            if status.get("phase") != "Ready" or status.get("placement") != expected[item["spec"]["modelName"]]:
                return False
        return len(items) == len(expected) and self.held_as_placed(expected)

    @staticmethod
    def expected(names: list[str], pods: list[str]) -> dict[str, list[str]]:
        """Each model's HRW placement over ``pods``: computed before the change it is waited for (2M
        hashes at 10,000 models: seconds of this process, which also serves the stand-ins)."""
        from lorafleet_operator.placement import place

        return {n: place(n, pods, 2) for n in names}

    async def wait_converged(self, expected: dict[str, list[str]], timeout: float) -> float:
        """Seconds until ``converged``: the stand-ins are checked every 0.2 s (free), the DynamoModels
        listed at most once a second, once the stand-ins hold what they should."""
        started = last_list = time.monotonic()
        while True:
            if self.held_as_placed(expected) and time.monotonic() - last_list >= 1:
                last_list = time.monotonic()
                if await self.converged(expected):
                    return time.monotonic() - started
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"not converged after {timeout:.0f} s")
            await asyncio.sleep(0.2)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_by_process(cluster: Any, operator_pid: int) -> dict[str, float]:
    """CPU seconds so far of the operator, the control plane's processes and this script (stand-ins included)."""
    pids = {"operator": operator_pid, **(cluster.local.pids if cluster.local is not None else {})}
    out: dict[str, float] = {}
    for name, pid in pids.items():
        try:
            out[name] = cpu_seconds(pid)
        except OSError:
            continue
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["bench script and stand-ins"] = usage.ru_utime + usage.ru_stime
    return out


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def requests_between(before: dict[str, float], after: dict[str, float], polls: int = 0) -> dict[str, int]:
    """Requests per "VERB resource" between two ``api_requests`` readings, most first; ``polls`` LISTs of
    the DynamoModels made by this script's convergence check are left out."""
    out = {k: round(after[k] - before.get(k, 0)) for k in after}
    out["LIST dynamomodels"] = out.get("LIST dynamomodels", 0) - polls
    return dict(sorted(((k, v) for k, v in out.items() if v > 0), key=lambda kv: -kv[1]))


def api_requests(cluster: Any) -> dict[str, float]:
    """``apiserver_request_total`` summed per "VERB resource"."""
    out: defaultdict[str, float] = defaultdict(float)
    for line in cluster.kubectl("get", "--raw", "/metrics").stdout.splitlines():
        if line.startswith("apiserver_request_total{"):
            labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1 : line.rindex("}")].split(","))
            key = f"{labels.get('verb', '').strip(chr(34))} {labels.get('resource', '').strip(chr(34))}"
            out[key] += float(line.rsplit(" ", 1)[1])
    return out


async def run(cluster: Any, args: argparse.Namespace) -> dict[str, Any]:
    from lorafleet_devcluster.nodeagent import AddressBlock
    from lorafleet_devcluster.rawstack import install_crd
    from lorafleet_operator.kube import KubeClient

    install_crd(cluster)
    ns = cluster.new_namespace("scale")
    os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
    kube = KubeClient.from_environment()
    block = AddressBlock()
    addresses = [block.take() for _ in range(args.workers + 1)]
    standins = StandIns()
    await standins.start(addresses)
    bench = Bench(kube, ns, standins)
    await bench.add_node()
    beat = asyncio.create_task(bench.heartbeat())
    operator: subprocess.Popen[bytes] | None = None
    try:
        t0 = time.monotonic()
        await asyncio.gather(*(bench.add_pod(f"standin-{i:03d}", addresses[i]) for i in range(args.workers)))
        await bench.create_all([model_doc(i) for i in range(args.models)],
                               f"/apis/nvidia.com/v1alpha1/namespaces/{ns}/dynamomodels")  # fmt: skip
        log(f"{args.workers} pods and {args.models} DynamoModels created in {time.monotonic() - t0:.1f} s")
        names = [model_doc(i)["spec"]["modelName"] for i in range(args.models)]
        profile = ["-m", "cProfile", "-o", args.profile] if args.profile else []
        cmd = [sys.executable, *profile, "-m", "lorafleet_operator.cli", "--namespace", ns, "--drift-interval",
               str(args.drift_interval), "--liveness-port", "0", "--metrics-port", "0", "--bind-host", "127.0.0.1",
               "--reconcile-workers", "32", "--max-concurrent-calls", "64", "--unload-grace", "1"]  # fmt: skip
        cold_expected = bench.expected(names, list(bench.pods))
        req_cold = api_requests(cluster)
        bench.polls = 0
        log_path = Path(tempfile.mkdtemp(prefix="lorafleet-scale-")) / "operator.log"
        log(f"operator log: {log_path}")
        with log_path.open("wb") as log_file:
            operator = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=os.environ.copy())
        cpu_cold = cpu_by_process(cluster, operator.pid)
        load_start = os.getloadavg()
        cold = await bench.wait_converged(cold_expected, args.timeout)
        cold_cpu = cpu_seconds(operator.pid)
        log(f"cold start converged in {cold:.1f} s ({cold_cpu:.1f} operator CPU s, load {os.getloadavg()[0]:.1f})")
        cpu_cold = {k: round(v - cpu_cold.get(k, 0), 1) for k, v in cpu_by_process(cluster, operator.pid).items()}
        log(f"cold start CPU seconds by process: {cpu_cold}")
        cold_kinds = requests_between(req_cold, api_requests(cluster), bench.polls)
        log(f"cold start API requests by verb and resource (the script's own {bench.polls} polls left out): "
            f"{cold_kinds}")  # fmt: skip

        await asyncio.sleep(args.drift_interval)  # let the cold start's tail (Events, kopf) drain
        cpu0, req0, t1 = cpu_seconds(operator.pid), api_requests(cluster), time.monotonic()
        await asyncio.sleep(args.drift_interval * args.intervals)
        elapsed = time.monotonic() - t1
        cpu = (cpu_seconds(operator.pid) - cpu0) / args.intervals
        req1 = api_requests(cluster)
        per_kind = {k: round((req1[k] - req0.get(k, 0)) / elapsed * 60) for k in req1 if req1[k] > req0.get(k, 0)}
        rpm = sum(per_kind.values())
        top = dict(sorted(per_kind.items(), key=lambda kv: -kv[1])[:6])
        log(f"API requests/min by verb and resource: {top}")
        log(f"steady state: {cpu:.2f} CPU s per {args.drift_interval:g} s drift interval "
            f"({100 * cpu / args.drift_interval:.1f} % of a core), {rpm:.0f} API requests/min")  # fmt: skip

        load_steady = os.getloadavg()
        added = f"standin-{args.workers:03d}"
        plus_expected = bench.expected(names, [*bench.pods, added])
        await bench.add_pod(added, addresses[args.workers])
        cpu_before = cpu_seconds(operator.pid)
        plus = await bench.wait_converged(plus_expected, args.timeout)
        plus_cpu = cpu_seconds(operator.pid) - cpu_before
        log(f"+1 pod converged in {plus:.1f} s ({plus_cpu:.1f} operator CPU s)")
        minus_expected = bench.expected(names, [p for p in bench.pods if p != "standin-000"])
        await bench.remove_pod("standin-000")
        standins.loras.pop(addresses[0], None)  # the pod is gone with its adapters
        minus = await bench.wait_converged(minus_expected, args.timeout)
        log(f"-1 pod converged in {minus:.1f} s")
        rss = peak_rss_mib(operator.pid)
        return {
            "models": args.models, "workers": args.workers, "drift_interval_s": args.drift_interval,
            "cold_start_s": round(cold, 1), "plus_one_pod_s": round(plus, 1), "minus_one_pod_s": round(minus, 1),
            "cold_start_operator_cpu_s": round(cold_cpu, 1), "cold_start_api_requests": sum(cold_kinds.values()),
            "cold_start_api_requests_by_kind": cold_kinds, "cold_start_cpu_s_by_process": cpu_cold,
            "plus_one_pod_operator_cpu_s": round(plus_cpu, 2),
            "loadavg_1min": {"cold_start_begin": round(load_start[0], 2), "steady_state_end": round(load_steady[0], 2),
                             "end": round(os.getloadavg()[0], 2)},
            "steady_cpu_s_per_interval": round(cpu, 3), "steady_cpu_percent": round(100 * cpu / args.drift_interval, 2),
            "peak_rss_mib": round(rss, 1), "api_requests_per_min": round(rpm), "api_requests_by_kind": per_kind,
            "targets": {"steady_cpu_percent_lt": 10, "plus_one_pod_s_lt": 10, "cold_start_s_lt": 120},
        }  # fmt: skip
    finally:
        if operator is not None:
            operator.terminate()
            operator.wait(30)
        beat.cancel()
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        cluster.kubectl("delete", "node", NODE, "--wait=false", check=False)
        if standins.runner is not None:
            await standins.runner.cleanup()
        await kube.close()
        block.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=int, default=500 if SMOKE else 10_000)
    ap.add_argument("--workers", type=int, default=20 if SMOKE else 200)
    ap.add_argument("--drift-interval", type=float, default=5.0 if SMOKE else 30.0)
    ap.add_argument("--intervals", type=int, default=3, help="drift intervals measured in the steady state")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--profile", default="", help="write a cProfile of the operator process to this file")
    args = ap.parse_args()
    from lorafleet_devcluster.session import shared_cluster

    with shared_cluster() as cluster:
        result = asyncio.run(run(cluster, args))
    write_json("operator_scale", {"machine": machine(), "result": result})


if __name__ == "__main__":
    main()
