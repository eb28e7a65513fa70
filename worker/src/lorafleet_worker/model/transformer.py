"""Decoder-only transformer for Llama / Mistral / Qwen2 / Qwen3 (own code, gpt-fast style).

The forward pass runs over a flattened ragged batch (`forward_batch.py`): decode tokens of running
sequences first (one token each), then prefill chunks. Each layer writes its K/V into the paged cache
and attends over it (`attention.py`). Projections are fused (qkv, gate_up) and each of the four
projection groups applies the step's LoRA adapters through the LoRA backend. On CPU, where every row of a
step attends through the C++ paged kernel (decode tokens, the draft tokens a step verifies, prompt chunks), the
step runs the same ops through a lean loop over per-layer plans (`CpuDecodeLayer`, `_decode_on_cpu`) instead of
`DecoderLayer.forward`: the same logits, without its Python per op.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lorafleet_worker.config import ModelConfig
from lorafleet_worker.model import cpu_linear, quantization
from lorafleet_worker.model.attention import paged_attention
from lorafleet_worker.model.cpu_linear import Packed
from lorafleet_worker.model.forward_batch import ForwardBatch, LoRAContext
from lorafleet_worker.model.loading import Checkpoint, init_dummy, parse_dtype
from lorafleet_worker.model.rope import apply_rope, rope_cos_sin, rope_inv_freq
from lorafleet_worker.ops import cpu_attention

GROUPS = ("qkv", "o", "gate_up", "down")

if TYPE_CHECKING:
    from lorafleet_worker.core.kv_cache import PagedKVCache


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


Matmul2d = Callable[[Tensor, Tensor | None], Tensor]  # x [T, in], bias -> x @ W.T + bias (`PanelWeight.matmul_2d`)


@dataclass(frozen=True, slots=True)
class CpuDecodeLayer:
    """What a CPU step calls for one layer, looked up once (`Transformer.cpu_decode_layers`).

    The fast path of a one-user step (a decode token, or a token and the draft it verifies): it skips the module
    attribute look-ups, per-call wrappers and branches of `DecoderLayer.forward`. The same ops in the same order,
    so the logits are the same bits as `forward`'s.
    """

    idx: int
    attn_norm: Tensor
    attn_eps: float
    qkv: Matmul2d
    qkv_b: Tensor | None
    q_norm: Tensor | None
    k_norm: Tensor | None
    qk_eps: float
    num_heads: int
    scale: float
    window: int
    o: Matmul2d
    o_b: Tensor | None
    mlp_norm: Tensor
    mlp_eps: float
    gate_up: Matmul2d
    gate_up_b: Tensor | None
    down: Matmul2d
    down_b: Tensor | None


@dataclass
class ForwardOps:
    """The ops a forward pass goes through, one object shared by a model and its layers (`Transformer.ops`).

    `linear` is every base-model GEMM, `attention` every paged attention of a layer that runs op by op and
    `decode_attention` the one-op attention of a CPU step whose every row is a query over its paged context
    (C++, `ops/cpu_attention.py`). With `direct`, panel weights call their own op (`matmul_2d`, four Python frames
    fewer a projection) and such a CPU step runs the fused loop (`_decode_on_cpu`). The hook for profilers:
    `Transformer.set_ops` with timed wrappers and `direct=False`, so that every GEMM and attention passes through
    them.
    """

    linear: Callable[[Tensor, Tensor, Tensor | None, Packed | None], Tensor] = cpu_linear.linear
    attention: Callable[..., Tensor] = paged_attention
    decode_attention: Callable[..., Tensor] = cpu_attention.decode_attention
    direct: bool = True


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, idx: int, bias: BiasFlags, ops: ForwardOps | None = None) -> None:
        super().__init__()
        self.idx = idx
        self.ops = ops or ForwardOps()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.head_dim**-0.5
        self.window = config.sliding_window
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.qkv_w, self.qkv_b = _linear_params(self.q_size + 2 * self.kv_size, config.hidden_size, bias.qkv)
        self.o_w, self.o_b = _linear_params(config.hidden_size, self.q_size, bias.o)
        self.gate_up_w, self.gate_up_b = _linear_params(2 * config.intermediate_size, config.hidden_size, bias.mlp)
        self.down_w, self.down_b = _linear_params(config.hidden_size, config.intermediate_size, bias.mlp)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        # group -> the weight as the base GEMM reads it: packed (CPU, `Transformer.pack_weights`) or quantized
        self.packed: dict[str, Packed] = {}

    def _proj(self, x: Tensor, w: Tensor, b: Tensor | None, group: str, lora: LoRAContext | None) -> Tensor:
        packed, ops = self.packed.get(group), self.ops
        direct = getattr(packed, "matmul_2d", None) if ops.direct else None
        out = direct(x, b) if direct is not None and x.dim() == 2 else ops.linear(x, w, b, packed)
        if lora is not None:
            lora.apply(self.idx, group, x, out)
        return out

    def _matmul_2d(self, group: str) -> Matmul2d:
        """The group's base GEMM for a 2-D x: the panel kernel's own op where the weight is in panels, else
        `ops.linear` with the oneDNN-packed, quantized or dense weight (the choice `_proj` makes per call)."""
        packed = self.packed.get(group)
        direct: Matmul2d | None = getattr(packed, "matmul_2d", None)
        if direct is not None:
            return direct
        w = getattr(self, f"{group}_w")
        ops = self.ops
        return lambda x, b: ops.linear(x, w, b, packed)

    def forward(
        self,
        h: Tensor,
        cos: Tensor,
        sin: Tensor,
        batch: ForwardBatch,
        kv: PagedKVCache,
        attn_backend: str,
        fused: bool,
    ) -> Tensor:
        """`fused`: the C++ small ops serve this step (`_fused_ops`)."""
        lora = batch.lora
        x = cpu_attention.rms_norm(h, self.attn_norm.weight, self.attn_norm.eps) if fused else self.attn_norm(h)
        qkv = self._proj(x, self.qkv_w, self.qkv_b, "qkv", lora)
        t = x.shape[0]
        if fused and attn_backend == "cpu":  # every row a query over its paged context: the attention in one op
            qn, kn = self.q_norm, self.k_norm
            attn = self.ops.decode_attention(
                qkv, cos, sin, None if qn is None else qn.weight, None if kn is None else kn.weight,
                0.0 if qn is None else qn.eps, kv.k_caches[self.idx], kv.v_caches[self.idx], batch,
                self.num_heads, self.scale, self.window,
            )  # fmt: skip
        else:
            attn = self._attention(qkv, cos, sin, batch, kv, attn_backend, fused).reshape(t, self.q_size)
        o = self._proj(attn, self.o_w, self.o_b, "o", lora)
        if fused:
            x = cpu_attention.add_rms_norm_(h, o, self.mlp_norm.weight, self.mlp_norm.eps)  # h += o
        else:
            h = h + o
            x = self.mlp_norm(h)
        gate_up = self._proj(x, self.gate_up_w, self.gate_up_b, "gate_up", lora)
        if fused:
            act = cpu_attention.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return h + self._proj(act, self.down_w, self.down_b, "down", lora)

    def _attention(
        self, qkv: Tensor, cos: Tensor, sin: Tensor, batch: ForwardBatch, kv: PagedKVCache, backend: str, fused: bool
    ) -> Tensor:
        """Attention from the qkv projection, op by op (prefill chunks, mixed steps, the torch / triton backends)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = qkv.shape[0]
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if fused:  # in place on the views of qkv
            cpu_attention.rope_(q, cos, sin)
            cpu_attention.rope_(k, cos, sin)
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.ops.attention(
            q, k, v, kv.k_caches[self.idx], kv.v_caches[self.idx], batch, self.scale, backend, self.window
        )

    def cpu_decode(self) -> CpuDecodeLayer:
        """This layer's `CpuDecodeLayer`."""
        qkv, o, gate_up, down = (self._matmul_2d(g) for g in GROUPS)
        qn, kn = self.q_norm, self.k_norm
        return CpuDecodeLayer(
            self.idx, self.attn_norm.weight, self.attn_norm.eps, qkv, self.qkv_b,
            None if qn is None else qn.weight, None if kn is None else kn.weight, 0.0 if qn is None else qn.eps,
            self.num_heads, self.scale, int(self.window or 0), o, self.o_b, self.mlp_norm.weight, self.mlp_norm.eps,
            gate_up, self.gate_up_b, down, self.down_b,
        )  # fmt: skip


