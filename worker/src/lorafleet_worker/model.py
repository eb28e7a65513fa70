"""Decoder-only transformer for Llama / Mistral / Qwen2 / Qwen3 (own code, gpt-fast style).

The forward pass runs over a flattened ragged batch: decode tokens of running sequences first
(one token each), then prefill chunks. K/V are written into a paged cache (`kv_cache.py`) and
attention reads each sequence's context from its blocks. Projections are fused (qkv, gate_up) and
each of the four projection groups applies the step's LoRA adapters through the LoRA backend.
"""

from __future__ import annotations

import json
import math
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lorafleet_worker.config import ModelConfig, ModelConfigError

if TYPE_CHECKING:
    from lorafleet_worker.kv_cache import PagedKVCache

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """`"bf16"` / `"bfloat16"` / `torch.bfloat16` -> `torch.bfloat16`; clear error otherwise."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; choose one of float32, bfloat16, float16") from None


# --------------------------------------------------------------------------------------------- batch


@dataclass
class PrefillSeq:
    """One sequence's prefill chunk in the step: tokens [start, start+num_tokens) of the flat batch."""

    start: int  # offset of the chunk in the flat token batch
    num_tokens: int
    context_len: int  # tokens in the cache after this step (prior context + chunk)
    block_ids: Tensor  # int64 [ceil(context_len / block_size)] on the model's device
    mask: Tensor | None = None  # bool [num_tokens, context_len]; None = plain causal (no prior context, no window)


@dataclass
class ForwardBatch:
    """Everything one forward step needs; built by the engine from the scheduler's plan."""

    input_ids: Tensor  # int64 [T]
    positions: Tensor  # int64 [T]
    slot_mapping: Tensor  # int64 [T], flat cache index block * block_size + offset
    num_decode: int  # the first num_decode tokens are single decode tokens of num_decode sequences
    decode_block_tables: Tensor  # int32 [num_decode, max_blocks] (padded with 0)
    decode_seq_lens: Tensor  # int32 [num_decode], context length including the new token
    prefills: list[PrefillSeq]
    logits_indices: Tensor  # int64 [N], rows of the flat batch whose logits are returned
    lora: LoRAContext | None = None
    decode_mask: Tensor | None = None  # bool [num_decode, 1, 1, max_blocks * block_size] (torch attention)

    def prepare_masks(self, block_size: int, window: int | None) -> None:
        """Build the attention masks of the torch path once per step (shared by every layer).

        `window`: sliding-window size (a query at position p sees keys p - window < k <= p), None = full.
        """
        device = self.positions.device
        if self.num_decode:
            keys = torch.arange(self.decode_block_tables.shape[1] * block_size, device=device)[None, :]
            lens = self.decode_seq_lens[:, None]
            mask = keys < lens
            if window is not None:
                mask &= keys >= lens - window
            self.decode_mask = mask[:, None, None, :]
        for p in self.prefills:
            prior = p.context_len - p.num_tokens
            if prior or (window is not None and p.context_len > window):
                qpos = torch.arange(prior, p.context_len, device=device)[:, None]
                keys = torch.arange(p.context_len, device=device)[None, :]
                p.mask = keys <= qpos
                if window is not None:
                    p.mask &= keys > qpos - window


@dataclass
class LoRAContext:
    """The step's LoRA state: backend (torch / triton), slot pool and per-step batch info."""

    backend: Any  # lora.backend.LoRABackend
    pool: Any  # lora.pool.LoRAPool, pool.weights(layer, group) -> LoRAProjWeights
    batch: Any  # lora.batch.LoRABatchInfo

    def apply(self, layer: int, group: str, x: Tensor, out: Tensor) -> None:
        self.backend.apply(x, out, self.pool.weights(layer, group), self.batch)


# --------------------------------------------------------------------------------------------- rope


def rope_inv_freq(config: ModelConfig) -> tuple[Tensor, float]:
    """Inverse frequencies and the cos/sin scale ("attention factor") for the config's RoPE type."""
    dim = config.head_dim
    base = config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope_type == "llama3":
        low_ff, high_ff = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low_ff, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high_ff) & ~(wavelen > old_len / low_ff)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(dim, base, factor, scaling, config.max_position_embeddings)
    raise ModelConfigError(f"unsupported rope_scaling type {rope_type!r} (supported: default, linear, llama3, yarn)")


