"""The worker's memory budget (like vLLM's `--gpu-memory-utilization`) and how it is shared out at start-up.

The budget is a fraction of the device's memory (CUDA: its total memory; CPU: the container's memory limit,
else the machine's RAM) or a size (`8GiB`, `512Mi`, `16G`; Kubernetes quantity suffixes, optional `B`).
It is shared, in this order, between the model weights, the LoRA slots (`--max-loras` x `--max-lora-rank`),
an activation workspace (estimated from the batch size, not profiled as vLLM does) and the paged KV cache,
which gets the rest, capped at what `--max-num-seqs` sequences of `--max-model-len` tokens can use. On CUDA the
KV cache never takes more than the device has free. A budget that cannot hold one sequence of
`--max-model-len` tokens fails at start with the flags to change, as vLLM does. The CPU tier of adapters
(`--max-cpu-loras`) is host memory outside the budget.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lorafleet_worker.config import ModelConfig

if TYPE_CHECKING:  # torch is imported where it is used: the CLI parses budgets before torch is loaded
    import torch

DEFAULT_GPU_FRACTION = 0.9  # vLLM's default --gpu-memory-utilization
DEFAULT_CPU_FRACTION = 0.8
GiB = 1 << 30
_UNITS = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_UNITS |= {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
_SIZE = re.compile(r"^\s*(?P<num>\d+(?:\.\d+)?)\s*(?P<unit>[kKMGT]i?)?B?\s*$")
BUDGET_FLAGS = "--gpu-memory-utilization / --memory-budget"


class MemoryBudgetError(ValueError):
    """The budget cannot hold the model, its LoRA slots and one sequence; the message names the flags."""


@dataclass(frozen=True)
class MemoryBudget:
    """A fraction of the device's memory, or a number of bytes."""

    fraction: float | None = None
    nbytes: int | None = None

    @classmethod
    def parse(cls, text: str | float) -> MemoryBudget:
        """`0.9` (a fraction in (0, 1]) or a size such as `8GiB`, `512Mi`, `16G`, `17179869184`."""
        s = str(text).strip()
        try:
            value = float(s)
        except ValueError:
            value = None
        if value is not None and 0 < value <= 1:
            return cls(fraction=value)
        m = _SIZE.match(s)
        if m is None or (value is not None and (value <= 0 or not value.is_integer())):
            raise ValueError(f"memory budget {s!r}: give a fraction in (0, 1] or a size such as 8GiB")
        return cls(nbytes=int(float(m["num"]) * _UNITS[m["unit"] or ""]))

    def resolve(self, device: torch.device) -> tuple[int, str]:
        """(bytes, a description for the log) on `device`."""
        if self.nbytes is not None:
            return self.nbytes, f"{fmt_bytes(self.nbytes)} as set"
        fraction = self.fraction if self.fraction is not None else default_fraction(device)
        total, what = device_memory(device)
        return int(total * fraction), f"{fraction:g} of {fmt_bytes(total)} ({what})"


def default_fraction(device: torch.device) -> float:
    return DEFAULT_GPU_FRACTION if device.type == "cuda" else DEFAULT_CPU_FRACTION


def device_memory(device: torch.device) -> tuple[int, str]:
    """Total memory of `device` and where the figure comes from."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[1]), f"{device} total"
    ram = _meminfo_total()
    limit = _cgroup_limit()
    if limit is not None and limit < ram:
        return limit, "the container's memory limit"
    return ram, "RAM"


def free_device_memory(device: torch.device) -> int | None:
    """Free memory of a CUDA device now; None on CPU (pages of the KV cache are only touched when used)."""
    if device.type != "cuda":
        return None
    import torch

    return int(torch.cuda.mem_get_info(device)[0])


def _meminfo_total(path: Path = Path("/proc/meminfo")) -> int:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import os

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _cgroup_limit() -> int | None:
    """The memory limit of this process's cgroup (v2 `memory.max`, v1 `memory.limit_in_bytes`), if any."""
    for path in (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # v1 writes a huge number for "no limit"
            return int(text)
    return None


def fmt_bytes(n: float) -> str:
    """`1.50 GiB`, `64.0 MiB`."""
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / (1 << 20):.1f} MiB"


