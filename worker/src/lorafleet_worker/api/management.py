"""Management API (system port, Dynamo-compatible): `/v1/loras`, the on-demand catalogue `/v1/loras/catalog`,
`/health`, `/ready`, `/metrics`."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Header
from pydantic import BaseModel, ConfigDict

from lorafleet_worker.api.common import add_probe_routes, install_error_handlers
from lorafleet_worker.api.protocol import LoadLoraRequest, management_error_body
from lorafleet_worker.service import LoadResult, WorkerService


class CatalogRequest(BaseModel):
    """lorafleet: `PUT /v1/loras/catalog`, the adapters this worker may load on demand (`POST /v1/loras` bodies)."""

    model_config = ConfigDict(extra="forbid")
    adapters: list[LoadLoraRequest]


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
        # lorafleet extensions: "capacity" is --max-loaded-loras (null: unlimited); the operator
        # never places more adapters on this worker than that. "pinned": by name, false for an adapter
        # the worker loaded on demand (the operator's placement counts only the pinned ones)
        return {
            "status": "success",
            "loras": loras,
            "count": len(loras),
            "capacity": service.capacity(),
            "pinned": service.pinned(),
        }

    @app.put("/v1/loras/catalog")
    async def put_catalog(body: CatalogRequest, authorization: str | None = Header(default=None)) -> dict[str, Any]:
        service.check_admin(authorization)
        count = service.set_catalog((entry.lora_name, entry.source.uri) for entry in body.adapters)
        return {"status": "success", "count": count}

    @app.get("/v1/loras/catalog")
    async def get_catalog(authorization: str | None = Header(default=None)) -> dict[str, Any]:
        service.check_admin(authorization)
        adapters = [{"lora_name": name, "source": {"uri": uri}} for name, uri in service.catalog().items()]
        return {"status": "success", "adapters": adapters, "count": len(adapters)}

    @app.delete("/v1/loras/{lora_name:path}")
    async def unload_lora(lora_name: str, authorization: str | None = Header(default=None)) -> dict[str, Any]:
        service.check_admin(authorization)
        return success_body(await service.unload_adapter(lora_name))

    return app
