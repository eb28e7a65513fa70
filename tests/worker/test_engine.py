"""Engine end to end (own model, paged KV, continuous batching, LoRA) against transformers + PEFT."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from lorafleet_worker.core.engine import Engine
from lorafleet_worker.lora.errors import AdapterError, AdapterNotFoundError
from lorafleet_worker.sample.params import SamplingParams, TokenOutput

PROMPTS = [[7], [5, 17, 42, 99, 3], [int(x) for x in torch.arange(30, 430, 10)]]  # 1, 5 and 40 tokens
MAX_TOKENS = 6
ADAPTERS: dict[str, dict[str, Any]] = {  # all seven projections, ranks 4..64
    "r4": {"rank": 4, "seed": 1},
    "r16-rslora": {"rank": 16, "rslora": True, "seed": 2},
    "r8-pattern": {
        "rank": 8,
        "rank_pattern": {"q_proj": 4, "down_proj": 12},
        "alpha_pattern": {"v_proj": 3.0},
        "seed": 3,
    },
    "r64": {"rank": 64, "alpha": 32, "seed": 4},
}
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0)

Result = tuple[list[int], list[float], str | None]


class Reference:
    """Greedy tokens and log-probs from transformers + PEFT (one PeftModel per arch, every adapter loaded)."""

    def __init__(self, tiny_models: Any, adapter_dir: Callable[[str, str], Path]) -> None:
        self.tiny_models = tiny_models
        self.adapter_dir = adapter_dir
        self._cache: dict[tuple[str, tuple[int, ...], str | None, int], tuple[list[int], list[float]]] = {}

    @cache  # noqa: B019 - one per test session
    def model(self, arch: str) -> Any:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(self.tiny_models[arch], dtype=torch.float32).eval()
        names = list(ADAPTERS)
        peft = PeftModel.from_pretrained(base, self.adapter_dir(arch, names[0]), adapter_name=names[0])
        for name in names[1:]:
            peft.load_adapter(self.adapter_dir(arch, name), adapter_name=name)
        return peft.eval()

    def greedy(self, arch: str, prompt: list[int], adapter: str | None, n: int = MAX_TOKENS) -> Result:
        key = (arch, tuple(prompt), adapter, n)
        if key not in self._cache:
            self._cache[key] = self._run(arch, prompt, adapter, n)
        toks, lps = self._cache[key]
        return toks, lps, "length"

    def _run(self, arch: str, prompt: list[int], adapter: str | None, n: int) -> tuple[list[int], list[float]]:
        return peft_greedy(self.model(arch), prompt, adapter, n)


@torch.no_grad()
def peft_greedy(model: Any, prompt: list[int], adapter: str | None, n: int) -> tuple[list[int], list[float]]:
    """`n` greedy tokens and their log-probs from a PeftModel, with `adapter` (None: adapters disabled)."""
    ids, toks, lps = list(prompt), [], []
    for _ in range(n):
        if adapter is None:
            with model.disable_adapter():
                logits = model(torch.tensor([ids])).logits[0, -1]
        else:
            model.set_adapter(adapter)
            logits = model(torch.tensor([ids])).logits[0, -1]
        lp = torch.log_softmax(logits.float(), -1)
        t = int(lp.argmax())
        toks.append(t)
        lps.append(float(lp[t]))
        ids.append(t)
    return toks, lps


@pytest.fixture(scope="module")
def adapter_dir(tiny_models: Any, tiny_adapter_factory: Any) -> Callable[[str, str], Path]:
    def get(arch: str, name: str) -> Path:
        return tiny_adapter_factory(tiny_models[arch], **ADAPTERS[name])

    return get


@pytest.fixture(scope="module")
def reference(tiny_models: Any, adapter_dir: Callable[[str, str], Path]) -> Reference:
    return Reference(tiny_models, adapter_dir)


EngineFactory = Callable[..., Awaitable[Engine]]


@pytest.fixture
async def make_engine(tiny_models: Any) -> AsyncIterator[EngineFactory]:
    started: list[Engine] = []

    async def make(arch: str = "llama", **kw: Any) -> Engine:
        opts: dict[str, Any] = {"max_loras": 4, "block_size": 4, "max_model_len": 256, "max_num_batched_tokens": 32}
        engine = Engine(tiny_models[arch], **{**opts, **kw})
        await engine.start()
        started.append(engine)
        return engine

    yield make
    for engine in started:
        await engine.stop()


async def drain(stream: AsyncIterator[TokenOutput]) -> Result:
    toks, lps, reason = [], [], None
    async with asyncio.timeout(120):
        async for out in stream:
            toks.append(out.token_id)
            lps.append(out.logprob)
            reason = out.finish_reason
    return toks, lps, reason


async def collect(
    engine: Engine, rid: str, prompt: list[int], params: SamplingParams, adapter: str | None = None
) -> Result:
    return await drain(engine.generate(rid, prompt, params, adapter))


def assert_matches(got: Result, want: Result) -> None:
    assert got[0] == want[0]
    assert got[2] == want[2]
    assert max(abs(a - b) for a, b in zip(got[1], want[1], strict=True)) < 1e-3


async def wait_until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


# ----------------------------------------------------------------------------------- base model


async def test_engine_requires_start(tiny_models: Any) -> None:
    engine = Engine(tiny_models["llama"], max_loras=0, max_model_len=64)
    with pytest.raises(RuntimeError, match="not running"):
        engine.generate("x", [1], GREEDY)


async def test_kv_exhaustion_makes_requests_wait(make_engine: EngineFactory, reference: Reference) -> None:
    # 4 requests of 50 tokens need 13 blocks each; 20 blocks hold one and a half of them.
    engine = await make_engine(max_loras=0, max_model_len=64, num_kv_blocks=20)
    prompts = [[int(x) for x in torch.arange(30, 60) + 7 * i] for i in range(4)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    results = await asyncio.gather(*(collect(engine, f"r{i}", p, params) for i, p in enumerate(prompts)))
    for p, got in zip(prompts, results, strict=True):
        want = reference.greedy("llama", p, None, 20)
        assert_matches(got, want)
    assert engine.stats.preemptions >= 1
    assert engine.stats.max_seqs_in_step < 4
    assert engine.stats.kv_blocks_free == 20 and engine.stats.num_running == 0


async def test_seeded_sampling_is_reproducible_in_any_batch(make_engine: EngineFactory) -> None:
    engine = await make_engine(max_loras=0)
    prompt = PROMPTS[1]
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, top_k=50, seed=7, ignore_eos=True)
    alone = await collect(engine, "alone", prompt, params)
    others = [
        collect(engine, f"o{i}", p, SamplingParams(max_tokens=12, temperature=1.0, seed=i, ignore_eos=True))
        for i, p in enumerate(PROMPTS)
    ]
    batched, *_ = await asyncio.gather(collect(engine, "batched", prompt, params), *others)
    assert batched[0] == alone[0]
    other_seed = await collect(engine, "seed8", prompt, SamplingParams(**{**params.__dict__, "seed": 8}))
    assert other_seed[0] != alone[0]


async def test_stop_tokens_and_length_limits(make_engine: EngineFactory, reference: Reference) -> None:
    prompt = PROMPTS[1]
    want, _, _ = reference.greedy("llama", prompt, None, MAX_TOKENS)
    engine = await make_engine(max_loras=0, max_model_len=len(prompt) + 4)
    stop = want[2]
    toks, _, reason = await collect(engine, "stop", prompt, SamplingParams(temperature=0, stop_token_ids=[stop]))
    assert toks == want[: want.index(stop) + 1] and reason == "stop"
    toks, _, reason = await collect(
        engine, "len", prompt, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    )
    assert toks == want[:4] and reason == "length"  # max_model_len cuts before max_tokens
    toks, _, reason = await collect(engine, "max", prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert toks == want[:2] and reason == "length"


async def test_bad_requests_are_refused_and_the_engine_keeps_serving(make_engine: EngineFactory) -> None:
    engine = await make_engine(max_model_len=16)
    vocab = engine.config.vocab_size
    for prompt, match in [([], "empty"), ([vocab], "token ids"), ([-1], "token ids"), ([1] * 16, "context length")]:
        with pytest.raises(ValueError, match=match):
            engine.generate("bad", prompt, GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        engine.generate("bad", [1], SamplingParams(temperature=-1))
    with pytest.raises(AdapterNotFoundError):
        engine.generate("bad", [1], GREEDY, adapter="nope")
    stream = engine.generate("dup", [1, 2], SamplingParams(max_tokens=3, temperature=0))
    with pytest.raises(ValueError, match="duplicate"):
        engine.generate("dup", [1, 2], GREEDY)
    assert len([o async for o in stream]) == 3
    assert (await collect(engine, "ok", [1, 2, 3], GREEDY))[2] == "length"


# ----------------------------------------------------------------------------------- LoRA


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
async def test_mixed_batch_matches_transformers_and_peft(
    arch: str, make_engine: EngineFactory, reference: Reference, adapter_dir: Callable[[str, str], Path]
) -> None:
    engine = await make_engine(arch)
    for name in ADAPTERS:
        await engine.add_adapter(name, adapter_dir(arch, name))
    jobs = [(p, a) for p in PROMPTS for a in [None, *ADAPTERS]]
    results = await asyncio.gather(*(collect(engine, f"r{i}", p, GREEDY, a) for i, (p, a) in enumerate(jobs)))
    for (prompt, adapter), got in zip(jobs, results, strict=True):
        assert_matches(got, reference.greedy(arch, prompt, adapter))
    assert engine.stats.max_seqs_in_step > len(ADAPTERS)  # really one mixed batch
    assert engine.stats.max_adapters_in_step == len(ADAPTERS)


async def test_more_adapters_than_slots_all_complete(
    make_engine: EngineFactory, reference: Reference, adapter_dir: Callable[[str, str], Path]
) -> None:
    engine = await make_engine(max_loras=2, slot_aging_s=0.05)
    for name in ADAPTERS:
        await engine.add_adapter(name, adapter_dir("llama", name))
    jobs = [(p, a) for p in PROMPTS[:2] for a in [*ADAPTERS, None]]
    results = await asyncio.gather(*(collect(engine, f"r{i}", p, GREEDY, a) for i, (p, a) in enumerate(jobs)))
    for (prompt, adapter), got in zip(jobs, results, strict=True):
        assert_matches(got, reference.greedy("llama", prompt, adapter))
    assert engine.stats.max_adapters_in_step == 2  # the bound is reached and never exceeded
    assert engine.manager.stats["evictions"] >= 2 and engine.manager.stats["slots_pinned"] == 0


async def test_abort_frees_blocks_and_slot(make_engine: EngineFactory, adapter_dir: Callable[[str, str], Path]) -> None:
    engine = await make_engine()
    await engine.add_adapter("r4", adapter_dir("llama", "r4"))
    stream = engine.generate("long", PROMPTS[2], SamplingParams(max_tokens=200, ignore_eos=True), adapter="r4")
    got = [await anext(stream), await anext(stream)]
    assert all(o.finish_reason is None for o in got)
    assert engine.stats.kv_blocks_free < engine.stats.kv_blocks_total
    await stream.aclose()  # type: ignore[attr-defined]
    await wait_until(lambda: engine.stats.requests_aborted == 1)
    assert engine.stats.num_running == 0 and engine.stats.kv_blocks_free == engine.stats.kv_blocks_total
    assert engine.manager.stats["slots_pinned"] == 0


async def test_interrupt_raises_in_the_stream_and_its_end_aborts(make_engine: EngineFactory) -> None:
    """`interrupt` (how a client disconnect reaches a waiting stream) raises at the stream's next read, after the
    outputs already queued; the stream's end aborts the request; a request that ended ignores it."""

    class Gone(Exception):
        pass

    engine = await make_engine(max_loras=0)
    stream = engine.generate("long", PROMPTS[2], SamplingParams(max_tokens=200, ignore_eos=True))
    assert (await anext(stream)).finish_reason is None
    engine.interrupt("long", Gone())
    with pytest.raises(Gone):
        for _ in range(200):
            assert (await anext(stream)).finish_reason is None
    await wait_until(lambda: engine.stats.requests_aborted == 1 and engine.num_pending == 0)
    assert engine.stats.num_running == 0 and engine.stats.kv_blocks_free == engine.stats.kv_blocks_total
    engine.interrupt("long", Gone())  # ended: nothing to raise into


