"""Fixtures for operator tests: a small real HTTP server implementing the workers' management API.

``MgmtWorker`` follows the SPEC §3 contract (POST/GET/DELETE /v1/loras, Dynamo bodies, real HTTP
errors) and records every call, so reconcile tests can assert exactly what the operator did.
A URI containing ``invalid`` is rejected with 400 like a corrupt adapter; ``fail_next`` makes
the next loads fail with 502 (source unreachable); ``capacity`` (``--max-loaded-loras``) is
reported by ``GET /v1/loras`` and enforced with 507 like the real worker. ``PUT /v1/loras/catalog``
replaces its catalogue (``serves_catalog=False``: an older worker, 405); ``serve`` stands for an
inference request: a catalogued adapter it does not hold is loaded on demand (unpinned: false in
the listing's ``pinned`` map).

``real_fleet`` starts real ``lorafleet-worker serve`` processes laid out like pods (own
127.0.B.x address, ports 8000/9090) for the integration tests of reconcile and router.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from lorafleet_devcluster.nodeagent import AddressBlock
from lorafleet_operator.controller import Runtime
from lorafleet_operator.ledger import MemoryLedger
from lorafleet_operator.reconcile import Reconciler
from lorafleet_operator.resources import Model, Pod
from lorafleet_operator.settings import OperatorSettings
from lorafleet_operator.workers import WorkerClient
from lorafleet_sync.ids import BASE_MODEL_HASH_LABEL, base_model_hash, lora_id

_hosts = itertools.count(20)
BASE = "tiny/base"


@dataclass
class MgmtWorker:
    host: str
    token: str | None = None
    loras: dict[str, str] = field(default_factory=dict)  # name -> uri
    calls: list[tuple[str, str]] = field(default_factory=list)  # (method, name)
    fail_next: int = 0
    capacity: int | None = None
    catalog: list[tuple[str, str]] | None = None  # (name, uri) last PUT; None: never told
    serves_catalog: bool = True
    on_demand: set[str] = field(default_factory=set)  # names in ``loras`` loaded by ``serve``, not pinned
    runner: web.AppRunner | None = None
    port: int = 0

    @property
    def address(self) -> str:
        return f"http://{self.host}:{self.port}"

    def posts(self, name: str) -> int:
        return sum(1 for m, n in self.calls if m == "POST" and n == name)

    def _auth(self, request: web.Request) -> web.Response | None:
        if self.token and request.headers.get("Authorization") != f"Bearer {self.token}":
            return _error(401, "missing or wrong admin token")
        return None

    async def load(self, request: web.Request) -> web.Response:
        if (denied := self._auth(request)) is not None:
            return denied
        try:
            body = await request.json()
            name, uri = body["lora_name"], body["source"]["uri"]
        except (ValueError, KeyError, TypeError):
            return _error(400, "malformed request")
        self.calls.append(("POST", name))
        if self.fail_next > 0:
            self.fail_next -= 1
            return _error(502, f"{uri}: source unreachable")
        if "invalid" in uri:
            return _error(400, f"{uri}: adapter rank 512 exceeds --max-lora-rank 64")
        if name not in self.loras and self.capacity is not None and len(self.loras) >= self.capacity:
            return _error(507, f"cannot load {name}: {self.capacity} adapters loaded (--max-loaded-loras)")
        self.loras[name] = uri
        self.on_demand.discard(name)  # pinned from now on
        return web.json_response({"status": "success", "message": "ok", "lora_name": name, "lora_id": lora_id(name)})

    async def list(self, request: web.Request) -> web.Response:
        if (denied := self._auth(request)) is not None:
            return denied
        self.calls.append(("GET", ""))
        loras = {n: lora_id(n) for n in self.loras}
        pinned = {n: n not in self.on_demand for n in self.loras}
        body = {"status": "success", "loras": loras, "count": len(loras), "capacity": self.capacity, "pinned": pinned}
        return web.json_response(body)

    async def put_catalog(self, request: web.Request) -> web.Response:
        if not self.serves_catalog:
            return web.json_response({"detail": "Method Not Allowed"}, status=405)
        if (denied := self._auth(request)) is not None:
            return denied
        body = await request.json()
        self.calls.append(("PUT", "catalog"))
        self.catalog = [(a["lora_name"], a["source"]["uri"]) for a in body["adapters"]]
        return web.json_response({"status": "success", "count": len(self.catalog)})

    def serve(self, name: str) -> bool:
        """An inference request for ``name``: True when served (held, or catalogued and loaded on demand)."""
        if name in self.loras:
            return True
        uri = dict(self.catalog or []).get(name)
        if uri is None:
            return False
        self.loras[name] = uri
        self.on_demand.add(name)
        return True

    async def unload(self, request: web.Request) -> web.Response:
        if (denied := self._auth(request)) is not None:
            return denied
        name = request.match_info["name"]
        self.calls.append(("DELETE", name))
        self.on_demand.discard(name)
        if self.loras.pop(name, None) is None:
            return _error(404, f"adapter {name} not found")
        return web.json_response(
            {"status": "success", "message": "unloaded", "lora_name": name, "lora_id": lora_id(name)}
        )

    async def start(self, port: int = 0) -> None:
        app = web.Application()
        app.add_routes(
            [
                web.post("/v1/loras", self.load),
                web.get("/v1/loras", self.list),
                web.put("/v1/loras/catalog", self.put_catalog),
                web.delete("/v1/loras/{name:.+}", self.unload),
            ]
        )
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, port)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def restart(self) -> None:
        """Lose every adapter (a worker process restart) and come back on the same port."""
        await self.stop()
        self.loras.clear()
        self.on_demand.clear()
        self.catalog = None
        await self.start(self.port)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"status": "error", "message": message}, status=status)


@pytest.fixture
async def mgmt_workers() -> AsyncIterator[list[MgmtWorker]]:
    """Five management servers on distinct loopback addresses 127.0.0.x (x from 20 up), one port."""
    workers = [MgmtWorker(host=f"127.0.0.{next(_hosts) % 200 + 20}") for _ in range(5)]
    await workers[0].start()
    for w in workers[1:]:  # one port on every address, like the workers' fixed system port
        await w.start(workers[0].port)
    yield workers
    for w in workers:
        await w.stop()


# ---- real `lorafleet-worker serve` processes, laid out like pods --------------------------------
REAL_BASE = "tiny-llama"
MGMT_PORT, INFER_PORT = 9090, 8000


@dataclass
class RealWorker:
    """A worker process on its own loopback address with the pods' fixed ports (8000 / 9090)."""

    name: str
    host: str
    model_dir: Path
    file_root: Path
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def mgmt(self) -> str:
        return f"http://{self.host}:{MGMT_PORT}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{INFER_PORT}"

    def pod(self, ready: bool = True) -> Pod:
        return Pod("ns", self.name, f"uid-{self.name}", self.host, ready, base_model_hash(REAL_BASE))

    def pod_body(self, ready: bool = True) -> dict[str, Any]:
        return pod_body(self.name, self.host, ready, REAL_BASE)

    def spawn(self) -> None:
        env = {**os.environ, "LORAFLEET_FILE_ROOTS": str(self.file_root), "DYN_LORA_PATH": str(self.workdir / "cache")}
        cmd = [
            sys.executable, "-m", "lorafleet_worker", "serve", "--model", str(self.model_dir),
            "--served-model-name", REAL_BASE, "--host", self.host, "--port", str(INFER_PORT),
            "--system-port", str(MGMT_PORT), "--max-lora-rank", "16", "--max-loras", "4",
        ]  # fmt: skip
        log = (self.workdir / "worker.log").open("ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, self.log_tail()
            try:
                if httpx.get(f"{self.mgmt}/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"worker {self.name} not ready:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def loras(self) -> dict[str, int]:
        loras: dict[str, int] = httpx.get(f"{self.mgmt}/v1/loras", timeout=10).json()["loras"]
        return loras

    def log_tail(self) -> str:
        path = self.workdir / "worker.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-40:]) if path.exists() else ""


def requeue_every_model(runtime: Runtime) -> None:
    """Queue every known DynamoModel, as a resync would (the tests' stand-in for the watch's relist)."""
    for key in runtime.index:
        runtime.queue.add(key)


def pod_body(name: str, ip: str | None, ready: bool, base: str, namespace: str = "ns") -> dict[str, Any]:
    """A Pod object as the API server returns it (the fields the operator reads)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}",
                     "labels": {BASE_MODEL_HASH_LABEL: base_model_hash(base)}},
        "status": {"phase": "Running", "podIP": ip,
                   "conditions": [{"type": t, "status": str(ready)} for t in ("ContainersReady", "Ready")]},
    }  # fmt: skip


@dataclass
class RealFleet:
    workers: list[RealWorker]
    adapters: dict[str, Path]  # "a", "b": valid rank-4 adapters; "bad": rank 32 > --max-lora-rank 16
    addresses: AddressBlock  # the fleet's 127.0.B.0/24, more addresses for routers and dead endpoints


@pytest.fixture(scope="session")
def real_fleet(
    tiny_models: Any, tiny_adapter_factory: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealFleet]:
    """Three real workers (tiny llama) with ports 8000/9090 on addresses of a reserved 127.0.B.0/24, and adapters."""
    model_dir = tiny_models["llama"]
    root = tmp_path_factory.mktemp("operator_fleet")
    adapters = {
        "a": tiny_adapter_factory(model_dir, rank=4, seed=11, strength=2.0),
        "b": tiny_adapter_factory(model_dir, rank=4, seed=22, strength=2.0),
        "bad": tiny_adapter_factory(model_dir, rank=32, seed=33),
    }
    file_root = adapters["a"].parent
    block = AddressBlock()  # the node agent's allocator: no clash with pods of a running test cluster
    workers = []
    for i in range(3):
        workdir = root / f"w{i}"
        workdir.mkdir()
        workers.append(RealWorker(f"worker-{i}", block.take(), model_dir, file_root, workdir))
    try:
        for w in workers:
            w.spawn()
        for w in workers:
            w.wait_ready()
        yield RealFleet(workers, adapters, block)
    finally:
        for w in workers:
            w.stop()
        block.close()


# ---- the runtime over in-memory objects and MgmtWorkers ------------------------------------------
@dataclass
class Cluster:
    """DynamoModels and pods in memory, the runtime reconciling them against ``workers``."""

    runtime: Runtime
    workers: list[MgmtWorker]
    objects: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    clock: int = 0

    def apply(self, name: str, model_name: str, uri: str = "s3://bucket/a", ns: str = "ns", **spec: Any) -> None:
        key = (ns, name)
        old = self.objects.get(key)
        new_spec = {"modelName": model_name, "baseModelName": BASE, "modelType": "lora", "source": {"uri": uri},
                    **spec}  # fmt: skip
        if old is None:
            self.clock += 1
            meta = {"name": name, "namespace": ns, "uid": f"uid-{ns}-{name}", "generation": 1,
                    "creationTimestamp": f"2026-01-01T00:00:{self.clock:02d}Z"}  # fmt: skip
        else:
            meta = dict(old["metadata"])
            meta["generation"] += old["spec"] != new_spec
        body = {"metadata": meta, "spec": new_spec, "status": (old or {}).get("status", {})}
        self.objects[key] = body
        self.runtime.on_model("MODIFIED", body)

    async def delete(self, name: str, ns: str = "ns") -> None:
        body = self.objects[(ns, name)]
        body = {**body, "metadata": {**body["metadata"], "deletionTimestamp": "2026-01-01T01:00:00Z"}}
        self.objects[(ns, name)] = body
        await self.runtime.finalize(body)
        del self.objects[(ns, name)]
        self.runtime.on_model("DELETED", body)

    def status(self, name: str, ns: str = "ns") -> dict[str, Any]:
        return self.objects[(ns, name)].get("status") or {}

    def holders(self, model_name: str) -> set[str]:
        return {f"worker-{i}" for i, w in enumerate(self.workers) if model_name in w.loras}

    def posts(self) -> int:
        return sum(1 for w in self.workers for m, _ in w.calls if m == "POST")

    async def settle(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not self.runtime.idle():
            assert time.monotonic() < deadline, "runtime did not settle"
            await asyncio.sleep(0.02)


@pytest.fixture
async def cluster(mgmt_workers: list[MgmtWorker]) -> AsyncIterator[Cluster]:
    objects: dict[tuple[str, str], dict[str, Any]] = {}

    async def write_status(model: Model, patch: Mapping[str, Any]) -> dict[str, Any] | None:
        body = objects.get(model.key)
        if body is None:
            return None
        status = {k: v for k, v in {**(body.get("status") or {}), **patch}.items() if v is not None}
        body = {**body, "status": json.loads(json.dumps(status))}
        objects[model.key] = body
        runtime.on_model("MODIFIED", body)
        return body

    settings = OperatorSettings(
        default_replicas=2, reconcile_workers=3, drift_interval=3600, retry_base=0.2, retry_max=1
    )
    client = WorkerClient(call_timeout=2, load_timeout=5, backoff=0.01)
    reconciler = Reconciler(
        client, management_port=mgmt_workers[0].port, ledger=MemoryLedger(), listing_ttl=3600, unload_grace=0
    )
    runtime = Runtime(settings, reconciler, write_status)
    for i, w in enumerate(mgmt_workers):
        runtime.on_pod("ADDED", pod_body(f"worker-{i}", w.host, True, BASE))
    runtime.start()
    yield Cluster(runtime, mgmt_workers, objects)
    await runtime.stop()
