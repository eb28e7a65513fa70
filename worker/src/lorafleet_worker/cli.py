"""`lorafleet-worker serve | make-tiny-model | make-tiny-adapter`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from lorafleet_worker.host import huge_pages
from lorafleet_worker.settings import WorkerSettings

log = logging.getLogger("lorafleet_worker")

# read by other modules (adapter sources, huge_pages), listed in `serve --help` beside the settings' own
OTHER_ENVIRONMENT = (
    ("LORAFLEET_FILE_ROOTS", "directories file:// adapter sources may come from (os.pathsep-separated)"),
    ("THP_MEM_ALLOC_ENABLE", "1 (default): weights, KV cache and LoRA slots on 2 MB pages; 0: 4 KB pages"),
    ("AWS_*, HF_ENDPOINT, HF_TOKEN", "credentials of s3:// and hf:// sources"),
)


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


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

    tiny = sub.add_parser("make-tiny-model", help="write a random tiny model (dev tool)")
    tiny.add_argument("dir", type=Path, help="output directory")
    tiny.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3"])
    tiny.add_argument("--seed", type=int, default=0)

    adapter = sub.add_parser("make-tiny-adapter", help="write a real PEFT LoRA adapter for a model (dev tool)")
    adapter.add_argument("dir", type=Path, help="output directory")
    adapter.add_argument("--base", required=True, type=Path, help="base model directory")
    adapter.add_argument("--rank", required=True, type=_positive)
    adapter.add_argument("--alpha", type=float, help="lora_alpha (default 2 x rank)")
    adapter.add_argument("--rslora", action="store_true", help="rank-stabilized scaling alpha/sqrt(r)")
    adapter.add_argument("--targets", nargs="+", help="target modules (default: all seven projections)")
    adapter.add_argument("--seed", type=int, default=0)
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


def _make_tiny_model(args: argparse.Namespace) -> int:
    from lorafleet_worker.devtools import make_tiny_model

    out = make_tiny_model(args.dir, args.arch, seed=args.seed)
    print(f"wrote a tiny {args.arch} model to {out}")
    return 0


def _make_tiny_adapter(args: argparse.Namespace) -> int:
    from lorafleet_worker.devtools import ALL_TARGETS, make_tiny_adapter

    out = make_tiny_adapter(
        args.dir,
        args.base,
        rank=args.rank,
        alpha=args.alpha,
        rslora=args.rslora,
        targets=args.targets or ALL_TARGETS,
        seed=args.seed,
    )
    print(f"wrote a rank-{args.rank} LoRA adapter to {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    huge_pages.request()  # before torch allocates anything (`huge_pages.py`)
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    commands = {"serve": _serve, "make-tiny-model": _make_tiny_model, "make-tiny-adapter": _make_tiny_adapter}
    return commands[args.command](args)
