"""`lorafleet-worker serve | make-tiny-model | make-tiny-adapter`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from lorafleet_worker.core.kv_events import KVEventsConfig
from lorafleet_worker.host import huge_pages
from lorafleet_worker.structured.tool_calls import PARSER_NAMES

log = logging.getLogger("lorafleet_worker")

_FALSE = {"0", "false", "no", "off"}

SERVE_EPILOG = """\
environment:
  DYN_SYSTEM_PORT        default for --system-port
  DYN_LORA_PATH          default for --lora-cache-dir (downloaded adapters)
  DYN_LORA_ENABLED       set to false to refuse adapter loads
  LORAFLEET_ADMIN_TOKEN  admin token for the management API (or --admin-token-file,
                         or LORAFLEET_ADMIN_TOKEN_FILE)
  LORAFLEET_MAX_LOADED_LORAS  default for --max-loaded-loras
  LORAFLEET_FILE_ROOTS   directories file:// adapter sources may come from (os.pathsep-separated)
  THP_MEM_ALLOC_ENABLE   1 (default): weights, KV cache and LoRA slots on 2 MB pages; 0: 4 KB pages
  AWS_*, HF_ENDPOINT, HF_TOKEN   credentials of s3:// and hf:// sources
"""


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _port(value: str) -> int:
    n = int(value)
    if not 0 < n < 65536:
        raise argparse.ArgumentTypeError(f"not a TCP port: {n}")
    return n


def _memory_budget(value: str) -> str:
    from lorafleet_worker.core.memory import MemoryBudget

    try:
        MemoryBudget.parse(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return value


def _kv_events_config(value: str) -> KVEventsConfig:
    try:
        return KVEventsConfig.parse(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


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
        epilog=SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument(
        "--model",
        required=True,
        type=Path,
        metavar="DIR",
        help="Hugging Face model directory (config.json, *.safetensors, tokenizer.json)",
    )
    serve.add_argument(
        "--served-model-name", metavar="NAME", help="name clients send as `model` (default: the --model argument)"
    )
    serve.add_argument("--host", metavar="HOST", default="0.0.0.0", help="address of both servers (default 0.0.0.0)")
    serve.add_argument("--port", metavar="PORT", type=_port, default=8000, help="inference port (default 8000)")
    serve.add_argument(
        "--system-port",
        metavar="PORT",
        type=_port,
        default=int(os.environ.get("DYN_SYSTEM_PORT", "9090")),
        help="management port (default $DYN_SYSTEM_PORT or 9090)",
    )
    serve.add_argument("--device", metavar="DEVICE", default="cpu", help="cpu or cuda[:N] (default cpu)")
    serve.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"],
        help="weights and activations (default auto: the checkpoint's torch_dtype; float32 checkpoints in "
        "bf16 on GPU; on CPU bf16 only with AMX/AVX512-BF16, else float32)",
    )
    serve.add_argument(
        "--quantization",
        "-q",
        choices=["int8", "int4", "w8a8_int8"],
        help="quantized base linears and lm_head, LoRA on top in --dtype (default: none): weight-only int8 "
        "per output channel, int4 in groups of 32 (PyTorch's packed int8/int4 matmuls); w8a8_int8: those int8 "
        "weights times activations rounded to int8 per 32 inputs where batches are compute-bound (CPUs with "
        "AVX512-VNNI, about 2x int8's rate there, llama.cpp Q8_0's arithmetic)",
    )
    serve.add_argument(
        "--memory-budget",
        "--gpu-memory-utilization",
        dest="memory_budget",
        metavar="BUDGET",
        type=_memory_budget,
        help="memory for weights, LoRA slots, activations and the KV cache: a fraction of the device's memory "
        "(of the container's limit or RAM on CPU) or a size such as 8GiB (default 0.9 on GPU, 0.8 on CPU)",
    )
    serve.add_argument(
        "--max-loras",
        metavar="N",
        type=_positive,
        default=8,
        help="GPU adapter slots = most adapters in one step (default 8)",
    )
    serve.add_argument(
        "--max-cpu-loras", metavar="N", type=_positive, default=64, help="adapters kept in the CPU tier (default 64)"
    )
    serve.add_argument(
        "--max-lora-rank", metavar="R", type=_positive, default=64, help="largest accepted adapter rank (default 64)"
    )
    serve.add_argument(
        "--max-loaded-loras",
        metavar="N",
        type=_positive,
        default=os.environ.get("LORAFLEET_MAX_LOADED_LORAS") or None,  # argparse applies `type` to it
        help="the most adapters registered at once; beyond it POST /v1/loras answers 507 "
        "(default $LORAFLEET_MAX_LOADED_LORAS or unlimited)",
    )
    serve.add_argument(
        "--max-num-seqs", metavar="N", type=_positive, help="most requests running at once (engine default)"
    )
    serve.add_argument("--max-model-len", metavar="N", type=_positive, help="context length (default: the model's)")
    serve.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of full blocks of earlier prompts, per adapter version (default on)",
    )
    serve.add_argument(
        "--kv-events-config",
        metavar="JSON",
        type=_kv_events_config,
        help='publish KV cache events as vLLM does, e.g. \'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\'',
    )
    serve.add_argument(
        "--lora-backend",
        default="auto",
        choices=["auto", "torch", "triton"],
        help="LoRA kernels (default auto: triton, with the paged-attention kernel, on CUDA; torch on CPU)",
    )
    serve.add_argument(
        "--lora-cache-dir",
        metavar="DIR",
        type=Path,
        default=Path(os.environ["DYN_LORA_PATH"]) if os.environ.get("DYN_LORA_PATH") else None,
        help="cache of downloaded adapters (default $DYN_LORA_PATH)",
    )
    serve.add_argument(
        "--chat-template",
        metavar="FILE_OR_TEMPLATE",
        help="chat template (a Jinja file, or the template itself) for models without one, or to replace it",
    )
    serve.add_argument(
        "--enable-auto-tool-choice", action="store_true", help='tool_choice "auto": parse tool calls (vLLM\'s flag)'
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=PARSER_NAMES,
        help="the model's tool-call format (hermes: Hermes/Qwen; llama3_json)",
    )
    serve.add_argument(
        "--health-stall-timeout",
        metavar="SECONDS",
        type=float,
        default=60.0,
        help="/health fails when the engine loop made no progress for this long with requests waiting "
        "(a wedged step), so the kubelet restarts the worker; 0 = check only that the loop is alive (default 60)",
    )
    serve.add_argument(
        "--admin-token-file", metavar="FILE", type=Path, help="file holding the management API's bearer token"
    )

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


def _admin_token(token_file: Path | None) -> str | None:
    """--admin-token-file, else $LORAFLEET_ADMIN_TOKEN_FILE, else $LORAFLEET_ADMIN_TOKEN (None: no token)."""
    if token_file is None and os.environ.get("LORAFLEET_ADMIN_TOKEN_FILE"):
        token_file = Path(os.environ["LORAFLEET_ADMIN_TOKEN_FILE"])
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as e:
            raise SystemExit(f"lorafleet-worker: cannot read --admin-token-file: {e.strerror}") from e
        if not token:
            raise SystemExit(f"lorafleet-worker: --admin-token-file {token_file} is empty")
        return token
    return os.environ.get("LORAFLEET_ADMIN_TOKEN", "").strip() or None


def _chat_template(value: str | None) -> str | None:
    """--chat-template as vLLM reads it: a file's content, else the template text itself."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{" not in value:
        raise SystemExit(f"lorafleet-worker: --chat-template {value!r} is neither a file nor a Jinja template")
    return value


def _serve(args: argparse.Namespace) -> int:
    from lorafleet_worker.api.app import run_worker
    from lorafleet_worker.service import WorkerSettings

    if not (args.model / "config.json").is_file():
        raise SystemExit(f"lorafleet-worker: {args.model} is not a Hugging Face model directory (no config.json)")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SystemExit("lorafleet-worker: --enable-auto-tool-choice needs --tool-call-parser")
    settings = WorkerSettings(
        model_dir=args.model,
        served_model_name=args.served_model_name or str(args.model),
        host=args.host,
        port=args.port,
        system_port=args.system_port,
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        memory_budget=args.memory_budget,
        max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras,
        max_lora_rank=args.max_lora_rank,
        max_loaded_loras=args.max_loaded_loras,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_events=args.kv_events_config,
        lora_backend=args.lora_backend,
        lora_cache_dir=args.lora_cache_dir,
        admin_token=_admin_token(args.admin_token_file),
        chat_template=_chat_template(args.chat_template),
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        stall_timeout_s=max(0.0, args.health_stall_timeout),
        lora_enabled=os.environ.get("DYN_LORA_ENABLED", "true").strip().lower() not in _FALSE,
    )
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
