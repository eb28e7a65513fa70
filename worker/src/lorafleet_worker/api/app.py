"""Runs both HTTP servers (inference and management) in one event loop around one shared engine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator

import uvicorn

from lorafleet_worker.api.auth import with_api_key
from lorafleet_worker.api.inference import build_inference_app
from lorafleet_worker.api.management import build_management_app
from lorafleet_worker.service import WorkerService, WorkerSettings

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signal handling to `run_worker` (two servers share one process)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def http_server(app: object, host: str, port: int) -> uvicorn.Server:
    """A uvicorn server for `app` that leaves signal handling to its caller (`await server.serve()`)."""
    config = uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False, lifespan="off")  # type: ignore[arg-type]
    return _Server(config)


async def run_worker(settings: WorkerSettings) -> int:
    """Serve until SIGINT/SIGTERM; the model loads in the background (`/ready` says when). Returns an exit code."""
    service = WorkerService(settings)
    servers = [
        http_server(with_api_key(build_inference_app(service), settings.api_key), settings.host, settings.port),
        http_server(build_management_app(service), settings.host, settings.system_port),
    ]
    stop = asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():  # a second signal: stop waiting for open connections
            for s in servers:
                s.force_exit = True
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)

    serving = [asyncio.create_task(s.serve()) for s in servers]
    starting = asyncio.create_task(service.start())
    stopping = asyncio.create_task(stop.wait())
    log.info(
        "serving %s: inference on http://%s:%d, management on http://%s:%d",
        settings.served_model_name,
        settings.host,
        settings.port,
        settings.host,
        settings.system_port,
    )
    exit_code = 0
    pending: set[asyncio.Task[object]] = {starting, stopping, *serving}
    while not stopping.done():
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if starting in done and starting.exception() is not None:
            log.error("the worker could not start (model or --lora-modules): %s", starting.exception())
            exit_code = 1
            break
        if any(t in done for t in serving):
            log.error("an HTTP server stopped unexpectedly (port in use?)")
            exit_code = 1
            break
    log.info("shutting down")
    for s in servers:
        s.should_exit = True
    if not starting.done():
        starting.cancel()
    await asyncio.gather(*serving, starting, return_exceptions=True)
    stopping.cancel()
    await service.stop()
    log.info("stopped")
    return exit_code
