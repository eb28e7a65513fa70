"""``lorafleet-router``: an OpenAI-compatible front for the workers (SPEC §8).

Routing table (kept current by two list+watch ``Informer`` s, no kopf: the router is a plain
aiohttp process that can run several replicas):
- a LoRA DynamoModel's ``modelName`` -> the inference ports of its ``status.endpoints`` with
  ``ready: true`` whose pods are Ready; the routing policy (policy.py) picks one: by default
  the one most likely to hold the prompt's prefix in its KV cache within a load bound, else the one
  with the fewest in-flight requests through this router;
- a catalogued adapter (``Model.catalog_uri``) with no holder, or whose listed holders all failed once
  (its last holder gone in a rollout before the operator placed it again) -> its rendezvous pod among the Ready
  pods of its base model (the first of its HRW order, ``placement.rank``, as the operator's placement),
  which loads it on demand from the catalogue the operator gave it; the operator's placement then
  keeps it there;
- any other name -> Ready pods labelled ``nvidia.com/dynamo-base-model-hash`` = sha256(name)[:8]
  (base models; known base names come from DynamoModels' ``baseModelName`` / base entries).

A connection failure before the first response byte (a pod that died, was killed mid-request, or
refuses connections), or a 404/503 from a worker that has just dropped the adapter, is retried on
another endpoint. With no holder ready (a re-placement, a name handed over to the next DynamoModel
claiming it) a request waits up to ``--router-unavailable-wait`` for one, unless its model has failed
for good (phase ``Failed`` other than a name conflict). A non-streamed answer is read whole from the
worker before the client sees a byte, so a worker dying while it sends it is retried too; a stream
passes through as it comes, and breaks if its worker dies after its first byte (the client sees the
connection end early).
A 404 is worth another holder only when it says the pod does not hold the model (the worker's
``model_not_found``); any other 404 (a path the worker does not serve) is the client's answer at once.
``/v1/models`` lists base models with a Ready pod and adapters with a ready endpoint. Unknown model ->
404 in OpenAI's error shape.

Authentication as vLLM's ``--api-key``: with a key, ``/v1/*`` needs ``Authorization: Bearer <key>``
(else OpenAI's 401 shape); ``/health``, ``/ready``, ``/metrics`` and ``/demand`` stay open. Towards
the workers the router sends ``--worker-api-key`` (default: its own key) in place of the client's
header; with neither key the client's header passes through unchanged.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import logging
import secrets
import signal
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from lorafleet_operator import status as st
from lorafleet_operator.api import models_path
from lorafleet_operator.kube import Informer, KubeClient, collection_path
from lorafleet_operator.placement import rank
from lorafleet_operator.resources import Model, Pod
from lorafleet_sync.ids import BASE_MODEL_HASH_LABEL, base_model_hash
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from lorafleet_router import metrics
from lorafleet_router.demand import DemandTracker
from lorafleet_router.policy import CacheAware, Route, RoutingPolicy, make_policy, route_of
from lorafleet_router.settings import RouterSettings

log = logging.getLogger(__name__)
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade", "te", "trailer"}
RETRY_STATUS = {404, 503}
_ROUTE: contextvars.ContextVar[Route | None] = contextvars.ContextVar("route", default=None)  # the request's


@dataclass
class RoutingTable:
    """DynamoModels and worker pods, as the router needs them."""

    inference_port: int = 8000
    models: dict[tuple[str, str], Model] = field(default_factory=dict)
    pods: dict[tuple[str, str], Pod] = field(default_factory=dict)
    created: dict[str, int] = field(default_factory=dict)
    by_name: dict[str, dict[tuple[str, str], Model]] = field(default_factory=dict)  # modelName -> its models
    on_endpoint_gone: Callable[[str], None] | None = None  # a pod's URL stopped existing (deleted, new IP)

    def on_model(self, kind: str, body: Mapping[str, Any]) -> None:
        model = Model.from_body(body)
        old = self.models.pop(model.key, None)
        if old is not None:
            named = self.by_name.get(old.model_name, {})
            named.pop(old.key, None)
            if not named:
                self.by_name.pop(old.model_name, None)
        if kind != "DELETED":
            self.models[model.key] = model
            self.by_name.setdefault(model.model_name, {})[model.key] = model
            self.created.setdefault(model.model_name, int(time.time()))

    def on_pod(self, kind: str, body: Mapping[str, Any]) -> None:
        pod = Pod.from_body(body)
        key = (pod.namespace, pod.name)
        old = self.pods.pop(key, None) if kind == "DELETED" else self.pods.get(key)
        if kind != "DELETED":
            self.pods[key] = pod
        old_ip = old.ip if old is not None else None
        if old_ip and (kind == "DELETED" or old_ip != pod.ip) and self.on_endpoint_gone is not None:
            self.on_endpoint_gone(self._url(old_ip))

    def _url(self, ip: str) -> str:
        return f"http://{ip}:{self.inference_port}"

    def adapter(self, name: str) -> Model | None:
        """The DynamoModel serving adapter ``name``: its owner, the oldest claiming it (as the operator decides)."""
        candidates = [m for m in self.by_name.get(name, {}).values() if m.is_lora and not m.deleting]
        return min(candidates, key=lambda m: m.seniority, default=None)

    def adapter_endpoints(self, model: Model) -> list[str]:
        """Ready endpoints on Ready pods; if there are none, those on terminating pods that still
        serve (the operator keeps them listed until the adapter is ready elsewhere)."""
        out, terminating = [], []
        for ep in model.status.get("endpoints") or []:
            if not ep.get("ready"):
                continue
            pod = self.pods.get((model.namespace, str(ep.get("podName"))))
            if pod is not None:
                if pod.ready and pod.ip:
                    out.append(self._url(pod.ip))
                elif pod.serving and pod.ip:
                    terminating.append(self._url(pod.ip))
            elif host := urlsplit(str(ep.get("address", ""))).hostname:
                out.append(self._url(host))  # pod not (yet) seen by the pod watch: trust the status
        return out or terminating

    def rendezvous_endpoint(self, model: Model) -> list[str]:
        """A catalogued adapter's rendezvous pod (the first of its HRW order among the Ready pods of its
        base model in its namespace that load on demand: not vLLM's), which loads it on demand; [] when it is
        not catalogued or no such pod is Ready."""
        if model.catalog_uri is None:
            return []
        pods = {
            p.name: p for p in self.pods.values()
            if p.namespace == model.namespace and p.base_hash == model.base_hash and p.ready and p.ip
            and p.loads_on_demand
        }  # fmt: skip
        first = next(iter(rank(model.model_name, pods)), None)
        return [] if first is None else [self._url(str(pods[first].ip))]

    def base_endpoints(self, name: str) -> list[str]:
        wanted = base_model_hash(name)
        return sorted(self._url(p.ip) for p in self.pods.values() if p.base_hash == wanted and p.ready and p.ip)

    def base_names(self) -> set[str]:
        names = {m.base_model_name for m in self.models.values()}
        names |= {m.model_name for m in self.models.values() if m.model_type == "base"}
        return names

    def resolve(self, name: str) -> tuple[str, list[str]] | None:
        """("adapter" | "base", upstream URLs) for a model name, or None when unknown."""
        model = self.adapter(name)
        if model is not None:
            endpoints = self.adapter_endpoints(model)
            if not endpoints:  # a name being handed over: the deleted owner serves until its successor does
                for other in self.by_name.get(name, {}).values():
                    if other.deleting and other.is_lora:
                        endpoints += self.adapter_endpoints(other)
            return "adapter", endpoints or self.rendezvous_endpoint(model)
        endpoints = self.base_endpoints(name)
        if endpoints or name in self.base_names():
            return "base", endpoints
        return None

    def listing(self) -> list[dict[str, Any]]:
        data = []
        for base in sorted(self.base_names()):
            if self.base_endpoints(base):
                data.append(_model_card(base, self.created.get(base, 0), None))
        for model in sorted(self.models.values(), key=lambda m: m.model_name):
            servable = self.adapter_endpoints(model) or self.rendezvous_endpoint(model)  # on demand
            if model.is_lora and not model.deleting and servable:
                data.append(_model_card(model.model_name, self.created.get(model.model_name, 0), model.base_model_name))
        return data


def _failed(model: Model) -> bool:
    """Whether ``model`` cannot be served until someone changes it, so a request need not wait for it.
    A ``ModelNameConflict`` is not such a failure once the router picks that model as the name's owner:
    the older owner is gone and the operator is handing the name over (its next status has endpoints)."""
    ready = st.condition(model.status, "Ready") or {}
    return model.status.get("phase") == "Failed" and ready.get("reason") != st.MODEL_NAME_CONFLICT


def _model_card(name: str, created: int, parent: str | None) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "lorafleet", "root": name,
            "parent": parent}  # fmt: skip


def openai_error(
    status: int, message: str, code: str | None, err_type: str = "invalid_request_error", **kw: Any
) -> web.Response:
    body = {"error": {"message": message, "type": err_type, "param": "model" if status == 404 else None, "code": code}}
    return web.json_response(body, status=status, **kw)


def worth_another_holder(status: int, body: bytes) -> bool:
    """Whether a worker's 503 or 404 may be answered by another pod: a 503 (restarting, draining) is; a 404
    only when it says the pod does not hold the model (the worker's ``model_not_found``, vLLM's "The model
    `x` does not exist."), not for a path the worker does not serve."""
    if status != 404:
        return status in RETRY_STATUS
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return False
    if not isinstance(error, dict):
        return False
    message = str(error.get("message") or "")
    return error.get("code") == "model_not_found" or ("model" in message and "does not exist" in message)


class APIKey:
    """Checks ``Authorization: Bearer <key>`` on ``/v1/*`` (vLLM's ``--api-key``); compares SHA-256
    digests in constant time and never shows the key."""

    def __init__(self, key: str) -> None:
        self._digest = hashlib.sha256(key.encode()).digest()

    def __repr__(self) -> str:
        return "APIKey(***)"

    def allows(self, token: str | None) -> bool:
        return token is not None and secrets.compare_digest(hashlib.sha256(token.encode()).digest(), self._digest)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method == "OPTIONS" or not request.path.startswith("/v1"):
            return await handler(request)
        token = bearer_token(request.headers.get("Authorization"))
        if self.allows(token):
            return await handler(request)
        log.info("%s %s -> 401: missing or wrong API key", request.method, request.path)
        metrics.ROUTER_REQUESTS.labels("unauthorized", "401").inc()
        if token is None:
            message, code = "You didn't provide an API key: send it as 'Authorization: Bearer <key>'.", None
        else:
            message, code = "Incorrect API key provided.", "invalid_api_key"
        return openai_error(401, message, code, headers={"WWW-Authenticate": "Bearer"})


def bearer_token(authorization: str | None) -> str | None:
    scheme, _, token = (authorization or "").partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


class Router:
    """The aiohttp application: proxying with a routing policy's choice and pre-first-byte retries."""

    def __init__(
        self,
        table: RoutingTable,
        timeout: float = 600.0,
        unavailable_wait: float = 30.0,
        demand: DemandTracker | None = None,
        policy: RoutingPolicy | None = None,
        *,
        api_key: str | None = None,
        worker_api_key: str | None = None,
    ) -> None:
        """``api_key``: what clients must send on ``/v1/*`` (None: nothing); ``worker_api_key``: what the
        workers get instead of the client's Authorization header (None: the client's header)."""
        self.table = table
        self.auth = APIKey(api_key) if api_key else None
        self._upstream_auth = f"Bearer {worker_api_key}" if worker_api_key else None
        self.policy = policy if policy is not None else CacheAware()
        self.timeout = timeout
        self.unavailable_wait = unavailable_wait
        self.demand = demand or DemandTracker()
        self.inflight: defaultdict[str, int] = defaultdict(int)
        self.draining = False  # SIGTERM received: /ready fails so Services stop sending here (`serve`)
        self._session: aiohttp.ClientSession | None = None
        table.on_endpoint_gone = self._endpoint_gone

    def _endpoint_gone(self, endpoint: str) -> None:
        """A pod went away: its routing history says nothing about its successor at that address."""
        self.policy.forget(endpoint)
        if not self.inflight.get(endpoint):
            self.inflight.pop(endpoint, None)

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=64 * 1024 * 1024, middlewares=[self.auth.middleware] if self.auth is not None else []
        )
        app.add_routes(
            [
                web.get("/v1/models", self.models),
                web.get("/health", self.health),
                web.get("/healthz", self.health),
                web.get("/ready", self.ready),
                web.get("/metrics", self.metrics),
                web.get("/demand", self.demand_report),
                web.post("/v1/{path:.*}", self.proxy),
            ]
        )
        app.on_cleanup.append(self._close)
        return app

    async def _close(self, _app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), auto_decompress=False,
                timeout=aiohttp.ClientTimeout(total=self.timeout, sock_connect=5),
            )  # fmt: skip
        return self._session

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, _request: web.Request) -> web.Response:
        """Readiness: 503 while draining after SIGTERM (the process still serves meanwhile)."""
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        return web.json_response({"status": "ready"})

    async def metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def demand_report(self, _request: web.Request) -> web.Response:
        return web.json_response(self.demand.report())

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": self.table.listing()})

    def choose(self, endpoints: list[str], tried: set[str]) -> str | None:
        left = [e for e in endpoints if e not in tried]
        if not left:
            return None
        return self.policy.choose(left, self.inflight, _ROUTE.get())

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            payload = json.loads(raw)
            name = payload["model"]
            if not isinstance(name, str):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            metrics.ROUTER_REQUESTS.labels("invalid", "400").inc()
            return openai_error(400, "request body must be JSON with a string 'model'", "invalid_request")
        _ROUTE.set(route_of(payload) if isinstance(payload, dict) else None)
        resolved = self.table.resolve(name)
        if resolved is None:
            metrics.ROUTER_REQUESTS.labels("unknown", "404").inc()
            return openai_error(404, f"The model `{name}` does not exist.", "model_not_found")
        kind, endpoints = resolved
        model = self.table.adapter(name) if kind == "adapter" else None
        streaming = bool(payload.get("stream"))
        if model is None:
            return await self._forward(request, raw, name, kind, endpoints, None, streaming=streaming)
        key = (model.namespace, model.name, model.model_name)
        self.demand.arrive(key)
        state = {"dispatched": False}
        try:
            return await self._forward(request, raw, name, kind, endpoints, model, key, state, streaming=streaming)
        finally:
            self.demand.finish(key, dispatched=state["dispatched"])

    async def _forward(
        self,
        request: web.Request,
        raw: bytes,
        name: str,
        kind: str,
        endpoints: list[str],
        model: Model | None,
        key: tuple[str, str, str] | None = None,
        state: dict[str, bool] | None = None,
        *,
        streaming: bool = True,
    ) -> web.StreamResponse:
        """Send the request to a holder; ``key``/``state``: the adapter's demand accounting;
        not ``streaming``: the answer is read whole before the client gets any of it (retryable)."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        if self._upstream_auth is not None:  # the router's key towards the workers, never the client's
            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            headers["Authorization"] = self._upstream_auth
        tried: set[str] = set()
        last: tuple[int, bytes, str] | None = None

        def sent(on: bool) -> None:
            if key is not None and state is not None and state["dispatched"] != on:
                (self.demand.dispatch if on else self.demand.requeue)(key)
                state["dispatched"] = on

        deadline = time.monotonic() + (0 if model is not None and _failed(model) else self.unavailable_wait)
        attempts, pause = 0, 0.2
        while True:
            endpoint = self.choose(endpoints, tried)
            if endpoint is None:
                # every holder failed or none is ready (e.g. re-placement after its pods went away): wait a
                # little, with backoff, for the operator to load it elsewhere or for a holder that failed a
                # moment ago (restarting, still loading the adapter) to answer, instead of failing at once
                if time.monotonic() >= deadline:
                    break
                await asyncio.sleep(min(pause, max(0.0, deadline - time.monotonic())))
                pause = min(2 * pause, 1.0)
                fresh = self.table.resolve(name)
                endpoints = fresh[1] if fresh else []
                if model is not None:  # its holders all failed once: a pod that loads it on demand may answer
                    endpoints += [e for e in self.table.rendezvous_endpoint(model) if e not in endpoints]
                tried.clear()  # every holder, the ones tried included, gets another try
                continue
            tried.add(endpoint)
            attempts += 1
            if attempts > 1:
                metrics.ROUTER_RETRIES.inc()
            self.inflight[endpoint] += 1
            metrics.ROUTER_INFLIGHT.inc()
            sent(True)
            try:
                upstream = await self._http().post(endpoint + request.path_qs, data=raw, headers=headers)
            except (aiohttp.ClientConnectionError, TimeoutError) as e:
                log.info("endpoint %s failed before the first byte (%s); trying another", endpoint, e)
                self._release(endpoint)
                sent(False)
                continue
            try:
                if upstream.status in RETRY_STATUS:
                    answer = await upstream.read()
                    last = (upstream.status, answer, upstream.content_type)
                    another = any(e not in tried for e in endpoints) or kind == "adapter"
                    if another and worth_another_holder(upstream.status, answer):
                        sent(False)
                        continue
                    metrics.ROUTER_REQUESTS.labels(kind, str(upstream.status)).inc()
                    return web.Response(status=upstream.status, body=answer, headers=_passed_headers(upstream))
                if not streaming:
                    try:
                        body = await upstream.read()
                    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as e:
                        log.info("endpoint %s failed while answering (%s); trying another", endpoint, e)
                        sent(False)
                        continue
                    metrics.ROUTER_REQUESTS.labels(kind, str(upstream.status)).inc()
                    return web.Response(status=upstream.status, body=body, headers=_passed_headers(upstream))
                return await self._relay(request, upstream, kind)
            finally:
                upstream.release()
                self._release(endpoint)
        if last is not None:
            metrics.ROUTER_REQUESTS.labels(kind, str(last[0])).inc()
            return web.Response(status=last[0], body=last[1], content_type=last[2])
        metrics.ROUTER_REQUESTS.labels(kind, "503").inc()
        return openai_error(503, f"no reachable worker holds `{name}` right now", "model_unavailable",
                            "service_unavailable")  # fmt: skip

    def _release(self, endpoint: str) -> None:
        self.inflight[endpoint] -= 1
        metrics.ROUTER_INFLIGHT.dec()

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse, kind: str) -> web.StreamResponse:
        """Pass a (streamed) answer through as it comes. A worker dying after the first byte breaks the
        client's stream too (its connection is closed mid-body); a client leaving ends the relay. Neither
        is an error of the router's (no traceback, counted as ``broken`` / ``499``)."""
        response = web.StreamResponse(status=upstream.status, headers=_passed_headers(upstream))
        await response.prepare(request)
        try:
            while True:
                try:
                    chunk = await upstream.content.readany()
                except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as e:
                    log.warning("stream from %s broke after its first byte: %s", upstream.url.host, e or type(e))
                    metrics.ROUTER_REQUESTS.labels(kind, "broken").inc()
                    if request.transport is not None:
                        request.transport.close()
                    return response
                if not chunk:
                    break
                await response.write(chunk)
            await response.write_eof()
        except ConnectionResetError:
            log.info("client of a stream from %s went away", upstream.url.host)
            metrics.ROUTER_REQUESTS.labels(kind, "499").inc()
            return response
        metrics.ROUTER_REQUESTS.labels(kind, str(upstream.status)).inc()
        return response