def weight_bytes(
    config: ModelConfig,
    dtype: torch.dtype,
    packed_head_copy: bool = False,
    quantization: str | None = None,
    layouts: int = 1,
) -> int:
    """Bytes of the base model's weights in `dtype` (from the config; biases and norms included).

    `packed_head_copy`: a tied lm_head also has a packed copy beside the embedding (CPU, `model/cpu_linear.py`).
    `layouts`: each projection and the lm_head are held in this many packed layouts (2: `cpu_linear`'s split).
    `quantization`: the projections and the lm_head are held quantized (`model/quantization.py`); a tied
    lm_head's quantized copy sits beside the embedding.
    """
    h, inter, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
    linears = [(q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter)]  # [out, in]: qkv, o, gate_up, down
    small = 2 * h + (q + 2 * kv if config.attention_bias else 0) + (2 * config.head_dim if config.qk_norm else 0)
    vocab = config.vocab_size
    if quantization is None:
        per_layer = layouts * sum(o * i for o, i in linears) * dtype.itemsize
        head_copies = 0 if config.tie_word_embeddings and not packed_head_copy else layouts
        head = head_copies * vocab * h * dtype.itemsize
    else:
        from lorafleet_worker.model.quantization import quantized_nbytes

        per_layer = sum(quantized_nbytes(o, i, quantization, dtype) for o, i in linears)
        head = quantized_nbytes(vocab, h, quantization, dtype)
    per_layer += small * dtype.itemsize
    return config.num_hidden_layers * per_layer + (vocab * h + h) * dtype.itemsize + head


def activation_bytes(config: ModelConfig, *, max_num_batched_tokens: int, max_num_seqs: int, dtype: torch.dtype) -> int:
    """A generous estimate of one step's workspace: every projection output of a layer for the step's tokens,
    plus fp32 logits (and their softmax / log-softmax) of every sequence, doubled for temporaries."""
    elem = dtype.itemsize
    h, inter = config.hidden_size, config.intermediate_size
    per_token = (4 * h + 2 * config.q_size + 2 * config.kv_size + 3 * inter) * elem
    logits = max_num_seqs * config.vocab_size * 4 * 3
    return 2 * (max_num_batched_tokens * per_token + logits)


@dataclass(frozen=True)
class MemoryPlan:
    """How the budget is shared out (bytes); `kv_blocks` blocks of `block_size` tokens for the KV cache."""

    budget: int
    budget_source: str
    weights: int
    lora: int
    activations: int
    kv: int
    kv_blocks: int
    block_size: int

    @property
    def kv_tokens(self) -> int:
        return self.kv_blocks * self.block_size

    def describe(self, max_model_len: int) -> str:
        return (
            f"memory budget {fmt_bytes(self.budget)} ({self.budget_source}): weights {fmt_bytes(self.weights)}, "
            f"LoRA slots {fmt_bytes(self.lora)}, activations ~{fmt_bytes(self.activations)}, "
            f"KV cache {fmt_bytes(self.kv)} = "
            f"{self.kv_blocks} blocks x {self.block_size} tokens ({self.kv_tokens} tokens, "
            f"{self.kv_tokens / max_model_len:.1f} sequences of max_model_len={max_model_len})"
        )


def plan_memory(
    *,
    budget: int,
    budget_source: str,
    weights: int,
    lora: int,
    activations: int,
    bytes_per_block: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    free: int | None = None,
) -> MemoryPlan:
    """Share `budget` out; the KV cache gets what is left (at most `free` minus the rest, when given).

    MemoryBudgetError when the rest cannot hold one sequence of `max_model_len` tokens.
    """
    fixed = weights + lora + activations
    left = budget - fixed
    if free is not None:
        left = min(left, free - fixed)
    per_seq = math.ceil(max_model_len / block_size)
    blocks = min(max(left, 0) // bytes_per_block, max_num_seqs * per_seq)
    if blocks < per_seq:
        fits = blocks * block_size
        where = f"budget {fmt_bytes(budget)} ({budget_source})" + (
            f", {fmt_bytes(free)} free on the device" if free is not None and free - fixed < budget - fixed else ""
        )
        raise MemoryBudgetError(
            f"the memory budget cannot hold one sequence of max_model_len={max_model_len}: {where} minus "
            f"weights {fmt_bytes(weights)}, LoRA slots {fmt_bytes(lora)} and activations "
            f"~{fmt_bytes(activations)} leaves "
            f"{fmt_bytes(max(left, 0))} for the KV cache, {fits} tokens, but one sequence needs "
            f"{fmt_bytes(per_seq * bytes_per_block)}. Raise {BUDGET_FLAGS}, or lower --max-model-len "
            f"(at most {fits} fits), --max-loras or --max-lora-rank (or serve a float32 model with --dtype bfloat16)."
        )
    return MemoryPlan(
        budget=budget,
        budget_source=budget_source,
        weights=weights,
        lora=lora,
        activations=activations,
        kv=blocks * bytes_per_block,
        kv_blocks=blocks,
        block_size=block_size,
    )
