"""One OpenMP pool per worker process (omp_threads.py): the engine's setup and adapter threads start none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import torch
from lorafleet_worker.host import omp_threads

# Run in a fresh interpreter (this one's pools are whatever earlier tests left): build an engine on the main
# thread, load an adapter, serve a request through it, then count the OS threads Python did not start. With
# UNDISCIPLINED set, the engine's setup and adapter loads run the way they did before omp_threads.py.
SCRIPT = r"""
import asyncio, json, sys
import torch
import lorafleet_worker.core.engine as engine_mod
from lorafleet_worker.host import omp_threads
from lorafleet_worker.sample.params import SamplingParams

model_dir, adapter_dir, undisciplined = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
if undisciplined:
    engine_mod.Engine.__init__ = engine_mod.Engine.__init__.__wrapped__
    engine_mod.serial = lambda fn: fn
before = omp_threads.native_threads()
engine = engine_mod.Engine(model_dir, max_loras=2, max_num_seqs=4, max_model_len=64, num_kv_blocks=4096)

async def main():
    await engine.start()
    await engine.add_adapter("a", adapter_dir)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    async for _ in engine.generate("r", [5, 17, 42], params, adapter="a"):
        pass
    after = omp_threads.native_threads()
    await engine.stop()
    return after

after = asyncio.run(main())
print(json.dumps({"before": before, "after": after, "team": torch.get_num_threads()}))
"""


def _native_threads_after_serving(
    model_dir: Path, adapter_dir: Path, undisciplined: bool, linear: str = ""
) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model_dir), str(adapter_dir), "1" if undisciplined else "0"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env={**os.environ, "LORAFLEET_CPU_LINEAR": linear},
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_engine_process_keeps_one_openmp_pool(tiny_models: Any, tiny_adapter_factory: Any) -> None:
    assert torch.get_num_threads() >= 2, "this test needs a machine with at least 2 CPUs"
    model_dir = tiny_models["llama"]
    adapter_dir = tiny_adapter_factory(model_dir, rank=8, seed=11)
    for linear in ("", "onednn"):  # this CPU's default base linears, and oneDNN's
        ours = _native_threads_after_serving(model_dir, adapter_dir, undisciplined=False, linear=linear)
        # the engine thread's pool: team - 1 workers; nothing else
        assert ours["after"] - ours["before"] == ours["team"] - 1, (linear, ours)
    # the measurement sees a second pool: the setup's, on the main thread, that outlives it (oneDNN's packing
    # runs a parallel probe on the calling thread; the panel kernel's packing of a tiny model runs none)
    theirs = _native_threads_after_serving(model_dir, adapter_dir, undisciplined=True, linear="onednn")
    assert theirs["after"] - theirs["before"] >= 2 * (theirs["team"] - 1), theirs


def test_serial_here_is_per_thread() -> None:
    team = torch.get_num_threads()
    assert team >= 2, "this test needs a machine with at least 2 CPUs"
    seen: list[int] = []

    def aux() -> None:
        omp_threads.serial_here()
        torch.ones(1 << 20).sum()  # a parallel op: runs on this thread alone
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=aux)
    thread.start()
    thread.join()
    assert seen == [1]
    assert torch.get_num_threads() == team


def test_run_in_fresh_thread_returns_and_raises() -> None:
    assert omp_threads.run_in_fresh_thread(lambda a, b=0: a + b, 2, b=3) == 5

    def fail() -> None:
        raise ValueError("boom")

    try:
        omp_threads.run_in_fresh_thread(fail)
    except ValueError as exc:
        assert str(exc) == "boom"
    else:
        raise AssertionError("the error was not re-raised")


def test_team_size_follows_omp_num_threads_then_the_cgroup_limit(tmp_path: Path) -> None:
    cpus = len(os.sched_getaffinity(0))
    assert omp_threads.team_size({"OMP_NUM_THREADS": "3"}, str(tmp_path)) == (3, "OMP_NUM_THREADS")
    assert omp_threads.team_size({}, str(tmp_path))[0] == cpus  # no cgroup files: the affinity mask
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert omp_threads.cgroup_cpu_limit(str(tmp_path)) is None
    assert omp_threads.team_size({}, str(tmp_path))[0] == cpus
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a CPU: one thread
    assert omp_threads.cgroup_cpu_limit(str(tmp_path)) == 0.5
    n, why = omp_threads.team_size({}, str(tmp_path))
    assert n == 1 and "cgroup" in why
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("150000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert omp_threads.cgroup_cpu_limit(str(v1)) == 1.5
    assert omp_threads.team_size({}, str(v1))[0] == min(cpus, 2)
