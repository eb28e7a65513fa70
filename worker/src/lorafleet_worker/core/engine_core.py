"""The engine's parts, built once and stepped together: the adapter manager, the model runner (model, KV
tensors, LoRA backend), the KV cache manager, the structured-output manager and the scheduler.

`step` runs one scheduled step (the model runner's forward pass and sampling, then the scheduler's
update) and returns each request's output. Everything here runs on the step loop's thread.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from lorafleet_worker.config import ModelConfig
from lorafleet_worker.core.cuda_graphs import DecodeGraphs
from lorafleet_worker.core.kv_cache import PagedKVCache
from lorafleet_worker.core.kv_cache_manager import KVCacheManager
from lorafleet_worker.core.kv_events import KVEventsConfig
from lorafleet_worker.core.memory import (
    MemoryBudget,
    MemoryPlan,
    activation_bytes,
    free_device_memory,
    plan_memory,
    weight_bytes,
)
from lorafleet_worker.core.model_runner import ModelRunner
from lorafleet_worker.core.scheduler import Output, Scheduler
from lorafleet_worker.core.step import StepPlan
from lorafleet_worker.host.devices import resolve_dtype, resolve_lora_backend
from lorafleet_worker.lora.backends import get_backend
from lorafleet_worker.lora.manager import AdapterManager
from lorafleet_worker.model import Transformer, cpu_linear, parse_dtype
from lorafleet_worker.model.quantization import check_supported as check_quantization
from lorafleet_worker.ops import cpu_attention
from lorafleet_worker.settings import DEFAULTS
from lorafleet_worker.spec_decode.config import SpeculativeConfig
from lorafleet_worker.structured.manager import StructuredOutputManager

log = logging.getLogger(__name__)


def _check_device(device: torch.device, lora_backend: str) -> None:
    """Clear errors for a device that is not there and for Triton without CUDA (unless interpreted)."""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA GPU is available; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device.type!r}; choose cpu or cuda")
    if lora_backend == "triton" and device.type != "cuda":
        from lorafleet_worker.kernels import interpreting

        if not interpreting():
            raise ValueError("the triton LoRA backend needs --device cuda (or TRITON_INTERPRET=1 for tests)")


def _attention_backend(lora_backend: str, device: torch.device) -> str:
    """The paged decode attention: the Triton kernel goes with the Triton LoRA backend (on CUDA, or
    interpreted in tests); on CPU the C++ loop that reads KV blocks in place where it builds, else torch."""
    if lora_backend == "triton":
        return "triton"
    if device.type == "cpu" and cpu_attention.available():
        return "cpu"
    return "torch"


def _check_graphs(device: torch.device, lora_backend: str | None, attn_backend: str) -> None:
    """CUDA graphs need CUDA, and kernels that read only device buffers: the Triton LoRA backend (or none)."""
    if device.type != "cuda":
        raise ValueError(f"cuda_graph_max_bs needs --device cuda (got {device.type}); 0 runs eagerly")
    if lora_backend not in (None, "triton") or attn_backend == "cpu":
        raise ValueError("cuda_graph_max_bs needs the triton LoRA backend (--lora-backend triton or auto)")


def _max_model_len(config: ModelConfig, requested: int | None) -> int:
    """`requested`, else the model's max_position_embeddings; above it is an error (as in vLLM)."""
    limit = config.max_position_embeddings
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"--max-model-len {requested} is larger than the model's max_position_embeddings ({limit}, "
            "config.json): positions beyond it were never trained; lower --max-model-len"
        )
    return requested


