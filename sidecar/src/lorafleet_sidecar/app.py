"""The management API on the system port, lorafleet's worker shapes (SPEC §3): ``POST/GET /v1/loras``,
``DELETE /v1/loras/{name}``, ``/health``, ``/ready``, ``/metrics``.

Not served: the on-demand catalogue (``PUT /v1/loras/catalog`` answers 405, which the operator reads as a
worker without it), so a vLLM worker serves only the adapters placed on it.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

from aiohttp import web
from lorafleet_sync.ids import lora_id

from lorafleet_sidecar.adapters import LoadResult, ManagementError, VllmAdapters
from lorafleet_sidecar.metrics import CONTENT_TYPE

log = logging.getLogger(__name__)

ADAPTERS = web.AppKey("adapters", VllmAdapters)


def error(status: int, message: str) -> web.Response:
    return web.json_response({"status": "error", "message": message}, status=status)


def success(result: LoadResult) -> web.Response:
    body = {"status": "success", "message": result.message, "lora_name": result.lora_name, "lora_id": result.lora_id}
    return web.json_response(body)


def build_app(adapters: VllmAdapters, *, admin_token: str | None = None) -> web.Application:
    """The management app over ``adapters``; with ``admin_token``, ``/v1/loras*`` need ``Bearer <token>``."""

    @web.middleware
    async def errors(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            if request.path.startswith("/v1/") and admin_token:
                _check_admin(request.headers.get("Authorization"), admin_token)
            return await handler(request)
        except ManagementError as e:
            log.info("%s %s -> %d: %s", request.method, request.path, e.status, e.message)
            return error(e.status, e.message)
        except web.HTTPException as e:
            return error(e.status, e.reason)

    app = web.Application(middlewares=[errors])
    app[ADAPTERS] = adapters
    app.router.add_post("/v1/loras", load)
    app.router.add_get("/v1/loras", list_loras)
    app.router.add_delete("/v1/loras/{name:.+}", unload)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    return app


async def load(request: web.Request) -> web.Response:
    try:
        body = await request.json()
    except ValueError:
        raise ManagementError(400, "the body is not JSON") from None
    name = body.get("lora_name") if isinstance(body, dict) else None
    source = body.get("source") if isinstance(body, dict) else None
    uri = source.get("uri") if isinstance(source, dict) else None
    if not isinstance(name, str) or not isinstance(uri, str):
        raise ManagementError(400, 'expected {"lora_name": str, "source": {"uri": str}}')
    return success(await request.app[ADAPTERS].load(name, uri))


async def list_loras(request: web.Request) -> web.Response:
    adapters = request.app[ADAPTERS]
    held = await adapters.held()
    # lorafleet extensions, as the worker's: "capacity" (--max-loaded-loras, null: unlimited); "pinned":
    # every adapter here was placed through this API (nothing is loaded on demand)
    return web.json_response(
        {
            "status": "success",
            "loras": {name: lora_id(name) for name in held},
            "count": len(held),
            "capacity": adapters.capacity,
            "pinned": dict.fromkeys(held, True),
        }
    )


async def unload(request: web.Request) -> web.Response:
    return success(await request.app[ADAPTERS].unload(request.match_info["name"]))


async def health(_: web.Request) -> web.Response:
    """Liveness of the sidecar itself (vLLM's container has its own probe)."""
    return web.json_response({"status": "healthy"})


async def ready(request: web.Request) -> web.Response:
    problem = await request.app[ADAPTERS].ready()
    if problem is not None:
        return error(503, problem)
    return web.json_response({"status": "ready", "vllm": request.app[ADAPTERS].vllm.url})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[ADAPTERS].metrics.render(), headers={"Content-Type": CONTENT_TYPE})


def _check_admin(authorization: str | None, expected: str) -> None:
    """401 without a bearer token, 403 with a wrong one (the worker's rule)."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ManagementError(401, "admin token required: send 'Authorization: Bearer <token>'")
    if not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise ManagementError(403, "invalid admin token")
