"""The worker's configuration: one dataclass whose fields declare their `serve` flags, environment variables,
help and defaults once. `cli.build_parser` makes the flags from it, `WorkerSettings.from_args` builds it, and
`engine_kwargs` hands the engine its part (the engine's own defaults read `DEFAULTS`).

Precedence: a flag given on the command line, else its environment variable, else the default. Fields with
no flag (`lora_enabled`, `admin_token`) come from their environment variable alone; `--help` lists them under
"environment". Imports nothing heavy: `--help` must not wait for torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorafleet_worker.api.reasoning import REASONING_PARSERS
from lorafleet_worker.structured.tool_calls import PARSER_NAMES

_FALSE = {"0", "false", "no", "off"}
DTYPES = ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16")
QUANTIZATIONS = ("int8", "int4", "w8a8_int8")
LORA_BACKENDS = ("auto", "torch", "triton")
LOAD_FORMATS = ("auto", "dummy")


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _positive_seconds(value: str) -> float:
    n = float(value)
    if not n > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {value}")
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


def _kv_events_config(value: str) -> Any:
    from lorafleet_worker.core.kv_events import KVEventsConfig

    try:
        return KVEventsConfig.parse(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _speculative_config(value: str) -> Any:
    from lorafleet_worker.spec_decode.config import SpeculativeConfig

    try:
        return SpeculativeConfig.parse(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


@dataclass(frozen=True)
class LoRAModule:
    """An adapter loaded at start (--lora-modules): its name, its path or URI, the base model it is for."""

    name: str
    path: str
    base_model_name: str | None = None


def _lora_module(value: str) -> LoRAModule:
    """`name=path` or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`."""
    import json

    if value.lstrip().startswith("{"):
        try:
            spec = json.loads(value)
            return LoRAModule(str(spec["name"]), str(spec["path"]), spec.get("base_model_name"))
        except (ValueError, KeyError, TypeError) as e:
            raise argparse.ArgumentTypeError(f"not a LoRA module {value!r}: {e}") from e
    name, sep, path = value.partition("=")
    if not (sep and name and path):
        raise argparse.ArgumentTypeError(f"not a LoRA module {value!r}: name=path or JSON")
    return LoRAModule(name, path)


def _enabled(value: str) -> bool:
    return value.strip().lower() not in _FALSE


def option(
    default: Any,
    *flags: str,
    help: str,
    env: str | None = None,
    shown: str | None = None,
    engine: str | None = None,
    **argparse_kw: Any,
) -> Any:
    """A settings field: its default, its `serve` flags (none: set by `env` alone), its help, its environment
    variable, how `--help` shows the default (`shown`; None: the value itself), the engine keyword it feeds
    (`engine`), and further `add_argument` keywords (type, choices, metavar, action)."""
    meta = {"flags": flags, "help": help, "env": env, "shown": shown, "engine": engine, "argparse": argparse_kw}
    return field(default=default, metadata=meta)


@dataclass
class WorkerSettings:
    """Everything `lorafleet-worker serve` is told (see `lorafleet-worker serve --help`)."""

    model_dir: Path = field(
        metadata={
            "flags": ("--model",),
            "help": "Hugging Face model directory (config.json, *.safetensors, tokenizer.json)",
            "env": None,
            "shown": None,
            "engine": None,
            "argparse": {"required": True, "type": Path, "metavar": "DIR"},
        }
    )
    served_model_name: str = option(
        "", "--served-model-name", help="name clients send as `model`", shown="the --model argument", metavar="NAME"
    )
    host: str = option("0.0.0.0", "--host", help="address of both servers", metavar="HOST")
    port: int = option(8000, "--port", help="inference port", type=_port, metavar="PORT")
    system_port: int = option(
        9090, "--system-port", help="management port", env="DYN_SYSTEM_PORT", type=_port, metavar="PORT"
    )
    device: str = option("cpu", "--device", help="cpu or cuda[:N]", engine="device", metavar="DEVICE")
    dtype: str = option(
        "auto",
        "--dtype",
        help="weights and activations",
        shown="auto: the checkpoint's torch_dtype; float32 checkpoints in bf16 on GPU; on CPU bf16 only with "
        "AMX/AVX512-BF16, else float32",
        engine="dtype",
        choices=DTYPES,
    )
    quantization: str | None = option(
        None,
        "--quantization",
        "-q",
        help="quantized base linears and lm_head, LoRA on top in --dtype: weight-only int8 per output channel, "
        "int4 in groups of 32 (PyTorch's packed int8/int4 matmuls); w8a8_int8: those int8 weights times "
        "activations rounded to int8 per 32 inputs where batches are compute-bound (CPUs with AVX512-VNNI, "
        "about 2x int8's rate there, llama.cpp Q8_0's arithmetic)",
        shown="none",
        engine="quantization",
        choices=QUANTIZATIONS,
    )
    load_format: str = option(
        "auto",
        "--load-format",
        help="auto: the weights in the model directory's safetensors; dummy: random weights of the config's "
        "shapes built on the device (vLLM's dummy format: load-free benchmarks of a model's shape)",
        engine="load_format",
        choices=LOAD_FORMATS,
    )
    memory_budget: str | None = option(
        None,
        "--memory-budget",
        "--gpu-memory-utilization",
        help="memory for weights, LoRA slots, activations and the KV cache: a fraction of the device's memory "
        "(of the container's limit or RAM on CPU) or a size such as 8GiB",
        shown="0.9 on GPU, 0.8 on CPU",
        engine="memory_budget",
        type=_memory_budget,
        metavar="BUDGET",
    )
    max_loras: int = option(
        8,
        "--max-loras",
        help="GPU adapter slots = most adapters in one step",
        engine="max_loras",
        type=_positive,
        metavar="N",
    )
    max_cpu_loras: int = option(
        64, "--max-cpu-loras", help="adapters kept in the CPU tier", engine="max_cpu_loras", type=_positive, metavar="N"
    )
    max_lora_rank: int = option(
        64,
        "--max-lora-rank",
        help="largest accepted adapter rank",
        engine="max_lora_rank",
        type=_positive,
        metavar="R",
    )
    max_loaded_loras: int | None = option(
        None,
        "--max-loaded-loras",
        help="the most adapters registered at once: an on-demand load evicts the least recently used idle "
        "adapter loaded on demand to make room; with none, POST /v1/loras answers 507 and inference 503",
        env="LORAFLEET_MAX_LOADED_LORAS",
        shown="unlimited",
        engine="max_adapters",
        type=_positive,
        metavar="N",
    )
    lora_load_timeout_s: float = option(
        60.0,
        "--lora-load-timeout",
        help="how long a request naming a catalogued adapter that is not loaded waits for its on-demand load "
        "before a 503",
        env="LORAFLEET_LORA_LOAD_TIMEOUT",
        type=_positive_seconds,
        metavar="SECONDS",
    )
    max_num_seqs: int = option(
        64, "--max-num-seqs", help="most requests running at once", engine="max_num_seqs", type=_positive, metavar="N"
    )
    max_model_len: int | None = option(
        None,
        "--max-model-len",
        help="context length",
        shown="the model's",
        engine="max_model_len",
        type=_positive,
        metavar="N",
    )
    enable_prefix_caching: bool = option(
        True,
        "--enable-prefix-caching",
        help="reuse the KV of full blocks of earlier prompts, per adapter version",
        shown="on",
        engine="enable_prefix_caching",
        action=argparse.BooleanOptionalAction,
    )
    kv_events: Any = option(  # noqa: RUF009 (`option` returns a field); a KVEventsConfig, None = off
        None,
        "--kv-events-config",
        help='publish KV cache events as vLLM does, e.g. \'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\'',
        shown="off",
        engine="kv_events",
        type=_kv_events_config,
        metavar="JSON",
    )
    speculative_config: Any = option(  # noqa: RUF009 (`option` returns a field); a SpeculativeConfig, None = off
        None,
        "--speculative-config",
        help='n-gram (prompt lookup) speculative decoding as vLLM configures it, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}\'; no drafts while more '
        'than "disable_by_batch_size" requests run (default 4)',
        shown="off",
        engine="speculative_config",
        type=_speculative_config,
        metavar="JSON",
    )
    jump_forward: bool = option(
        False,
        "--enable-jump-forward",
        help="structured output: where the grammar allows a single continuation, compute those tokens in one step",
        shown="off",
        engine="jump_forward",
        action=argparse.BooleanOptionalAction,
    )
    cuda_graph_max_bs: int = option(
        0,
        "--cuda-graph-max-bs",
        help="CUDA: decode steps of up to N sequences replay CUDA graphs captured per batch size (SGLang's flag; "
        "at most 256); needs the triton LoRA backend",
        shown="0: eager",
        engine="cuda_graph_max_bs",
        type=int,
        metavar="N",
    )
    lora_backend: str = option(
        "auto",
        "--lora-backend",
        help="LoRA kernels",
        shown="auto: triton, with the paged-attention kernel, on CUDA; torch on CPU",
        engine="lora_backend",
        choices=LORA_BACKENDS,
    )
    lora_cache_dir: Path | None = option(  # noqa: RUF009 (`option` returns a field)
        None,
        "--lora-cache-dir",
        help="cache of downloaded adapters",
        env="DYN_LORA_PATH",
        shown="none",
        type=Path,
        metavar="DIR",
    )
    chat_template: str | None = option(
        None,
        "--chat-template",
        help="chat template (a Jinja file, or the template itself) for models without one, or to replace it",
        shown="the model's",
        metavar="FILE_OR_TEMPLATE",
    )
    enable_auto_tool_choice: bool = option(
        False,
        "--enable-auto-tool-choice",
        help='tool_choice "auto": parse tool calls (vLLM\'s flag)',
        shown="off",
        action="store_true",
    )
    tool_call_parser: str | None = option(
        None,
        "--tool-call-parser",
        help="the model's tool-call format (hermes: Hermes/Qwen; llama3_json)",
        shown="none",
        choices=PARSER_NAMES,
    )
    reasoning_parser: str | None = option(
        None,
        "--reasoning-parser",
        help="split <think>...</think> into message.reasoning_content (vLLM's parsers: deepseek_r1 starts inside "
        "the thinking; qwen3 too, unless chat_template_kwargs enable_thinking is false)",
        shown="none",
        choices=REASONING_PARSERS,
    )
    lora_modules: tuple[LoRAModule, ...] = option(
        (),
        "--lora-modules",
        help="adapters loaded at start (before /ready), as vLLM's: name=path or "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'; a path is a local directory or any adapter URI',
        shown="none",
        type=_lora_module,
        nargs="+",
        metavar="NAME=PATH|JSON",
    )
    stall_timeout_s: float = option(
        60.0,
        "--health-stall-timeout",
        help="/health fails when the engine loop made no progress for this long with requests waiting "
        "(a wedged step), so the kubelet restarts the worker; 0 = check only that the loop is alive",
        type=float,
        metavar="SECONDS",
    )
    admin_token_file: Path | None = option(  # noqa: RUF009 (`option` returns a field)
        None,
        "--admin-token-file",
        help="file holding the management API's bearer token",
        env="LORAFLEET_ADMIN_TOKEN_FILE",
        shown="none",
        type=Path,
        metavar="FILE",
    )
    admin_token: str | None = option(
        None,
        help="admin token for the management API (or --admin-token-file, or LORAFLEET_ADMIN_TOKEN_FILE)",
        env="LORAFLEET_ADMIN_TOKEN",
    )
    lora_enabled: bool = option(True, help="set to false to refuse adapter loads", env="DYN_LORA_ENABLED")
    api_key: str | None = field(  # never in repr (api/auth.py checks it)
        default=None,
        repr=False,
        metadata=option(
            None,
            "--api-key",
            help="inference API key as vLLM's: /v1/* requests need 'Authorization: Bearer KEY'",
            env="LORAFLEET_API_KEY",
            shown="$VLLM_API_KEY, else none (no key needed)",
            metavar="KEY",
        ).metadata,
    )

    def __post_init__(self) -> None:
        self.model_dir = Path(self.model_dir)
        if not self.served_model_name:
            self.served_model_name = str(self.model_dir)
        self.stall_timeout_s = max(0.0, self.stall_timeout_s)
        self.lora_modules = tuple(self.lora_modules)

    def engine_kwargs(self) -> dict[str, Any]:
        """The engine's keyword arguments: every field that declares one (`engine` in its metadata)."""
        return {f.metadata["engine"]: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata["engine"]}

    def validate(self) -> None:
        """Raise ValueError for values that are each well-formed but do not go together."""
        if not (self.model_dir / "config.json").is_file():
            raise ValueError(f"{self.model_dir} is not a Hugging Face model directory (no config.json)")
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None) -> None:
        """One flag per field that has flags; its default is the environment variable's value when set (the
        flag's `type` applies to it), else the field's default."""
        env = os.environ if env is None else env
        for f in dataclasses.fields(cls):
            meta = f.metadata
            if not meta["flags"]:
                continue
            kw = dict(meta["argparse"])
            if f.default is not dataclasses.MISSING:
                kw["default"] = env[meta["env"]] if meta["env"] and env.get(meta["env"]) else f.default
            shown = meta["shown"] if meta["shown"] is not None else str(f.default)
            if meta["env"]:
                shown = f"${meta['env']} or {shown}"
            kw["help"] = meta["help"] if f.default is dataclasses.MISSING else f"{meta['help']} (default {shown})"
            parser.add_argument(*meta["flags"], dest=f.name, **kw)

    @classmethod
    def environment_help(cls) -> list[tuple[str, str]]:
        """(variable, what it sets) for every field read from the environment, for `--help`'s epilog."""
        rows = []
        for f in dataclasses.fields(cls):
            meta = f.metadata
            if meta["env"]:
                rows.append((meta["env"], f"default for {meta['flags'][0]}" if meta["flags"] else meta["help"]))
        return rows

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str] | None = None) -> WorkerSettings:
        """The settings of a parsed `serve` command line (flag values, their env defaults already applied) plus
        the environment-only fields; resolves --chat-template and the admin token. ValueError when invalid."""
        env = os.environ if env is None else env
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.metadata["flags"]}
        for f in dataclasses.fields(cls):
            raw = env.get(f.metadata["env"] or "", "").strip()
            if not f.metadata["flags"] and raw:
                values[f.name] = _enabled(raw) if isinstance(f.default, bool) else raw
        values["chat_template"] = read_chat_template(values["chat_template"])
        values["api_key"] = values["api_key"] or env.get("VLLM_API_KEY", "").strip() or None  # vLLM's variable
        if values["admin_token_file"] is not None:  # the file wins over $LORAFLEET_ADMIN_TOKEN
            values["admin_token"] = read_token_file(values["admin_token_file"])
        settings = cls(**values)
        settings.validate()
        return settings


DEFAULTS = WorkerSettings(model_dir=Path())  # the defaults, by field name (the engine's keyword defaults)


def read_token_file(path: Path) -> str:
    """The token in `path` (--admin-token-file); ValueError when it cannot be read or is empty."""
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read --admin-token-file: {e.strerror}") from e
    if not token:
        raise ValueError(f"--admin-token-file {path} is empty")
    return token


def read_chat_template(value: str | None) -> str | None:
    """--chat-template as vLLM reads it: a file's content, else the template text itself."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value