class EngineCore:
    """Builds the engine's parts from the worker's settings and runs one step over them."""

    def __init__(
        self,
        model_dir: Path,
        *,
        device: str = DEFAULTS.device,
        dtype: str = DEFAULTS.dtype,
        max_loras: int = DEFAULTS.max_loras,
        max_cpu_loras: int = DEFAULTS.max_cpu_loras,
        max_lora_rank: int = DEFAULTS.max_lora_rank,
        max_adapters: int | None = None,
        max_num_seqs: int = DEFAULTS.max_num_seqs,
        max_model_len: int | None = None,
        lora_backend: str = DEFAULTS.lora_backend,
        memory_budget: str | float | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_num_batched_tokens: int | None = None,
        slot_aging_s: float = 1.0,
        enable_prefix_caching: bool = DEFAULTS.enable_prefix_caching,
        kv_events: KVEventsConfig | None = None,
        quantization: str | None = None,
        load_format: str = "auto",
        speculative_config: SpeculativeConfig | None = None,
        jump_forward: bool = DEFAULTS.jump_forward,
        cuda_graph_max_bs: int = DEFAULTS.cuda_graph_max_bs,
    ) -> None:
        """`dtype` / `lora_backend` "auto": see devices.py; `memory_budget` (a fraction or a size, see
        memory.py) sizes the KV cache unless `num_kv_blocks` is given; `enable_prefix_caching`: see
        kv_cache_manager.py; `kv_events`: publish the prefix cache's KV events (kv_events.py); `quantization`:
        weight-only int8 / int4 base linears (model/quantization.py), counted as such by the memory plan;
        `load_format` "dummy": random weights of the config's shapes, built on the device (`Transformer`);
        `speculative_config`: n-gram speculative decoding (spec_decode/); `jump_forward`: a grammar's forced
        tokens are computed in one step as a draft that is always accepted (the scheduler's drafts);
        `cuda_graph_max_bs`: decode steps of up to this many sequences replay CUDA graphs (cuda_graphs.py;
        CUDA only, 0 = eager)."""
        self.model_dir = Path(model_dir)
        self.config = ModelConfig.from_dir(self.model_dir)
        self.device = torch.device(device)
        if max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        self.max_model_len = _max_model_len(self.config, max_model_len)
        budget = MemoryBudget.parse(memory_budget) if memory_budget is not None else MemoryBudget()
        _check_device(self.device, lora_backend)
        dtype_name, why_dtype = resolve_dtype(dtype, self.config.torch_dtype, self.device)
        backend_name, why_backend = resolve_lora_backend(lora_backend, self.device)
        self.dtype = parse_dtype(dtype_name)
        if quantization is not None:
            check_quantization(quantization, self.device, self.dtype)
        self.quantization = quantization
        log.info("dtype %s: %s; LoRA backend %s: %s", dtype_name, why_dtype, backend_name, why_backend)
        self.lora_backend_name = backend_name
        max_num_batched_tokens = max_num_batched_tokens or max(2048, max_num_seqs)
        free_at_start = free_device_memory(self.device)  # CUDA: before the LoRA slots and weights take theirs
        self.manager: AdapterManager | None = None
        if max_loras > 0:  # the slot pool is allocated before the KV cache takes what is left
            self.manager = AdapterManager(
                self.config,
                max_loras=max_loras,
                max_cpu_loras=max_cpu_loras,
                max_lora_rank=max_lora_rank,
                max_adapters=max_adapters,
                device=self.device,
                dtype=self.dtype,
                rank_major_b=backend_name == "torch" and self.device.type == "cpu",  # Triton reads out-major B
            )
        if num_kv_blocks is None:
            self.memory_plan: MemoryPlan | None = self._plan_memory(
                budget, free_at_start, block_size, max_num_seqs, max_num_batched_tokens
            )
            num_kv_blocks = self.memory_plan.kv_blocks
            log.info(self.memory_plan.describe(self.max_model_len))
        else:
            self.memory_plan = None
            if -(-self.max_model_len // block_size) > num_kv_blocks:
                raise ValueError(
                    f"num_kv_blocks={num_kv_blocks} x block_size={block_size} cannot hold one sequence of "
                    f"max_model_len={self.max_model_len}"
                )
        attn_backend = _attention_backend(backend_name, self.device)
        log.info("decode attention: %s", attn_backend)
        model = Transformer.from_pretrained(
            self.model_dir,
            device=self.device,
            dtype=self.dtype,
            config=self.config,
            attn_backend=attn_backend,
            load_format=load_format,
        )
        if quantization is not None:
            n = model.quantize_weights(quantization)
            log.info("quantized %d base weights to %s", n, quantization)
        self.structured = StructuredOutputManager(
            self.model_dir, vocab_size=self.config.vocab_size, eos_token_ids=self.config.eos_token_ids
        )
        kv = PagedKVCache(
            self.config, num_blocks=num_kv_blocks, block_size=block_size, device=self.device, dtype=self.dtype
        )
        backend = get_backend(backend_name, self.device) if self.manager is not None else None
        lora_pool = self.manager.pool if self.manager is not None else None
        graphs = None
        if cuda_graph_max_bs:
            _check_graphs(self.device, backend_name if backend is not None else None, attn_backend)
            graphs = DecodeGraphs(
                model,
                kv,
                max_bs=min(cuda_graph_max_bs, max_num_seqs),
                max_model_len=self.max_model_len,
                lora_backend=backend,
                lora_pool=lora_pool,
            )
            log.info("CUDA graphs for decode steps of up to %d sequences: %s", graphs.sizes[-1], graphs.sizes)
        self.runner = ModelRunner(model, kv, self.structured, lora_backend=backend, lora_pool=lora_pool, graphs=graphs)
        self.kv_cache = KVCacheManager(
            num_kv_blocks, block_size, enable_prefix_caching=enable_prefix_caching, kv_events=kv_events
        )
        self.scheduler = Scheduler(
            self.kv_cache,
            self.manager,
            structured=self.structured,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            slot_aging_s=slot_aging_s,
            eos_token_ids=self.config.eos_token_ids,
            speculative=speculative_config,
            jump_forward=jump_forward,
        )

    def _plan_memory(
        self, budget: MemoryBudget, free: int | None, block_size: int, max_num_seqs: int, max_num_batched_tokens: int
    ) -> MemoryPlan:
        """Share the memory budget out between weights, LoRA slots, activations and KV blocks (memory.py)."""
        budget_bytes, budget_source = budget.resolve(self.device)
        return plan_memory(
            budget=budget_bytes,
            budget_source=budget_source,
            weights=weight_bytes(
                self.config,
                self.dtype,
                packed_head_copy=self.device.type == "cpu" and cpu_linear.packs(self.dtype),
                quantization=self.quantization,
                layouts=cpu_linear.layouts(self.dtype) if self.device.type == "cpu" else 1,  # quantized: unused
            ),
            lora=self.manager.pool.nbytes if self.manager is not None else 0,
            activations=activation_bytes(
                self.config, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, dtype=self.dtype
            ),
            bytes_per_block=PagedKVCache.bytes_per_block(self.config, block_size, self.dtype),
            block_size=block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=max_num_seqs,
            free=free,
        )

    def step(self, plan: StepPlan) -> list[Output]:
        """Run `plan` through the model runner and hand the result to the scheduler; each request's output."""
        return self.scheduler.update_from_output(plan, self.runner.execute(plan))

    def close(self) -> None:
        self.kv_cache.close()
        self.structured.close()
