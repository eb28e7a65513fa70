"""`lorafleet-worker serve` (the dev tools' `make-tiny-model` / `make-tiny-adapter`: `lorafleet-dev`, worker/dev)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence

from lorafleet_worker.host import huge_pages
from lorafleet_worker.settings import WorkerSettings

log = logging.getLogger("lorafleet_worker")

# read by other modules (adapter sources, huge_pages), listed in `serve --help` beside the settings' own
OTHER_ENVIRONMENT = (
    ("LORAFLEET_FILE_ROOTS", "directories file:// adapter sources may come from (os.pathsep-separated)"),
    ("THP_MEM_ALLOC_ENABLE", "1 (default): weights, KV cache and LoRA slots on 2 MB pages; 0: 4 KB pages"),
    ("AWS_*, HF_ENDPOINT, HF_TOKEN", "credentials of s3:// and hf:// sources"),
)


def serve_epilog() -> str:
    """`serve --help`'s environment section: the settings' variables, then the ones other modules read."""
    rows = [*WorkerSettings.environment_help(), *OTHER_ENVIRONMENT]
    width = max(len(name) for name, _ in rows) + 2
    return "environment:\n" + "".join(f"  {name.ljust(width)}{what}\n" for name, what in rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lorafleet-worker", description="Multi-LoRA inference worker (OpenAI API + Dynamo LoRA management API)."
    )
    parser.add_argument("--log-level", default=os.environ.get("LORAFLEET_LOG_LEVEL", "INFO"), help="default INFO")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        help="serve a base model and its LoRA adapters",
        description="Serve a Hugging Face model directory: OpenAI-compatible inference on --port, "
        "LoRA management (/v1/loras, /health, /ready, /metrics) on --system-port.",
        epilog=serve_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    WorkerSettings.add_arguments(serve)

    return parser


def _serve(args: argparse.Namespace) -> int:
    from lorafleet_worker.api.app import run_worker

    try:
        settings = WorkerSettings.from_args(args)
    except ValueError as e:
        raise SystemExit(f"lorafleet-worker: {e}") from e
    log.info(
        "admin token %s; LoRA %s; max_loras=%d max_cpu_loras=%d max_lora_rank=%d max_loaded_loras=%s backend=%s",
        "configured" if settings.admin_token else "not configured (management API is open)",
        "enabled" if settings.lora_enabled else "disabled",
        settings.max_loras,
        settings.max_cpu_loras,
        settings.max_lora_rank,
        settings.max_loaded_loras or "unlimited",
        settings.lora_backend,
    )
    return asyncio.run(run_worker(settings))


def main(argv: Sequence[str] | None = None) -> int:
    huge_pages.request()  # before torch allocates anything (`huge_pages.py`)
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return _serve(args)  # the one command
