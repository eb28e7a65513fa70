"""Scheduling policy: chunked prefill, decode first, limits, preemption and slot aging (real KV cache and manager)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lorafleet_worker.config import ModelConfig
from lorafleet_worker.core.kv_cache_manager import KVCacheManager
from lorafleet_worker.core.request import SeqStatus, Sequence
from lorafleet_worker.core.scheduler import Scheduler
from lorafleet_worker.core.step import RunnerOutput, StepPlan
from lorafleet_worker.lora.manager import AdapterManager
from lorafleet_worker.sample.params import SampledToken, SamplingParams, TokenOutput

CPU = torch.device("cpu")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def manager(config: ModelConfig, tiny_models: Any, tiny_adapter_factory: Any) -> AdapterManager:
    """One GPU slot, adapters "a" and "b"."""
    m = AdapterManager(config, max_loras=1, max_cpu_loras=4, max_lora_rank=64, device=CPU)
    m.load("a", tiny_adapter_factory(tiny_models["llama"], rank=4, seed=1))
    m.load("b", tiny_adapter_factory(tiny_models["llama"], rank=16, rslora=True, seed=2))
    return m


def make_scheduler(config: ModelConfig, manager: Any = None, *, num_blocks: int = 64, **kw: Any) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4)
    opts: dict[str, Any] = {"max_num_seqs": 8, "max_num_batched_tokens": 64}
    return Scheduler(kv, manager, **{**opts, **kw})


_arrival = iter(range(10**6))


def seq(name: str, prompt_len: int = 4, manager: Any = None, adapter: str | None = None) -> Sequence:
    ref = manager.acquire(adapter) if adapter else None
    s = Sequence.create(
        name, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=100), max_len=1000, adapter=adapter, ref=ref
    )
    s.arrival = float(next(_arrival))
    return s


def advance(sched: Scheduler, plan: StepPlan) -> None:
    """The step's forward pass as the scheduler sees it: every chunk that generates samples token 0."""
    sampled = {c.seq.request_id: SampledToken(0, 0.0, None) for c in plan.chunks if c.generates}
    sched.update_from_output(plan, RunnerOutput(sampled=sampled))


def names(plan: StepPlan) -> list[str]:
    return [c.seq.request_id for c in plan.chunks]


def test_chunked_prefill_shares_steps_with_decodes(config: ModelConfig) -> None:
    sched = make_scheduler(config, max_num_batched_tokens=8)
    short, long = seq("short", 3), seq("long", 20)
    sched.add_request(short)
    advance(sched, sched.schedule())  # short prefilled
    sched.add_request(long)
    plans = []
    for _ in range(3):
        plan = sched.schedule()
        plans.append([(c.seq.request_id, c.num_tokens, c.samples) for c in plan.chunks])
        advance(sched, plan)
    # the decode token comes first; the long prompt fills the rest of each 8-token budget
    assert plans == [
        [("short", 1, True), ("long", 7, False)],
        [("short", 1, True), ("long", 7, False)],
        [("short", 1, True), ("long", 6, True)],
    ]
    assert long.num_computed == 20 and len(long.tokens) == 21


def test_max_num_seqs_limits_running(config: ModelConfig) -> None:
    sched = make_scheduler(config, max_num_seqs=2)
    seqs = [seq(f"s{i}") for i in range(3)]
    for s in seqs:
        sched.add_request(s)
    plan = sched.schedule()
    assert names(plan) == ["s0", "s1"] and seqs[2].status is SeqStatus.WAITING
    advance(sched, plan)
    sched.finish_requests([seqs[0].request_id], "stop")
    assert names(sched.schedule()) == ["s1", "s2"]


def test_out_of_blocks_preempts_the_newest_and_requeues_it_in_order(config: ModelConfig) -> None:
    sched = make_scheduler(config, num_blocks=4)
    sched.watermark_blocks = 0  # let admission fill the cache completely
    old, new, later = seq("old", 8), seq("new", 8), seq("later", 4)
    for s in (old, new):
        sched.add_request(s)
    advance(sched, sched.schedule())  # 2 blocks each: the cache is full
    sched.add_request(later)
    plan = sched.schedule()  # old needs a third block: new is preempted
    assert names(plan) == ["old"] and sched.num_preemptions == 1
    assert new.status is SeqStatus.WAITING and new.num_computed == 0 and sched.kv_cache.block_ids(new) == []
    assert [s.request_id for s in sched.waiting] == ["new", "later"]
    sched.finish_requests([old.request_id], "stop")
    assert names(sched.schedule()) == ["new", "later"]  # recomputed, FIFO order kept
    assert new.tokens == [*range(1, 9), 0]  # the generated token is kept and recomputed