def _fused_ops(h: Tensor) -> bool:
    """The C++ small ops (`cpu_attention.py`) serve this step: CPU, float32 / bfloat16, and they built."""
    return h.device.type == "cpu" and h.dtype in (torch.float32, torch.bfloat16) and cpu_attention.available()


def _decode_on_cpu(
    layers: list[CpuDecodeLayer], h: Tensor, cos: Tensor, sin: Tensor, batch: ForwardBatch, kv: PagedKVCache
) -> Tensor:
    """A CPU step through every layer: `DecoderLayer.forward`'s fused branch, op for op."""
    ops = cpu_attention.native()
    rms_norm, attention, add_rms_norm_, silu_mul = ops.rms_norm, ops.decode_attention, ops.add_rms_norm_, ops.silu_mul
    slots, (tables, lens) = batch.slot_mapping, batch.query_tables()
    lora = batch.lora
    for ly in layers:
        x = rms_norm(h, ly.attn_norm, ly.attn_eps)
        qkv = ly.qkv(x, ly.qkv_b)
        if lora is not None:
            lora.apply(ly.idx, "qkv", x, qkv)
        attn = attention(
            qkv, cos, sin, ly.q_norm, ly.k_norm, ly.qk_eps, kv.k_caches[ly.idx], kv.v_caches[ly.idx], slots,
            tables, lens, ly.num_heads, ly.scale, ly.window,
        )  # fmt: skip
        o = ly.o(attn, ly.o_b)
        if lora is not None:
            lora.apply(ly.idx, "o", attn, o)
        x = add_rms_norm_(h, o, ly.mlp_norm, ly.mlp_eps)  # h += o
        gate_up = ly.gate_up(x, ly.gate_up_b)
        if lora is not None:
            lora.apply(ly.idx, "gate_up", x, gate_up)
        act = silu_mul(gate_up)
        down = ly.down(act, ly.down_b)
        if lora is not None:
            lora.apply(ly.idx, "down", act, down)
        h = h + down
    return h