def _passed_headers(upstream: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}


async def run_router(settings: RouterSettings) -> None:
    """Watch DynamoModels and worker pods, serve the router until cancelled."""
    kube = KubeClient.from_environment()
    table = RoutingTable(inference_port=settings.inference_port)
    informers = []
    for ns in settings.watched():
        informers.append(Informer(kube, models_path(ns), table.on_model))
        informers.append(
            Informer(kube, collection_path("", "v1", "pods", ns), table.on_pod, label_selector=BASE_MODEL_HASH_LABEL)
        )
    tasks = [asyncio.create_task(i.run()) for i in informers]
    demand = DemandTracker(settings.demand_window)
    policy = make_policy(settings.router_policy, balance=settings.router_balance, min_match=settings.router_min_match)
    router = Router(
        table, settings.router_timeout, settings.router_unavailable_wait, demand, policy,
        api_key=settings.api_key or None, worker_api_key=settings.upstream_key(),
    )  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    watching = asyncio.gather(*tasks)
    try:
        await serve(router, settings.bind_host, settings.router_port, stop, settings.router_drain_delay,
                    settings.router_drain_timeout, until=watching)  # fmt: skip
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        await kube.close()


async def serve(
    router: Router,
    host: str,
    port: int,
    stop: asyncio.Event,
    drain_delay: float,
    drain_timeout: float,
    until: asyncio.Future[Any] | None = None,
) -> None:
    """Serve `router` until `stop` is set (SIGTERM), then drain the way a Kubernetes rollout needs it: /ready
    answers 503 for `drain_delay` s while requests are still served (endpoints and kube-proxy take that long to
    stop sending new ones here), then the listener closes and requests in flight get up to `drain_timeout` s
    to finish. Streams longer than that are cut at the end, as a SIGKILL after the grace period would.
    `until` (the watches) ending first ends serving too, with its error."""
    runner = web.AppRunner(router.app(), shutdown_timeout=drain_timeout)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("router listening on %s:%d", host, port)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        waiting: set[asyncio.Future[Any]] = {stopped} if until is None else {stopped, until}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if until is not None and until.done() and not stopped.done():
            until.result()  # the watches failed: raise their error
            return
        router.draining = True
        log.info("SIGTERM: not ready from now on; serving %.0f s more, then in-flight requests get %.0f s",
                 drain_delay, drain_timeout)  # fmt: skip
        await asyncio.sleep(drain_delay)
        log.info("closing the listener; waiting for %d in-flight request(s)", sum(router.inflight.values()))
    finally:
        stopped.cancel()
        await runner.cleanup()
    log.info("router drained")