async def test_remove_waits_for_inflight_and_refuses_new(
    make_engine: EngineFactory, reference: Reference, adapter_dir: Callable[[str, str], Path]
) -> None:
    engine = await make_engine()
    await engine.add_adapter("r4", adapter_dir("llama", "r4"))
    prompt = PROMPTS[1]
    stream = engine.generate("s", prompt, SamplingParams(max_tokens=150, temperature=0, ignore_eos=True), "r4")
    first = await anext(stream)
    removal = asyncio.create_task(engine.remove_adapter("r4"))
    await wait_until(lambda: "r4" not in engine.adapters())
    with pytest.raises(AdapterNotFoundError):
        engine.generate("new", prompt, GREEDY, "r4")
    rest = [o async for o in stream]
    assert rest[-1].finish_reason == "length" and len(rest) == 149
    want, _, _ = reference.greedy("llama", prompt, "r4")
    assert [first.token_id, *(o.token_id for o in rest)][:MAX_TOKENS] == want
    assert await asyncio.wait_for(removal, 30) is True
    assert await engine.remove_adapter("r4") is False


async def test_hot_swap_keeps_admitted_requests_on_old_weights(
    make_engine: EngineFactory, reference: Reference, adapter_dir: Callable[[str, str], Path]
) -> None:
    engine = await make_engine()
    await engine.add_adapter("swap", adapter_dir("llama", "r4"))
    prompt = PROMPTS[1]
    old = asyncio.create_task(drain(engine.generate("old", prompt, GREEDY, "swap")))  # holds the old version
    await engine.add_adapter("swap", adapter_dir("llama", "r64"), replace=True)
    new = await collect(engine, "new", prompt, GREEDY, "swap")
    assert_matches(await old, reference.greedy("llama", prompt, "r4"))
    assert_matches(new, reference.greedy("llama", prompt, "r64"))


