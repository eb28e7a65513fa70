"""Pieces both FastAPI apps share: error handlers (each API has its own error shape) and probe routes."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from lorafleet_worker.api.generation import ClientDisconnected
from lorafleet_worker.api.protocol import APIError, validation_message
from lorafleet_worker.metrics import CONTENT_TYPE
from lorafleet_worker.service import WorkerService

log = logging.getLogger(__name__)

ErrorRenderer = Callable[[APIError], dict[str, Any]]


def install_error_handlers(app: FastAPI, render: ErrorRenderer) -> None:
    """Every error leaves as a real HTTP status with `render`'s body (malformed JSON and bad fields -> 400)."""

    def respond(request: Request, err: APIError) -> JSONResponse:
        log.info("%s %s -> %d: %s", request.method, request.url.path, err.status, err.message)
        return JSONResponse(render(err), status_code=err.status)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return respond(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(request, APIError(400, validation_message(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return respond(request, APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(ClientDisconnected)
    async def disconnected(_: Request, exc: ClientDisconnected) -> Response:
        log.info("client disconnected; request %s aborted", exc)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return respond(request, APIError(500, f"internal error: {type(exc).__name__}"))


def add_probe_routes(app: FastAPI, service: WorkerService) -> None:
    """`/health` (liveness: 503 once the engine loop died or stalled, see `WorkerService.unhealthy`),
    `/ready` (model loaded and healthy) and `/metrics` (Prometheus)."""

    @app.get("/health")
    async def health() -> JSONResponse:
        problem = service.unhealthy()
        if problem is None:
            return JSONResponse({"status": "healthy"})
        log.error("health check failed: %s", problem)
        return JSONResponse({"status": "error", "message": problem}, status_code=503)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if service.ready:
            return JSONResponse({"status": "ready", "model": service.model_name})
        message = service.unhealthy() or "the model is still loading"
        return JSONResponse({"status": "error", "message": message}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE)


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the request body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
