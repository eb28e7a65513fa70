"""``lorafleet-vllm-sidecar``: lorafleet's worker management API in front of a vLLM server (``build_parser``
lists its flags). Each flag also reads an environment variable, the worker's name for it where the worker has one.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from collections.abc import Sequence
from pathlib import Path

DESCRIPTION = (
    "Serves lorafleet's worker management API (POST/GET/DELETE /v1/loras, /health, /ready, /metrics) for the vLLM "
    "server in the same pod: fetches each adapter from its source into a directory vLLM reads and loads it through "
    "vLLM's /v1/load_lora_adapter (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True on vLLM)."
)


def _env(name: str, default: str | None) -> str | None:
    return os.environ.get(name) or default


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lorafleet-vllm-sidecar", description=DESCRIPTION)
    p.add_argument(
        "--vllm-url",
        default=_env("LORAFLEET_VLLM_URL", "http://127.0.0.1:8000"),
        help="the vLLM server's OpenAI API (env LORAFLEET_VLLM_URL, default http://127.0.0.1:8000)",
    )
    p.add_argument(
        "--host",
        default=_env("LORAFLEET_SIDECAR_HOST", "0.0.0.0"),
        help="address the management API listens on (env LORAFLEET_SIDECAR_HOST, default 0.0.0.0)",
    )
    p.add_argument(
        "--system-port",
        type=int,
        default=int(_env("DYN_SYSTEM_PORT", "9090") or 9090),
        help="management API port (env DYN_SYSTEM_PORT, default 9090)",
    )
    p.add_argument(
        "--lora-cache-dir",
        type=Path,
        default=_env("DYN_LORA_PATH", None),
        help="where adapters are downloaded; vLLM must read the same path (env DYN_LORA_PATH, "
        "default a temporary directory)",
    )
    p.add_argument(
        "--max-loaded-loras",
        type=int,
        default=_env("LORAFLEET_MAX_LOADED_LORAS", None),
        help="most adapters held at once, reported as 'capacity' (env LORAFLEET_MAX_LOADED_LORAS, default unlimited)",
    )
    p.add_argument(
        "--load-timeout",
        type=float,
        default=float(_env("LORAFLEET_VLLM_TIMEOUT", "120") or 120),
        help="seconds one vLLM call may take (env LORAFLEET_VLLM_TIMEOUT, default 120)",
    )
    p.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    p.epilog = (
        "Also read from the environment: LORAFLEET_ADMIN_TOKEN (the management API's bearer token, as the worker's), "
        "VLLM_API_KEY (sent to vLLM when it runs with --api-key), LORAFLEET_FILE_ROOTS, AWS_* and HF_* (adapter "
        "sources, as the worker's)."
    )
    return p  # fmt: skip


async def serve(args: argparse.Namespace) -> None:
    """Run the management API until SIGTERM/SIGINT."""
    from aiohttp import web
    from lorafleet_sync.sources import AdapterSources

    from lorafleet_sidecar.adapters import VllmAdapters
    from lorafleet_sidecar.app import build_app
    from lorafleet_sidecar.vllm import VllmClient

    vllm = VllmClient(args.vllm_url, api_key=os.environ.get("VLLM_API_KEY") or None, timeout_s=args.load_timeout)
    sources = AdapterSources.from_env(cache_dir=args.lora_cache_dir)
    adapters = VllmAdapters(vllm, sources, capacity=args.max_loaded_loras)
    app = build_app(adapters, admin_token=os.environ.get("LORAFLEET_ADMIN_TOKEN") or None)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.system_port).start()
    logging.getLogger(__name__).info(
        "management API on %s:%d for vLLM at %s (adapters in %s)",
        args.host, args.system_port, args.vllm_url, sources.cache.root,
    )  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await vllm.close()


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    asyncio.run(serve(args))


if __name__ == "__main__":  # pragma: no cover
    main()