async def test_adapter_that_cannot_be_reloaded_fails_only_its_request(
    make_engine: EngineFactory, reference: Reference, adapter_dir: Callable[[str, str], Path], tmp_path: Path
) -> None:
    engine = await make_engine(max_loras=1, max_cpu_loras=1)
    gone = shutil.copytree(adapter_dir("llama", "r4"), tmp_path / "gone")
    await engine.add_adapter("gone", gone)
    await engine.add_adapter("r4", adapter_dir("llama", "r4"))  # pushes "gone" out of the CPU tier
    shutil.rmtree(gone)
    with pytest.raises(AdapterError):
        await collect(engine, "x", PROMPTS[1], GREEDY, "gone")
    assert_matches(await collect(engine, "y", PROMPTS[1], GREEDY, "r4"), reference.greedy("llama", PROMPTS[1], "r4"))
    assert engine.stats.kv_blocks_free == engine.stats.kv_blocks_total


async def test_stop_aborts_requests_in_flight(make_engine: EngineFactory) -> None:
    engine = await make_engine()
    stream = engine.generate("long", PROMPTS[1], SamplingParams(max_tokens=200, ignore_eos=True))
    assert (await anext(stream)).finish_reason is None
    await engine.stop()
    rest = [o async for o in stream]
    assert rest[-1].finish_reason == "abort" and len(rest) < 199
    with pytest.raises(RuntimeError, match="not running"):
        engine.generate("after", [1], GREEDY)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"lora_backend": "triton"}, "needs --device cuda"),
        ({"lora_backend": "cuda-magic"}, "unknown LoRA backend"),
        ({"device": "mps"}, "unsupported device"),
        ({"dtype": "int8"}, "unsupported dtype"),
        ({"num_kv_blocks": 3}, "cannot hold one sequence"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
    ],
)
def test_bad_engine_options_give_clear_errors(tiny_models: Any, kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Engine(tiny_models["llama"], max_model_len=64, block_size=16, **kw)


async def test_eos_ends_a_request_unless_ignored(tiny_models: Any, reference: Reference, tmp_path: Path) -> None:
    prompt = PROMPTS[1]
    want, _, _ = reference.greedy("llama", prompt, None, MAX_TOKENS)
    model = shutil.copytree(tiny_models["llama"], tmp_path / "model")
    cfg = json.loads((model / "config.json").read_text())
    cfg["eos_token_id"] = [want[3]]
    (model / "config.json").write_text(json.dumps(cfg))
    (model / "generation_config.json").unlink()  # its eos ids would be merged in too
    engine = Engine(model, max_loras=0, max_model_len=64)
    await engine.start()
    try:
        toks, _, reason = await collect(engine, "eos", prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
        assert toks == want[: want.index(want[3]) + 1] and reason == "stop"
        toks, _, reason = await collect(engine, "ign", prompt, GREEDY)
        assert toks == want and reason == "length"
    finally:
        await engine.stop()