def _dense_state_dict(module: nn.Module, state: dict[str, Tensor], prefix: str, _meta: object) -> None:
    """state_dict() of a packed model gives the dense weights back (read out of the packed ones)."""
    assert isinstance(module, Transformer)
    for name, packed in module.packed_weights().items():
        state[prefix + name] = packed.to_dense()


class Transformer(nn.Module):
    """The base model. `forward(batch, kv)` returns float32 logits for `batch.logits_indices`."""

    def __init__(self, config: ModelConfig, bias: BiasFlags | None = None, attn_backend: str = "torch") -> None:
        super().__init__()
        self.config = config
        # the Triton decode kernel has no sliding window: such models keep the torch attention
        self.attn_backend = "torch" if config.sliding_window and attn_backend == "triton" else attn_backend
        bias = bias or BiasFlags(qkv=config.attention_bias)
        self.embed = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size), requires_grad=False)
        self.ops = ForwardOps()
        self.layers = nn.ModuleList(DecoderLayer(config, i, bias, self.ops) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Parameter | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size), requires_grad=False)
        self.packed_head: Packed | None = None  # lm_head packed (panels, oneDNN) or quantized
        self._cpu_decode: list[CpuDecodeLayer] | None = None  # built at first use, dropped on (re)packing
        self._rope_cache: tuple[Tensor, Tensor] | None = None  # cos / sin of positions 0.. (`_rope_tables`)
        self.inv_freq: Tensor
        inv_freq, self.rope_scale = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._register_state_dict_hook(_dense_state_dict)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def set_ops(self, ops: ForwardOps) -> None:
        """Run the forward pass through `ops` from now on (a profiler's timed ops, or the previous ones back)."""
        self.ops = ops
        for layer in self._decoder_layers():
            layer.ops = ops
        self._cpu_decode = None  # its GEMMs were bound to the previous ops

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: PagedKVCache) -> Tensor:
        h = F.embedding(batch.input_ids, self.embed)
        cos, sin = self._rope_tables(batch.positions)
        fused = _fused_ops(h)
        rows = fused and self.attn_backend == "cpu" and batch.num_decode < h.shape[0]  # prefill in the paged kernel
        batch.prepare_masks(kv.block_size, self.config.sliding_window, decode=self.attn_backend == "torch", rows=rows)
        fast = fused and self.ops.direct and self.attn_backend == "cpu"
        layers = self.cpu_decode_layers() if fast else None
        if layers is not None:
            h = _decode_on_cpu(layers, h, cos, sin, batch, kv)
        else:
            for layer in self.layers:  # forward itself: nn.Module's call adds ~3 µs a layer and no layer has hooks
                h = layer.forward(h, cos, sin, batch, kv, self.attn_backend, fused)
        h = h[batch.logits_indices]
        h = cpu_attention.rms_norm(h, self.norm.weight, self.norm.eps) if fused else self.norm(h)
        head = self.lm_head if self.lm_head is not None else self.embed
        return self.ops.linear(h, head, None, self.packed_head).float()

    def _rope_tables(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos / sin [T, 1, head_dim] of `positions`. On CPU they are rows of tables of every position so far
        (vLLM's cos_sin_cache), grown by doubling: one index a step instead of ten small ops; the tables are
        `rope_cos_sin` of those positions, value for value."""
        if positions.device.type != "cpu" or positions.numel() == 0:  # CUDA: no max() sync on the step
            return rope_cos_sin(positions, self.inv_freq, self.rope_scale, self.dtype)
        need = int(positions.max()) + 1
        cache = self._rope_cache
        if cache is None or cache[0].shape[0] < need or cache[0].dtype != self.dtype:
            size = max(need, 256, 0 if cache is None else 2 * cache[0].shape[0])
            cache = rope_cos_sin(torch.arange(size), self.inv_freq, self.rope_scale, self.dtype)
            self._rope_cache = cache
        return cache[0][positions], cache[1][positions]

    def cpu_decode_layers(self) -> list[CpuDecodeLayer] | None:
        """Every layer's `CpuDecodeLayer` (built once), or None where some layer is not a `DecoderLayer`."""
        if self._cpu_decode is None:
            layers = self._decoder_layers()
            if len(layers) != len(self.layers):
                return None
            self._cpu_decode = [layer.cpu_decode() for layer in layers]
        return self._cpu_decode

    def pack_weights(self) -> int:
        """On CPU, reorder every projection's weight (and lm_head) once for oneDNN (`cpu_linear.py`).

        The dense copy of a packed projection is released (its parameter keeps dtype, not data); a tied
        lm_head is packed as a copy beside the embedding, which lookups still read. Returns the number of
        weights packed (0 where oneDNN cannot serve this model: it keeps `F.linear`).
        """
        packed = 0
        self._cpu_decode = None
        for layer in self._decoder_layers():
            for group in GROUPS:
                w: nn.Parameter = getattr(layer, f"{group}_w")
                p = cpu_linear.pack(w)
                if p is None:
                    self._gather_panels()
                    return packed
                layer.packed[group] = p
                w.data = w.data.new_empty(0)
                packed += 1
        head = self.lm_head if self.lm_head is not None else self.embed
        self.packed_head = cpu_linear.pack(head)
        if self.packed_head is not None:
            packed += 1
            if self.lm_head is not None:
                self.lm_head.data = self.lm_head.data.new_empty(0)
        self._gather_panels()
        return packed

    def _gather_panels(self) -> None:
        """Move every panel weight into one `cpu_linear.PanelArena`, layer by layer and lm_head last (the order a
        decode step reads them). Each weight is replaced as soon as it is copied, so its old panels are freed
        then; the arena's pages are committed as they are written, so the resident peak is about one copy of the
        panels, not two."""
        owners = [(layer.packed, group) for layer in self._decoder_layers() for group in layer.packed]
        arena = cpu_linear.PanelArena([d[g] for d, g in owners] + [self.packed_head])
        for d, g in owners:
            d[g] = arena.move(d[g])
        if self.packed_head is not None:
            self.packed_head = arena.move(self.packed_head)

    def quantize_weights(self, method: str) -> int:
        """Replace every projection's weight and the lm_head by its `method` quantization (`quantization.py`).

        Each weight is quantized from its dense values (read out of a oneDNN-packed one) and the dense or
        packed copy is released; a tied lm_head is quantized as a copy beside the embedding, which lookups
        still read. Returns the number of weights quantized.
        """
        quantization.check_supported(method, self.device, self.dtype)
        self._cpu_decode = None
        count = 0
        for layer in self._decoder_layers():
            for group in GROUPS:
                w: nn.Parameter = getattr(layer, f"{group}_w")
                dense = layer.packed[group].to_dense() if group in layer.packed else w.data
                layer.packed[group] = quantization.quantize(dense, method)
                w.data = w.data.new_empty(0)
                count += 1
        head = self.lm_head if self.lm_head is not None else self.embed
        dense_head = self.packed_head.to_dense() if self.packed_head is not None else head.data
        self.packed_head = quantization.quantize(dense_head, method)
        if self.lm_head is not None:
            self.lm_head.data = self.lm_head.data.new_empty(0)
        self._gather_panels()
        return count + 1

    def _decoder_layers(self) -> list[DecoderLayer]:
        return [layer for layer in self.layers if isinstance(layer, DecoderLayer)]

    def weight_nbytes(self) -> int:
        """Bytes the weights hold: parameters, plus every packed weight (a tied lm_head's packed copy too)."""
        dense = sum(p.nbytes for p in self.parameters())
        packed = [p for layer in self._decoder_layers() for p in layer.packed.values()]
        if self.packed_head is not None:
            packed.append(self.packed_head)
        return dense + sum(p.numel() * p.element_size() if isinstance(p, Tensor) else p.nbytes for p in packed)

    def packed_weights(self) -> dict[str, Packed]:
        """Parameter name -> its packed or quantized weight, for every weight `pack_weights` or
        `quantize_weights` released."""
        layers = self._decoder_layers()
        out = {f"layers.{i}.{g}_w": p for i, layer in enumerate(layers) for g, p in layer.packed.items()}
        if self.packed_head is not None and self.lm_head is not None:
            out["lm_head"] = self.packed_head
        return out

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "float32",
        config: ModelConfig | None = None,
        attn_backend: str = "torch",
        load_format: str = "auto",
    ) -> Transformer:
        """Load a Hugging Face model directory (`config.json` + `*.safetensors`, sharded or not); with
        `load_format="dummy"` only its `config.json`, the weights random (`loading.init_dummy`)."""
        config = config or ModelConfig.from_dir(model_dir)
        dev, dt = torch.device(device), parse_dtype(dtype)

        def build(bias: BiasFlags) -> Transformer:
            with torch.device("meta"):
                model = cls(config, bias, attn_backend)
            model.to(dtype=dt).to_empty(device=dev)
            model.inv_freq = rope_inv_freq(config)[0].to(dev)  # stays float32
            return model

        if load_format == "dummy":
            model = build(BiasFlags(qkv=config.attention_bias))
            init_dummy(model)
        elif load_format == "auto":
            with Checkpoint(Path(model_dir)) as ckpt:
                model = build(
                    BiasFlags(
                        qkv=ckpt.has("layers.0.self_attn.q_proj.bias"),
                        o=ckpt.has("layers.0.self_attn.o_proj.bias"),
                        mlp=ckpt.has("layers.0.mlp.gate_proj.bias"),
                    )
                )
                ckpt.load_into(model)
        else:
            raise ValueError(f"unknown load_format {load_format!r}: auto or dummy")
        if dev.type == "cpu":
            model.pack_weights()
        return model.eval()
