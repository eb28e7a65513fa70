"""Slot pool overwrite semantics and the AdapterManager's tiers: LRU, pins, CPU eviction, hot swap."""

from __future__ import annotations

import contextlib
import random
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from lorafleet_worker.config import ModelConfig
from lorafleet_worker.lora.adapter import LoRAAdapter
from lorafleet_worker.lora.errors import AdapterError, AdapterNotFoundError, CapacityError
from lorafleet_worker.lora.manager import AdapterManager, AdapterRef
from lorafleet_worker.lora.pool import LoRAPool

GROUPS = ("qkv", "o", "gate_up", "down")


@pytest.fixture(scope="module")
def setup(tiny_models, tiny_adapter_factory) -> tuple[ModelConfig, dict[str, Path]]:
    base = tiny_models["llama"]
    paths = {
        "big": tiny_adapter_factory(base, rank=64, seed=10),
        "small": tiny_adapter_factory(base, rank=4, targets=("q_proj", "v_proj"), seed=11),
        "a": tiny_adapter_factory(base, rank=8, seed=12),
        "b": tiny_adapter_factory(base, rank=8, seed=13),
        "c": tiny_adapter_factory(base, rank=16, seed=14),
    }
    return ModelConfig.from_dir(base), paths


def _slot_state(pool: LoRAPool, slot: int) -> list[torch.Tensor]:
    state = []
    for layer in range(2):
        for group in GROUPS:
            w = pool.weights(layer, group)
            state += [w.A[slot], w.B[slot], w.ranks[slot], w.scalings[slot]]
    return state


def _assert_slot_holds(pool: LoRAPool, slot: int | None, adapter: LoRAAdapter) -> None:
    assert slot is not None
    fresh = LoRAPool(pool.config, num_slots=1, max_rank=pool.max_rank)
    fresh.write_slot(0, adapter)
    for got, want in zip(_slot_state(pool, slot), _slot_state(fresh, 0), strict=True):
        assert torch.equal(got, want)


def test_reused_slot_is_fully_overwritten(setup) -> None:
    config, paths = setup
    big = LoRAAdapter.load(paths["big"], config, 64)
    small = LoRAAdapter.load(paths["small"], config, 64)
    pool = LoRAPool(config, num_slots=2, max_rank=64)
    pool.write_slot(1, big)
    _assert_slot_holds(pool, 1, big)
    pool.write_slot(1, small)
    _assert_slot_holds(pool, 1, small)
    qkv = pool.weights(0, "qkv")
    assert qkv.ranks[1].tolist() == [4, 0, 4]
    assert qkv.ranks_cpu is not None and qkv.ranks_cpu[1].tolist() == [4, 0, 4]
    assert not qkv.A[1, :, 4:].any() and not qkv.B[1, :, 4:].any()
    assert not qkv.A[1, 1].any() and not qkv.B[1, 64:96].any()  # k slice: not adapted by `small`
    for group in ("o", "gate_up", "down"):
        w = pool.weights(0, group)
        assert not w.A[1].any() and not w.B[1].any() and not w.ranks[1].any() and not w.scalings[1].any()
    assert not any(t.any() for t in _slot_state(pool, 0))  # the other slot is untouched
    pool.write_slot(1, None)
    assert not any(t.any() for t in _slot_state(pool, 1))


def test_pool_rejects_adapter_above_its_rank(setup) -> None:
    config, paths = setup
    pool = LoRAPool(config, num_slots=1, max_rank=16)
    with pytest.raises(ValueError, match="exceeds the pool's max rank 16"):
        pool.write_slot(0, LoRAAdapter.load(paths["big"], config, 64))
    with pytest.raises(IndexError):
        pool.write_slot(1, None)


def _manager(config: ModelConfig, **kw) -> AdapterManager:
    args = {"max_loras": 2, "max_cpu_loras": 8, "max_lora_rank": 64, "device": "cpu", "dtype": torch.float32}
    return AdapterManager(config, **{**args, **kw})