def _yarn_inv_freq(dim: int, base: float, factor: float, scaling: dict[str, Any], max_pos: int) -> tuple[Tensor, float]:
    orig = float(scaling.get("original_max_position_embeddings") or max_pos / factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = scaling.get("attention_factor")
    if attn is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extra = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv_freq, float(attn)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# --------------------------------------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _linear_params(out_dim: int, in_dim: int, bias: bool) -> tuple[nn.Parameter, nn.Parameter | None]:
    w = nn.Parameter(torch.empty(out_dim, in_dim), requires_grad=False)
    b = nn.Parameter(torch.empty(out_dim), requires_grad=False) if bias else None
    return w, b


@dataclass(frozen=True)
class BiasFlags:
    """Which linears carry a bias (read from the checkpoint: Qwen2 qkv, Llama attention_bias / mlp_bias)."""

    qkv: bool = False
    o: bool = False
    mlp: bool = False


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, idx: int, bias: BiasFlags) -> None:
        super().__init__()
        self.idx = idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.head_dim**-0.5
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.qkv_w, self.qkv_b = _linear_params(self.q_size + 2 * self.kv_size, config.hidden_size, bias.qkv)
        self.o_w, self.o_b = _linear_params(config.hidden_size, self.q_size, bias.o)
        self.gate_up_w, self.gate_up_b = _linear_params(2 * config.intermediate_size, config.hidden_size, bias.mlp)
        self.down_w, self.down_b = _linear_params(config.hidden_size, config.intermediate_size, bias.mlp)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def _proj(self, x: Tensor, w: Tensor, b: Tensor | None, group: str, lora: LoRAContext | None) -> Tensor:
        out = F.linear(x, w, b)
        if lora is not None:
            lora.apply(self.idx, group, x, out)
        return out

    def forward(
        self, h: Tensor, cos: Tensor, sin: Tensor, batch: ForwardBatch, kv: PagedKVCache, attn_backend: str
    ) -> Tensor:
        lora = batch.lora
        x = self.attn_norm(h)
        qkv = self._proj(x, self.qkv_w, self.qkv_b, "qkv", lora)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = x.shape[0]
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        attn = self._attention(q, k, v, batch, kv, attn_backend)
        h = h + self._proj(attn.reshape(t, self.q_size), self.o_w, self.o_b, "o", lora)
        x = self.mlp_norm(h)
        gate_up = self._proj(x, self.gate_up_w, self.gate_up_b, "gate_up", lora)
        gate, up = gate_up.chunk(2, dim=-1)
        return h + self._proj(F.silu(gate) * up, self.down_w, self.down_b, "down", lora)

    def _attention(
        self, q: Tensor, k: Tensor, v: Tensor, batch: ForwardBatch, kv: PagedKVCache, attn_backend: str
    ) -> Tensor:
        k_cache, v_cache = kv.k_caches[self.idx], kv.v_caches[self.idx]
        flat_k = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_k.index_copy_(0, batch.slot_mapping, k)
        flat_v.index_copy_(0, batch.slot_mapping, v)
        out = torch.empty_like(q)
        nd = batch.num_decode
        if nd:
            out[:nd] = self._decode_attention(q[:nd], k_cache, v_cache, batch, attn_backend)
        for p in batch.prefills:
            sl = slice(p.start, p.start + p.num_tokens)
            if p.context_len == p.num_tokens:  # fresh prompt: attend to the chunk's own k/v
                ks, vs = k[sl], v[sl]
            else:
                ks = k_cache[p.block_ids].flatten(0, 1)[: p.context_len]
                vs = v_cache[p.block_ids].flatten(0, 1)[: p.context_len]
            out[sl] = self._prefill_attention(q[sl], ks, vs, p.mask)
        return out

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
        # q [B, H, Lq, D], k/v [B, KVH, Lk, D]
        gqa = self.num_kv_heads != self.num_heads
        if gqa and q.device.type == "cuda":  # native GQA in the fused kernels
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=True
            )
        if gqa:  # faster than enable_gqa on CPU
            rep = self.num_heads // self.num_kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale)

    def _prefill_attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """Causal attention of a chunk (q [n, H, D]) over its context k/v [prior + n, KVH, D].

        `mask` is None for a chunk without prior context (plain causal attention).
        """
        qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        return self._sdpa(qh, kh, vh, mask, mask is None)[0].transpose(0, 1)

    def _decode_attention(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, batch: ForwardBatch, attn_backend: str
    ) -> Tensor:
        """One query per sequence (q [B, H, D]) over each sequence's paged context."""
        if attn_backend == "triton":
            from lorafleet_worker.kernels.paged_attention import paged_attention_decode

            return paged_attention_decode(
                q, k_cache, v_cache, batch.decode_block_tables, batch.decode_seq_lens, self.scale
            )
        bt = batch.decode_block_tables
        b, max_blocks = bt.shape
        bs = k_cache.shape[1]
        ks = k_cache[bt].view(b, max_blocks * bs, self.num_kv_heads, self.head_dim).transpose(1, 2)
        vs = v_cache[bt].view(b, max_blocks * bs, self.num_kv_heads, self.head_dim).transpose(1, 2)
        # GQA without copying K/V: the query heads of one KV head become that head's query rows
        qg = q.view(b, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim)
        o = F.scaled_dot_product_attention(qg, ks, vs, attn_mask=batch.decode_mask, scale=self.scale)
        return o.reshape(b, self.num_heads, self.head_dim)