def test_admission_keeps_a_watermark_for_running_decodes(config: ModelConfig) -> None:
    sched = make_scheduler(config, num_blocks=4)
    assert sched.watermark_blocks == 1
    full = seq("full", 16)  # all 4 blocks: admitted because nothing else runs
    sched.add_request(full)
    assert names(sched.schedule()) == ["full"]
    sched.finish_requests([full.request_id], "stop")
    first, second = seq("first", 8), seq("second", 8)
    sched.add_request(first)
    sched.add_request(second)
    assert names(sched.schedule()) == ["first"]  # second would leave no free block
    assert second.status is SeqStatus.WAITING


def test_slot_waiters_age_and_are_not_starved(config: ModelConfig, manager: AdapterManager) -> None:
    clock = Clock()
    sched = make_scheduler(config, manager, slot_aging_s=1.0, clock=clock)
    a1 = seq("a1", manager=manager, adapter="a")
    sched.add_request(a1)
    advance(sched, sched.schedule())
    b1, a2 = seq("b1", manager=manager, adapter="b"), seq("a2", manager=manager, adapter="a")
    sched.add_request(b1)
    sched.add_request(a2)
    plan = sched.schedule()  # b1 has no slot yet; a2 shares a's pinned slot and may pass it
    assert names(plan) == ["a1", "a2"] and b1.status is SeqStatus.WAITING
    assert sched.num_waiting_for_slot == 1
    advance(sched, plan)

    clock.now = 1.5  # b1 has aged: no new slot user passes it any more, base requests still do
    a3, base = seq("a3", manager=manager, adapter="a"), seq("base")
    sched.add_request(a3)
    sched.add_request(base)
    plan = sched.schedule()
    assert names(plan) == ["a1", "a2", "base"] and a3.status is SeqStatus.WAITING
    advance(sched, plan)
    sched.finish_requests([a1.request_id], "stop")
    sched.finish_requests([a2.request_id], "stop")
    plan = sched.schedule()  # a's slot drained: b1 gets it, a3 keeps waiting behind it
    assert names(plan) == ["base", "b1"] and b1.slot == 0 and a3.status is SeqStatus.WAITING
    advance(sched, plan)
    plan = sched.schedule()
    assert "b1" in names(plan) and "a3" not in names(plan) and plan.slots == {0}
    advance(sched, plan)
    sched.finish_requests([b1.request_id], "stop")
    assert "a3" in names(sched.schedule())
    assert manager.stats["slots_pinned"] == 1


def test_finish_releases_blocks_and_adapter_refs(config: ModelConfig, manager: AdapterManager) -> None:
    sched = make_scheduler(config, manager)
    s = seq("a", 9, manager, "a")
    sched.add_request(s)
    advance(sched, sched.schedule())
    assert sched.kv_cache.num_free_blocks == 64 - 3 and manager.stats["slots_pinned"] == 1
    assert sched.finish_requests(["a"], "abort") == [("a", TokenOutput(-1, 0.0, None, "abort"))]
    assert sched.finish_requests(["a"], "abort") == []  # idempotent
    assert sched.kv_cache.num_free_blocks == 64 and manager.stats["slots_pinned"] == 0
    assert s.status is SeqStatus.FINISHED and s.finish_reason == "abort" and not sched.has_work()


def test_decodes_are_grouped_by_lora_slot(config: ModelConfig, tiny_models: Any, tiny_adapter_factory: Any) -> None:
    """Each adapter's decode tokens are consecutive rows, so the LoRA backends update them in place."""
    from lorafleet_worker.lora.batch import build_batch_info

    m = AdapterManager(config, max_loras=2, max_cpu_loras=4, max_lora_rank=64, device=CPU)
    m.load("a", tiny_adapter_factory(tiny_models["llama"], rank=4, seed=1))
    m.load("b", tiny_adapter_factory(tiny_models["llama"], rank=8, seed=2))
    sched = make_scheduler(config, m)
    arrivals = [seq("a0", manager=m, adapter="a"), seq("b0", manager=m, adapter="b"), seq("base0"),
                seq("a1", manager=m, adapter="a"), seq("b1", manager=m, adapter="b")]  # fmt: skip
    for s in arrivals:
        sched.add_request(s)
    advance(sched, sched.schedule())  # the five prefills
    plan = sched.schedule()
    assert plan.num_decode == 5
    slots = [c.seq.slot for c in plan.chunks]
    assert slots == sorted(slots) and len(set(slots)) == 3  # base, a's slot, b's slot
    assert names(plan)[0] == "base0"
    info = build_batch_info(torch.tensor(slots, dtype=torch.int32))
    assert len(info.segments) == 2 and all(row >= 0 for row in info.segment_rows)