def _use(manager: AdapterManager, name: str) -> int | None:
    """Acquire, activate and release `name` (waiting for its weights to be read back); the slot it got."""
    ref = manager.acquire(name)
    _wait_for_weights(manager, ref)
    slot = manager.activate(ref)
    manager.release(ref)
    return slot


def _wait_for_weights(manager: AdapterManager, ref: AdapterRef, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not manager.weights_ready(ref):
        assert time.monotonic() < deadline, "weights were not read back"
        time.sleep(0.01)


def test_slots_are_lru(setup) -> None:
    config, paths = setup
    m = _manager(config)
    for name in "abc":
        m.load(name, paths[name])
    sa, sb = _use(m, "a"), _use(m, "b")
    assert {sa, sb} == {0, 1}
    assert _use(m, "a") == sa  # resident: no reload, a is now most recently used
    assert _use(m, "c") == sb  # evicts b, the least recently used
    assert (m.slot_of("a"), m.slot_of("b"), m.slot_of("c")) == (sa, None, sb)
    _assert_slot_holds(m.pool, sb, LoRAAdapter.load(paths["c"], config, 64))
    stats = m.stats
    assert (stats["slots_used"], stats["slots_pinned"], stats["evictions"], stats["loads"]) == (2, 0, 1, 3)


def test_pinned_slots_are_never_evicted(setup) -> None:
    config, paths = setup
    m = _manager(config)
    for name in "abc":
        m.load(name, paths[name])
    ra, rb = m.acquire("a"), m.acquire("b")
    sa, sb = m.activate(ra), m.activate(rb)
    assert m.activate(ra) == sa  # idempotent per ref
    rc = m.acquire("c")
    assert m.activate(rc) is None  # every slot pinned
    assert m.stats["slots_pinned"] == 2
    ra2 = m.acquire("a")  # a second request on a shares a's slot
    assert m.activate(ra2) == sa
    m.release(ra)
    assert m.activate(rc) is None  # still pinned by ra2
    m.release(ra2)
    m.release(ra2)  # idempotent
    assert m.activate(rc) == sa
    _assert_slot_holds(m.pool, sa, LoRAAdapter.load(paths["c"], config, 64))
    assert m.slot_of("b") == sb
    _assert_slot_holds(m.pool, sb, LoRAAdapter.load(paths["b"], config, 64))
    m.release(rb)
    m.release(rc)
    with pytest.raises(ValueError, match="already released"):
        m.activate(rc)


def test_cpu_tier_is_lru_and_reloads_from_disk(setup, tmp_path: Path) -> None:
    config, paths = setup
    m = _manager(config, max_loras=1, max_cpu_loras=2)
    copies = {name: shutil.copytree(paths[name], tmp_path / name) for name in "abc"}
    m.load("a", copies["a"])
    m.load("b", copies["b"])
    assert _use(m, "a") == 0  # a becomes most recently used in the CPU tier
    m.load("c", copies["c"])  # evicts b's CPU copy
    assert (m.stats["cpu_resident"], m.stats["cpu_evictions"], m.stats["registered"]) == (2, 1, 3)
    assert m.names() == ["a", "b", "c"]
    assert _use(m, "b") == 0  # reloaded from disk into the slot
    assert m.stats["reloads"] == 1
    _assert_slot_holds(m.pool, 0, LoRAAdapter.load(paths["b"], config, 64))
    # a reload that fails (the files went away) is a clear AdapterError, and nothing is pinned
    m.load("d", copies["a"])
    assert m.stats["cpu_resident"] == 2
    evicted = next(n for n in "acd" if _reload_needed(m, n))
    gone = m.path_of(evicted)
    assert gone is not None
    shutil.rmtree(gone)
    ref = m.acquire(evicted)
    with pytest.raises(AdapterError, match="does not exist"):
        _wait_for_weights(m, ref)
    with pytest.raises(AdapterError, match="does not exist"):
        m.activate(ref)
    m.release(ref)
    assert m.stats["slots_pinned"] == 0


def test_reading_back_from_disk_holds_no_lock_and_runs_off_the_callers_thread(setup) -> None:
    config, paths = setup
    m = _manager(config, max_loras=2, max_cpu_loras=1)
    m.load("a", paths["a"])
    m.load("b", paths["b"])  # a leaves the CPU tier
    reading, release = threading.Event(), threading.Event()
    readers: list[str] = []
    plain_read = m._read

    def slow_read(path: Path) -> LoRAAdapter:
        readers.append(threading.current_thread().name)
        reading.set()
        assert release.wait(60)
        return plain_read(path)

    m._read = slow_read  # type: ignore[method-assign]
    woken = threading.Event()
    m.on_weights_ready = woken.set
    ref = m.acquire("a")
    assert m.activate(ref) is None  # not in memory: the read starts in the background
    assert reading.wait(60)
    assert not m.weights_ready(ref) and m.activate(ref) is None  # still reading; no second read
    assert _use(m, "b") is not None  # the manager's lock is free while the read blocks
    assert m.stats["slots_pinned"] == 0 and not woken.is_set()
    release.set()
    assert woken.wait(60)
    assert m.activate(ref) is not None and m.stats["reloads"] == 1
    assert readers == ["lora-read-a"]
    m.release(ref)


def test_cpu_tier_keeps_weights_a_waiting_request_needs(setup, tmp_path: Path) -> None:
    config, paths = setup
    m = _manager(config, max_loras=1, max_cpu_loras=1)
    m.load("a", shutil.copytree(paths["a"], tmp_path / "a"))
    waiting = m.acquire("a")
    m.load("b", paths["b"])  # over the cap, but a's holder has not run yet: a keeps its weights
    assert (m.stats["cpu_resident"], m.stats["cpu_evictions"]) == (2, 0)
    m.remove("a")
    shutil.rmtree(tmp_path / "a")  # the source is gone after the unload
    assert m.activate(waiting) == 0  # the request still runs, on the weights in memory
    _assert_slot_holds(m.pool, 0, LoRAAdapter.load(paths["a"], config, 64))
    m.release(waiting)
    assert m.stats["cpu_resident"] == 1
    m.load("c", paths["c"])  # b is held by no one: back under the cap
    assert (m.stats["cpu_resident"], m.stats["cpu_evictions"]) == (1, 1)


def _reload_needed(m: AdapterManager, name: str) -> bool:
    return m._registry[name].adapter is None


def test_hot_swap_keeps_old_weights_for_holders(setup) -> None:
    config, paths = setup
    m = _manager(config)
    m.load("x", paths["a"])
    old_ref = m.acquire("x")
    old_slot = m.activate(old_ref)
    m.load("x", paths["a"])  # same path: idempotent no-op
    same = m.acquire("x")
    assert same.version == old_ref.version
    m.release(same)
    with pytest.raises(AdapterError, match="already loaded from another path"):
        m.load("x", paths["b"])
    m.load("x", paths["b"], replace=True)
    new_ref = m.acquire("x")
    assert new_ref.version != old_ref.version
    new_slot = m.activate(new_ref)
    assert new_slot is not None and new_slot != old_slot
    _assert_slot_holds(m.pool, old_slot, LoRAAdapter.load(paths["a"], config, 64))
    _assert_slot_holds(m.pool, new_slot, LoRAAdapter.load(paths["b"], config, 64))
    assert m.stats["slots_used"] == 2
    m.release(old_ref)  # last holder of the old version: its slot is freed
    assert m.stats["slots_used"] == 1
    assert m.slot_of("x") == new_slot
    m.release(new_ref)


def test_a_refs_slot_is_its_versions_slot_while_pinned(setup) -> None:
    """The version holds the one record of the slot: a ref reads it while it pins it, and not after release."""
    config, paths = setup
    m = _manager(config, max_loras=1)
    m.load("x", paths["a"])
    ref, other = m.acquire("x"), m.acquire("x")
    assert ref.slot is None and not ref.pinned  # acquired, not activated
    slot = m.activate(ref)
    assert slot is not None and ref.slot == slot == m.slot_of("x") and ref.pinned
    assert other.slot is None  # same version, but this ref does not pin it
    m.release(ref)
    assert ref.slot is None and not ref.pinned
    m.release(other)


def test_the_manager_records_where_each_adapter_came_from(setup) -> None:
    config, paths = setup
    m = _manager(config)
    m.load("a", paths["a"], source="s3://bucket/a")
    m.load("b", paths["b"])
    assert m.sources() == {"a": "s3://bucket/a", "b": str(paths["b"])}
    m.load("a", paths["c"], replace=True, source="hf://org/c")
    assert m.source_of("a") == "hf://org/c" and m.source_of("zzz") is None
    m.remove("a")
    assert m.sources() == {"b": str(paths["b"])}


def test_remove_refuses_new_requests_but_holders_finish(setup) -> None:
    config, paths = setup
    m = _manager(config)
    m.load("a", paths["a"])
    waiting = m.acquire("a")  # admitted but not yet in a slot
    m.remove("a")
    assert m.names() == []
    with pytest.raises(AdapterNotFoundError) as info:
        m.acquire("a")
    assert info.value.status == 404
    with pytest.raises(AdapterNotFoundError):
        m.remove("a")
    slot = m.activate(waiting)  # the in-flight request still runs on its weights
    assert slot is not None
    assert m.stats["slots_used"] == 1
    m.release(waiting)
    assert m.stats["slots_used"] == 0 and m.stats["cpu_resident"] == 0


def test_invalid_adapter_and_capacity(setup, tmp_path: Path) -> None:
    config, paths = setup
    m = _manager(config, max_adapters=2, max_lora_rank=16)
    with pytest.raises(AdapterError, match="exceeds the maximum LoRA rank 16"):
        m.load("big", paths["big"])
    with pytest.raises(AdapterError, match="does not exist"):
        m.load("nope", tmp_path / "nope")
    assert m.names() == []
    m.load("a", paths["a"])
    m.load("b", paths["b"])
    with pytest.raises(CapacityError) as info:
        m.load("c", paths["c"])
    assert info.value.status == 507
    m.load("a", paths["c"], replace=True)  # a swap needs no new capacity
    assert m.names() == ["a", "b"]


def test_concurrent_loads_and_requests_stay_consistent(setup) -> None:
    """Loader threads hot-swap / remove names while a step-loop thread acquires, activates and releases."""
    config, paths = setup
    m = _manager(config, max_loras=2, max_cpu_loras=3)
    names = ["n0", "n1", "n2", "n3"]
    sources = [paths["a"], paths["b"], paths["c"], paths["small"]]
    errors: list[BaseException] = []
    stop = threading.Event()

    def loader(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(15):
                name = rng.choice(names)
                if rng.random() < 0.3:
                    with contextlib.suppress(AdapterNotFoundError):
                        m.remove(name)
                else:
                    m.load(name, rng.choice(sources), replace=True)
        except BaseException as e:
            errors.append(e)

    def step_loop() -> None:
        rng = random.Random(99)
        held: list[AdapterRef] = []
        try:
            while not stop.is_set() or held:
                if held and (stop.is_set() or rng.random() < 0.5):
                    m.release(held.pop(rng.randrange(len(held))))
                    continue
                try:
                    ref = m.acquire(rng.choice(names))
                except AdapterNotFoundError:
                    continue
                if not m.weights_ready(ref):  # being read back from disk in the background
                    m.release(ref)
                elif m.activate(ref) is None:
                    assert m.stats["slots_pinned"] == 2
                    m.release(ref)
                else:
                    held.append(ref)
        except BaseException as e:
            errors.append(e)

    loop = threading.Thread(target=step_loop)
    loaders = [threading.Thread(target=loader, args=(i,)) for i in range(3)]
    loop.start()
    for t in loaders:
        t.start()
    for t in loaders:
        t.join()
    stop.set()
    loop.join()
    assert not errors, errors
    stats = m.stats
    assert stats["slots_pinned"] == 0
    assert stats["registered"] == len(m.names())
    assert stats["cpu_resident"] <= 3
    live = {m.slot_of(n) for n in m.names()} - {None}
    assert stats["slots_used"] == len(live)  # retired versions released their slots