class Transformer(nn.Module):
    """The base model. `forward(batch, kv)` returns float32 logits for `batch.logits_indices`."""

    def __init__(self, config: ModelConfig, bias: BiasFlags | None = None, attn_backend: str = "torch") -> None:
        super().__init__()
        self.config = config
        # the Triton decode kernel has no sliding window: such models keep the torch attention
        self.attn_backend = "torch" if config.sliding_window else attn_backend
        bias = bias or BiasFlags(qkv=config.attention_bias)
        self.embed = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(config, i, bias) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Parameter | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size), requires_grad=False)
        self.inv_freq: Tensor
        inv_freq, self.rope_scale = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scale).to(self.dtype)
        sin = (emb.sin() * self.rope_scale).to(self.dtype)
        return cos[:, None, :], sin[:, None, :]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: PagedKVCache) -> Tensor:
        h = F.embedding(batch.input_ids, self.embed)
        cos, sin = self.rope(batch.positions)
        batch.prepare_masks(kv.block_size, self.config.sliding_window)
        for layer in self.layers:
            h = layer(h, cos, sin, batch, kv, self.attn_backend)
        h = self.norm(h[batch.logits_indices])
        head = self.lm_head if self.lm_head is not None else self.embed
        return F.linear(h, head).float()

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "float32",
        config: ModelConfig | None = None,
        attn_backend: str = "torch",
    ) -> Transformer:
        """Load a Hugging Face model directory (`config.json` + `*.safetensors`, sharded or not)."""
        config = config or ModelConfig.from_dir(model_dir)
        dev, dt = torch.device(device), parse_dtype(dtype)
        with _Checkpoint(Path(model_dir)) as ckpt:
            bias = BiasFlags(
                qkv=ckpt.has("layers.0.self_attn.q_proj.bias"),
                o=ckpt.has("layers.0.self_attn.o_proj.bias"),
                mlp=ckpt.has("layers.0.mlp.gate_proj.bias"),
            )
            with torch.device("meta"):
                model = cls(config, bias, attn_backend)
            model.to(dtype=dt).to_empty(device=dev)
            model.inv_freq = rope_inv_freq(config)[0].to(dev)  # stays float32
            for name, param in model.named_parameters():
                value = torch.cat([ckpt.get(s) for s in _hf_sources(name)], dim=0)
                if value.shape != param.shape:
                    raise ModelConfigError(
                        f"{model_dir}: {name} has shape {tuple(value.shape)}, config expects {tuple(param.shape)}"
                    )
                with torch.no_grad():
                    param.copy_(value)
        return model.eval()


# --------------------------------------------------------------------------------------------- loading

_LAYER_MAP: dict[str, list[str]] = {
    "attn_norm.weight": ["input_layernorm.weight"],
    "mlp_norm.weight": ["post_attention_layernorm.weight"],
    "qkv_w": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
    "qkv_b": ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
    "o_w": ["self_attn.o_proj.weight"],
    "o_b": ["self_attn.o_proj.bias"],
    "gate_up_w": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "gate_up_b": ["mlp.gate_proj.bias", "mlp.up_proj.bias"],
    "down_w": ["mlp.down_proj.weight"],
    "down_b": ["mlp.down_proj.bias"],
    "q_norm.weight": ["self_attn.q_norm.weight"],
    "k_norm.weight": ["self_attn.k_norm.weight"],
}
_TOP_MAP: dict[str, str] = {"embed": "embed_tokens.weight", "norm.weight": "norm.weight", "lm_head": "lm_head.weight"}


def _hf_sources(name: str) -> list[str]:
    """Our parameter name -> the Hugging Face tensor names (without `model.`) concatenated into it."""
    if name in _TOP_MAP:
        return [_TOP_MAP[name]]
    _, idx, rest = name.split(".", 2)
    return [f"layers.{idx}.{s}" for s in _LAYER_MAP[rest]]


class _Checkpoint:
    """Lazy access to the tensors of every `*.safetensors` file of a model dir, by normalised name."""

    def __init__(self, model_dir: Path) -> None:
        self.dir = model_dir
        self._stack = ExitStack()
        self._where: dict[str, tuple[Any, str]] = {}

    def __enter__(self) -> _Checkpoint:
        from safetensors import safe_open

        files = self._files()
        for f in files:
            handle = self._stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                self._where[_normalise(key)] = (handle, key)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _files(self) -> list[Path]:
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [self.dir / n for n in names]
            for f in files:
                if f.parent.resolve() != self.dir.resolve() or not f.is_file():
                    raise ModelConfigError(f"{index}: shard {f.name!r} missing or outside the model directory")
            return files
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise ModelConfigError(f"{self.dir}: no *.safetensors weights found")
        return files

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> Tensor:
        try:
            handle, key = self._where[name]
        except KeyError:
            raise ModelConfigError(f"{self.dir}: tensor {name!r} missing from the checkpoint") from None
        return handle.get_tensor(key)


def _normalise(key: str) -> str:
    return key.removeprefix("model.")
