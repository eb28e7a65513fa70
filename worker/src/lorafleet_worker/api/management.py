"""Management API (system port, Dynamo-compatible): `/v1/loras`, `/health`, `/ready`, `/metrics`."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Header

from lorafleet_worker.api.common import add_probe_routes, install_error_handlers
from lorafleet_worker.api.protocol import LoadLoraRequest, management_error_body
from lorafleet_worker.service import LoadResult, WorkerService


def success_body(result: LoadResult) -> dict[str, Any]:
    return {"status": "success", "message": result.message, "lora_name": result.lora_name, "lora_id": result.lora_id}


def build_management_app(service: WorkerService) -> FastAPI:
    app = FastAPI(title="lorafleet worker management API", docs_url=None, redoc_url=None)
    install_error_handlers(app, management_error_body)
    add_probe_routes(app, service)

    @app.post("/v1/loras")
    async def load_lora(body: LoadLoraRequest, authorization: str | None = Header(default=None)) -> dict[str, Any]:
        service.check_admin(authorization)
        return success_body(await service.load_adapter(body.lora_name, body.source.uri))

    @app.get("/v1/loras")
    async def list_loras(authorization: str | None = Header(default=None)) -> dict[str, Any]:
        service.check_admin(authorization)
        loras = service.loras()
        # lorafleet extension: "capacity" is --max-loaded-loras (null: unlimited); the operator
        # never places more adapters on this worker than that
        return {"status": "success", "loras": loras, "count": len(loras), "capacity": service.capacity()}

    @app.delete("/v1/loras/{lora_name:path}")
    async def unload_lora(lora_name: str, authorization: str | None = Header(default=None)) -> dict[str, Any]:
        service.check_admin(authorization)
        return success_body(await service.unload_adapter(lora_name))

    return app
