"""The engine with the Triton LoRA backend and attention kernel matches the torch path.

On CPU the kernels run interpreted (fp32). With a CUDA GPU the compiled path runs end to end: the engine on
`device="cuda"` with its defaults (`auto`: Triton kernels, bf16), mixed adapters in one batch, against the
torch backend on the same GPU, in fp32 and bf16, and with int8 / int4 weight-only quantized base weights
(`--quantization`). Without CUDA those tests are skipped, never passed.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from lorafleet_worker.core.cuda_graphs import DecodeGraphs, capture_sizes
from lorafleet_worker.core.engine import Engine
from lorafleet_worker.kernels import paged_attention
from lorafleet_worker.lora.backends import triton as triton_backend
from lorafleet_worker.lora.backends.triton import TritonLoRABackend
from lorafleet_worker.lora.batch import LoRABatchInfo
from lorafleet_worker.model.forward_batch import ForwardBatch, LoRAContext
from lorafleet_worker.model.quantization import METHODS as QUANTIZATIONS
from lorafleet_worker.sample.params import SamplingParams, TokenOutput
from lorafleet_worker_dev.tiny import make_tiny_adapter, make_tiny_model

PROMPT = [5, 17, 42, 99, 7, 63, 120, 11, 250, 31, 8, 77, 140, 3, 19, 56, 200, 64, 12, 90]
MAX_TOKENS = 6
LOGPROB_TOL = {"float32": 1e-3, "bfloat16": 5e-2}
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the compiled Triton path); run `make gpu-check` on one"
)


@pytest.fixture(scope="module")
def model_and_adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("triton-engine")
    model = make_tiny_model(root / "model", "llama", num_heads=4, num_kv_heads=1, seed=3)
    adapters = {
        "r2": make_tiny_adapter(root / "r2", model, rank=2, seed=1),
        "r16": make_tiny_adapter(root / "r16", model, rank=16, rank_pattern={"k_proj": 4, "down_proj": 8}, seed=2),
        "qv8": make_tiny_adapter(root / "qv8", model, rank=8, targets=("q_proj", "v_proj"), seed=3),
    }
    return model, adapters


Outputs = dict[str | None, list[TokenOutput]]


async def _run(
    model: Path,
    adapters: dict[str, Path],
    backend: str,
    device: str = "cpu",
    dtype: str = "float32",
    quantization: str | None = None,
    cuda_graph_max_bs: int = 0,
) -> tuple[Outputs, int]:
    engine = Engine(
        model, device=device, dtype=dtype, max_loras=4, max_lora_rank=16, lora_backend=backend,
        quantization=quantization, cuda_graph_max_bs=cuda_graph_max_bs,
    )  # fmt: skip
    # the paged-attention kernel goes with the Triton backend; on CPU the torch LoRA backend gets the C++
    # decode attention where it builds (model/cpu_attention.py), else the torch one
    expected = {"triton"} if backend == "triton" else {"cpu", "torch"} if device == "cpu" else {"torch"}
    assert engine.core.runner.model.attn_backend in expected
    await engine.start()
    try:
        for name, path in adapters.items():
            await engine.add_adapter(name, path)
        names: list[str | None] = [None, *adapters]
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=3, ignore_eos=True)

        async def collect(i: int, name: str | None) -> list[TokenOutput]:
            return [t async for t in engine.generate(f"req-{i}", PROMPT, params, adapter=name)]

        outs = await asyncio.gather(*(collect(i, n) for i, n in enumerate(names)))
        return dict(zip(names, outs, strict=True)), engine.stats.max_adapters_in_step
    finally:
        await engine.stop()


def _assert_parity(got: Outputs, want: Outputs, adapters: dict[str, Path], tol: float) -> None:
    """Same tokens with logprobs within `tol`, as vLLM's `check_logprobs_close` judges: where the greedy tokens
    part, it must be a near-tie (each token in the other's top logprobs, within `tol` of the chosen one),
    and the comparison stops there, since the sequences continue from different tokens."""
    for name, expected in want.items():
        for pos, (g, e) in enumerate(zip(got[name], expected, strict=True)):
            if g.token_id == e.token_id:
                assert abs(g.logprob - e.logprob) < tol, f"adapter {name} token {pos}: {g.logprob} vs {e.logprob}"
                continue
            assert e.top_logprobs is not None and g.top_logprobs is not None
            assert g.token_id in e.top_logprobs and e.token_id in g.top_logprobs, f"adapter {name} token {pos}"
            assert e.logprob - e.top_logprobs[g.token_id] < tol, f"adapter {name} token {pos}: not a near-tie"
            assert g.logprob - g.top_logprobs[e.token_id] < tol, f"adapter {name} token {pos}: not a near-tie"
            break
    # the adapters really change the output, so the comparison covers the LoRA path
    base = [t.token_id for t in want[None]]
    assert sum([t.token_id for t in want[n]] != base for n in adapters) >= 2


class _KernelUse:
    """Records which LoRA layouts and how many paged-attention launches a run used."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.layouts: set[bool] = set()
        self.attn_calls = 0
        pick_layout = TritonLoRABackend.use_gathered
        attn_kernel = paged_attention.paged_attention_decode

        def recording_pick(backend: TritonLoRABackend, batch: LoRABatchInfo) -> bool:
            gathered = pick_layout(backend, batch)
            self.layouts.add(gathered)
            return gathered

        def counting_attn(*args: Any, **kwargs: Any) -> Any:
            self.attn_calls += 1
            return attn_kernel(*args, **kwargs)

        monkeypatch.setattr(TritonLoRABackend, "use_gathered", recording_pick)
        # these prompts are short: without this, prefill steps would be decode-sized and gathered too
        monkeypatch.setattr(triton_backend, "GATHERED_MAX_TOKENS", 0)
        monkeypatch.setattr(paged_attention, "paged_attention_decode", counting_attn)

    def check(self) -> None:
        assert self.layouts == {True, False}, "prefill should use the segmented and decode the gathered kernels"
        assert self.attn_calls > 0


async def test_triton_engine_matches_torch_on_a_mixed_adapter_batch(
    model_and_adapters: tuple[Path, dict[str, Path]], monkeypatch: pytest.MonkeyPatch, device: torch.device
) -> None:
    """fp32: interpreted on CPU, compiled on a GPU machine."""
    model, adapters = model_and_adapters
    torch_out, _ = await _run(model, adapters, "torch", device=device.type)
    use = _KernelUse(monkeypatch)
    triton_out, max_adapters = await _run(model, adapters, "triton", device=device.type)
    assert max_adapters >= 2, "the requests never shared a step"
    use.check()
    _assert_parity(triton_out, torch_out, adapters, LOGPROB_TOL["float32"])


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_compiled_triton_engine_on_cuda_matches_torch(
    model_and_adapters: tuple[Path, dict[str, Path]], monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    model, adapters = model_and_adapters
    torch_out, _ = await _run(model, adapters, "torch", device="cuda", dtype=dtype)
    use = _KernelUse(monkeypatch)
    triton_out, max_adapters = await _run(model, adapters, "triton", device="cuda", dtype=dtype)
    assert max_adapters >= 2, "the requests never shared a step"
    use.check()
    _assert_parity(triton_out, torch_out, adapters, LOGPROB_TOL[dtype])


@needs_cuda
async def test_engine_defaults_on_cuda_are_the_compiled_triton_path_in_bf16(
    model_and_adapters: tuple[Path, dict[str, Path]],
) -> None:
    model, adapters = model_and_adapters
    engine = Engine(model, device="cuda", max_loras=4, max_lora_rank=16)  # dtype and lora_backend "auto"
    assert engine.core.lora_backend_name == "triton" and engine.core.runner.model.attn_backend == "triton"
    assert engine.core.dtype == torch.bfloat16  # a float32 checkpoint is served in 16 bits on GPU
    assert engine.core.runner.kv.k_caches[0].is_cuda and engine.core.memory_plan is not None
    assert engine.core.memory_plan.kv <= torch.cuda.mem_get_info()[1]
    await engine.start()
    try:
        await engine.add_adapter("r16", adapters["r16"])
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        outs = [t async for t in engine.generate("r", PROMPT, params, adapter="r16")]
        assert len(outs) == MAX_TOKENS and outs[-1].finish_reason == "length"
    finally:
        await engine.stop()


@needs_cuda
@pytest.mark.parametrize("method", [m for m in QUANTIZATIONS if m != "w8a8_int8"])  # CPU-only
async def test_quantized_triton_engine_on_cuda_matches_torch(
    model_and_adapters: tuple[Path, dict[str, Path]], method: str
) -> None:
    model, adapters = model_and_adapters
    torch_out, _ = await _run(model, adapters, "torch", device="cuda", dtype="bfloat16", quantization=method)
    triton_out, max_adapters = await _run(
        model, adapters, "triton", device="cuda", dtype="bfloat16", quantization=method
    )
    assert max_adapters >= 2, "the requests never shared a step"
    _assert_parity(triton_out, torch_out, adapters, LOGPROB_TOL["bfloat16"])
    plain, _ = await _run(model, adapters, "triton", device="cuda", dtype="bfloat16")
    worst = max(
        abs(q.logprob - p.logprob)
        for name in plain
        for q, p in zip(triton_out[name], plain[name], strict=True)
        if q.token_id == p.token_id
    )
    assert worst > 0, "the quantized run gave the unquantized logprobs: the weights were not quantized"


# --- CUDA graphs (core/cuda_graphs.py) ------------------------------------------------------------------------


async def test_a_padded_graph_batch_computes_the_step(
    model_and_adapters: tuple[Path, dict[str, Path]], device: torch.device
) -> None:
    """What a decode graph reads: a step of 3 sequences (two adapters, one base row) copied into the static
    buffers of bucket 4, the padding row repeating row 0. Its forward pass (run eagerly here, replayed from a
    graph on CUDA) gives the step's logits, and leaves the KV cache exactly as the plain step leaves it."""
    model, adapters = model_and_adapters
    engine = Engine(model, device=device.type, dtype="float32", max_loras=4, max_lora_rank=16, lora_backend="triton")
    await engine.start()
    try:
        for name in ("r2", "r16"):
            await engine.add_adapter(name, adapters[name])
            params = SamplingParams(max_tokens=1, temperature=0.0)
            [_ async for _ in engine.generate(f"warm-{name}", PROMPT, params, adapter=name)]  # into a GPU slot
        core = engine.core
        assert core.manager is not None and core.runner.lora_backend is not None
        runner, kv = core.runner, core.runner.kv
        slots = [core.manager.slot_of("r16"), -1, core.manager.slot_of("r2")]
        assert None not in slots
        block, gen = kv.block_size, torch.Generator().manual_seed(0)
        for cache in (*kv.k_caches, *kv.v_caches):
            cache.copy_(torch.randn(cache.shape, generator=gen).to(cache.device, cache.dtype))
        lens = [2 * block + 1, 5, 3 * block]  # contexts (the new token included) over distinct blocks
        tables = [[1, 2, 3], [4, 0, 0], [5, 6, 7]]
        pos = [n - 1 for n in lens]
        batch = ForwardBatch(
            input_ids=torch.tensor([11, 52, 97], device=device),
            positions=torch.tensor(pos, device=device),
            slot_mapping=torch.tensor(
                [t[p // block] * block + p % block for t, p in zip(tables, pos, strict=True)], device=device
            ),
            num_decode=3,
            decode_block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            decode_seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
            prefills=[],
            logits_indices=torch.arange(3, device=device),
        )
        token_slots = torch.tensor(slots, dtype=torch.int32)
        before = [c.clone() for c in (*kv.k_caches, *kv.v_caches)]
        batch.lora = LoRAContext(
            runner.lora_backend, runner.lora_pool, runner.lora_backend.prepare(token_slots.to(device))
        )
        want = runner.model(batch, kv)
        after_step = [c.clone() for c in (*kv.k_caches, *kv.v_caches)]
        for cache, saved in zip((*kv.k_caches, *kv.v_caches), before, strict=True):
            cache.copy_(saved)

        graphs = DecodeGraphs(
            runner.model, kv, max_bs=8, max_model_len=64, lora_backend=runner.lora_backend, lora_pool=runner.lora_pool
        )
        assert graphs.sizes == (1, 2, 4, 8) and graphs.bucket(3) == 4
        graphs.fill(batch, token_slots, 4)
        assert graphs.token_slots[:4].tolist() == [*slots, slots[0]]  # the padding row repeats row 0
        got = runner.model(graphs.static_batch(4, lora=True), kv)
        torch.testing.assert_close(got[:3], want, atol=1e-5, rtol=1e-5)
        for cache, expected in zip((*kv.k_caches, *kv.v_caches), after_step, strict=True):
            torch.testing.assert_close(cache, expected, atol=0, rtol=0)  # the padding wrote nothing new
        assert not torch.allclose(want[0], want[2]), "the two adapters' rows should differ"
    finally:
        await engine.stop()


def test_capture_sizes() -> None:
    assert capture_sizes(1) == (1,)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert capture_sizes(256)[-3:] == (192, 224, 256)
    with pytest.raises(ValueError, match="between 1 and 256"):
        capture_sizes(257)


def test_cuda_graphs_need_cuda_and_the_triton_backend(model_and_adapters: tuple[Path, dict[str, Path]]) -> None:
    model, _ = model_and_adapters
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs --device cuda"):
            Engine(model, device="cpu", dtype="float32", max_loras=2, cuda_graph_max_bs=8)
    else:
        with pytest.raises(ValueError, match="triton LoRA backend"):
            Engine(model, device="cuda", dtype="float32", max_loras=2, lora_backend="torch", cuda_graph_max_bs=8)


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_cuda_graph_decode_matches_eager(
    model_and_adapters: tuple[Path, dict[str, Path]], dtype: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Compiled: decode steps replayed from CUDA graphs give eager's tokens and logprobs, with 4 requests
    (bucket 4) and with 3 (bucket 4, one padding row), base and adapters mixed."""
    model, adapters = model_and_adapters
    for subset in (adapters, {k: adapters[k] for k in ("r2", "r16")}):
        eager, _ = await _run(model, subset, "triton", device="cuda", dtype=dtype)
        with caplog.at_level(logging.INFO, logger="lorafleet_worker.core.cuda_graphs"):
            graphed, _ = await _run(model, subset, "triton", device="cuda", dtype=dtype, cuda_graph_max_bs=8)
        assert "captured the decode CUDA graph of 4 sequences with LoRA" in caplog.text
        _assert_parity(graphed, eager, subset, LOGPROB_TOL[dtype])
        caplog.clear()
