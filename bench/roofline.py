"""The roofline of a decode step on this machine, and where a lorafleet decode step spends its time.

Measured in the same run as the engine benchmark (bench_engine.py):

- memory bandwidth: DRAM *read* bandwidth, what a decode step needs (weights and KV cache are read,
  hardly written): `sum()` over a 1 GiB float32 buffer (32x the 32 MiB LLC of the benchmark machine,
  so nothing is served from cache) on the engine's own thread count (`torch.get_num_threads()`),
  best of 7. Earlier reports used a 512 MiB `copy_` counted as read + write bytes, which moved
  between 10 and 41 GB/s within one run on this shared VM (a copy's write-allocate traffic, and one
  pass per sample at the mercy of the neighbours); the copy figure is still recorded as
  `copy_gb_s`, for reference only.
- matmul peak at the shapes used, in the step's dtype: at the scenario's decode shapes (M =
  concurrency, the model's projection groups and lm_head) and at M = 512 (compute-bound), the faster
  of `F.linear` and the engine's oneDNN-prepacked linear (`model/cpu_linear.py`); the best FLOP/s
  seen is the peak.

Floors for one decode step of `c` sequences (each part: max(bytes / bandwidth, FLOPs / peak)):

- base GEMMs: every projection weight and lm_head read once; 2 x c x params FLOPs;
- LoRA: the A and B matrices of the adapters present in the step; 2 x tokens x r x (in + out) FLOPs;
- attention: the K/V cache of every sequence at its mean decode context; 4 x c x ctx x q_size per layer;
- sampling: the logits read once (c x vocab floats);
- rest (norms, RoPE, activations, Python): no floor counted (its bytes are < 1 % of the weights').

Bytes count the step's dtype (4 for float32, 2 for bfloat16).

`StepBreakdown` times the same parts of the engine's decode steps from outside: through the model's hook
(`Transformer.set_ops`: timed base GEMMs and attention), the LoRA backend's `apply` and the model runner's
`sampler`; "rest" is the step's wall time minus those.
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PARTS = ("base_gemms", "lora", "attention", "sampling", "rest")
FLOAT_BYTES = 4  # float32; `floors_ms` takes the step's dtype


def dtype_bytes(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def measure_bandwidth(mib: int = 1024, repeats: int = 7) -> float:
    """DRAM read bandwidth in GB/s: `sum()` over a `mib` MiB buffer (far larger than the LLC) on the
    engine's thread count, best of `repeats` (the least disturbed pass of a shared machine)."""
    import torch

    buf = torch.ones(mib * 2**20 // 4)
    buf.sum()
    best = min(_timed(buf.sum) for _ in range(repeats))
    return round(buf.numel() * 4 / best / 1e9, 2)


def measure_copy_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Copy bandwidth in GB/s (read + write bytes), best of `repeats`: recorded for reference only."""
    import torch

    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return round(2 * src.numel() * 4 / best / 1e9, 2)


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def gemm_shapes(config: Any) -> dict[str, tuple[int, int]]:
    """(in, out) of the model's fused projection groups and of lm_head."""
    h, inter = config.hidden_size, config.intermediate_size
    return {
        "qkv": (h, config.q_size + 2 * config.kv_size),
        "o": (config.q_size, h),
        "gate_up": (h, 2 * inter),
        "down": (inter, h),
        "lm_head": (h, config.vocab_size),
    }


def measure_gemm(config: Any, tokens: Iterable[int], repeats: int = 5, dtype: str = "float32") -> dict[str, float]:
    """GFLOP/s per (group, M) in `dtype`, the faster of `F.linear` and the oneDNN-prepacked linear, best of
    `repeats`; key 'group@M'."""
    import torch
    import torch.nn.functional as F
    from lorafleet_worker.model import cpu_linear

    dt = getattr(torch, dtype)
    out = {}
    for m in tokens:
        for name, (k, n) in gemm_shapes(config).items():
            x, w = torch.randn(m, k).to(dt), torch.randn(n, k).to(dt)
            packed = cpu_linear.pack(w)
            calls = [functools.partial(F.linear, x, w)]
            if packed is not None:
                calls.append(functools.partial(cpu_linear.linear, x, w, None, packed))
            best = float("inf")
            for call in calls:
                call()
                best = min(best, *(_timed(call) for _ in range(repeats)))
            out[f"{name}@{m}"] = round(2 * m * k * n / best / 1e9, 2)
    return out


def measure_machine(config: Any, concurrency: int, dtype: str = "float32") -> dict[str, Any]:
    """Read bandwidth and matmul rates in `dtype` at the decode shapes of `config` (M = concurrency) and M = 512."""
    import torch

    gemm = measure_gemm(config, sorted({concurrency, 512}), dtype=dtype)
    return {
        "bandwidth_gb_s": measure_bandwidth(),
        "bandwidth_method": "read: sum() of 1 GiB, best of 7",
        "copy_gb_s": measure_copy_bandwidth(),
        "threads": torch.get_num_threads(),
        "dtype": dtype,
        "gemm_gflop_s": gemm,
        "peak_gflop_s": max(gemm.values()),
    }


# ---------------------------------------------------------------------------------------- floors

TARGET_DIMS: dict[str, Callable[[Any], tuple[int, int]]] = {
    "q_proj": lambda c: (c.hidden_size, c.q_size),
    "k_proj": lambda c: (c.hidden_size, c.kv_size),
    "v_proj": lambda c: (c.hidden_size, c.kv_size),
    "o_proj": lambda c: (c.q_size, c.hidden_size),
    "gate_proj": lambda c: (c.hidden_size, c.intermediate_size),
    "up_proj": lambda c: (c.hidden_size, c.intermediate_size),
    "down_proj": lambda c: (c.intermediate_size, c.hidden_size),
}


@dataclass(frozen=True)
class AdapterShape:
    rank: int
    targets: tuple[str, ...]

    @classmethod
    def read(cls, adapter_dir: Path) -> AdapterShape:
        config = json.loads((adapter_dir / "adapter_config.json").read_text())
        return cls(int(config["r"]), tuple(sorted(config["target_modules"])))

    def params(self, config: Any) -> int:
        """A and B parameters over every layer."""
        per_layer = sum(self.rank * sum(TARGET_DIMS[t](config)) for t in self.targets)
        return per_layer * config.num_hidden_layers


def base_params(config: Any) -> tuple[int, int]:
    """(parameters the GEMMs read per step: projections + lm_head, all parameters incl. embeddings)."""
    per_layer = sum(k * n for name, (k, n) in gemm_shapes(config).items() if name != "lm_head")
    head = config.hidden_size * config.vocab_size
    gemm = per_layer * config.num_hidden_layers + head
    embed = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    return gemm, gemm + embed


def floors_ms(
    config: Any,
    adapters: list[AdapterShape],
    concurrency: int,
    context: int,
    machine: dict[str, Any],
    elem_bytes: int = FLOAT_BYTES,
) -> dict[str, float]:
    """The floor of each part of one decode step of `concurrency` sequences at mean context `context`,
    weights and KV cache `elem_bytes` per value (logits float32)."""
    bw = machine["bandwidth_gb_s"] * 1e9
    peak = machine["peak_gflop_s"] * 1e9

    def floor(nbytes: float, flops: float) -> float:
        return round(max(nbytes / bw, flops / peak) * 1000, 3)

    gemm_params, _ = base_params(config)
    present = adapters[:concurrency]  # round-robin assignment: min(adapters, c) distinct adapters in a step
    lora_params = sum(a.params(config) for a in present)
    lora_tokens = concurrency / max(1, len(present))
    lora_flops = sum(2 * lora_tokens * a.params(config) for a in present)
    layers = config.num_hidden_layers
    kv_bytes = concurrency * context * layers * 2 * config.kv_size * elem_bytes
    attn_flops = 4 * concurrency * context * layers * config.q_size
    return {
        "base_gemms": floor(gemm_params * elem_bytes, 2 * concurrency * gemm_params),
        "lora": floor(lora_params * elem_bytes, lora_flops),
        "attention": floor(kv_bytes, attn_flops),
        "sampling": floor(concurrency * config.vocab_size * FLOAT_BYTES, 0),
        "rest": 0.0,
    }


def adapter_weight_share(config: Any, adapters: list[AdapterShape]) -> float:
    """The adapters' parameters as a fraction of the base model's (embeddings included)."""
    return sum(a.params(config) for a in adapters) / base_params(config)[1]


# -------------------------------------------------------------------------------- step breakdown


class StepBreakdown:
    """Wall time per part of each engine step; `decode_ms()` averages the decode-only steps.

    Installs wrappers on the engine and the model module (undone by `remove`); meant for one pass
    after the throughput passes, since the wrappers add a little overhead of their own.
    """

    def __init__(self, engine: Any) -> None:
        from lorafleet_worker.model.transformer import ForwardOps

        self.steps: list[dict[str, float]] = []
        self._current: dict[str, float] = {}
        self._decode_only = True
        self._undo: list[Callable[[], None]] = []
        runner = engine.core.runner
        self._patch(engine, "_step", self._wrap_step(engine._step))
        self._patch(runner, "sampler", self._wrap("sampling", runner.sampler))
        # the model's hook: every GEMM and attention through timed ops (no direct panel ops, no fused decode loop)
        model, ops = runner.model, runner.model.ops
        model.set_ops(
            ForwardOps(
                linear=self._wrap("base_gemms", ops.linear),
                attention=self._wrap("attention", ops.attention, watch_batch=True),
                decode_attention=self._wrap("attention", ops.decode_attention),  # one C++ op a layer
                direct=False,
            )
        )
        self._undo.append(lambda: model.set_ops(ops))
        backend = runner.lora_backend
        if backend is not None:
            self._patch(backend, "apply", self._wrap("lora", backend.apply))
            self._patch(backend, "step_runner", lambda pool, batch: None)  # every LoRA call through the timed apply

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        old = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, old))

    def remove(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _wrap(self, part: str, fn: Callable[..., Any], watch_batch: bool = False) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if watch_batch:  # paged_attention(q, k, v, k_cache, v_cache, batch, ...): prefills = not decode-only
                batch = args[5] if len(args) > 5 else kwargs.get("batch")
                if batch is not None and batch.prefills:
                    self._decode_only = False
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._current[part] = self._current.get(part, 0.0) + time.perf_counter() - t0

        return timed

    def _wrap_step(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            self._current, self._decode_only = {}, True
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                total = time.perf_counter() - t0
                if self._decode_only and "attention" in self._current:
                    parts = {p: self._current.get(p, 0.0) for p in PARTS if p != "rest"}
                    parts["rest"] = max(0.0, total - sum(parts.values()))
                    parts["step"] = total
                    self.steps.append(parts)

        return step

    def decode_ms(self) -> dict[str, float]:
        """Mean milliseconds per decode-only step for each part, the whole step, and the step count."""
        if not self.steps:
            return {}
        out = {k: round(1000 * statistics.fmean(s[k] for s in self.steps), 3) for k in (*PARTS, "step")}
        out["decode_steps"] = len(self.steps)
        return out


def distance(measured: dict[str, float], floors: dict[str, float]) -> dict[str, Any]:
    """Per part: measured ms, floor ms, and measured ÷ floor; and the whole step's share of its floor."""
    rows = {
        part: {
            "measured_ms": measured.get(part),
            "floor_ms": floors.get(part),
            "x_floor": round(measured[part] / floors[part], 2) if floors.get(part) and measured.get(part) else None,
        }
        for part in PARTS
    }
    step_floor = sum(floors.values())
    step = measured.get("step")
    return {
        "parts": rows,
        "step_ms": step,
        "step_floor_ms": round(step_floor, 3),
        "pct_of_roofline": round(100 * step_floor / step, 1) if step else None,
    }
