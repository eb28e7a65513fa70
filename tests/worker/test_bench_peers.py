"""bench/bench_peers.py's paired comparison: the ratio summary and the idle server's CPU accounting."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def peers() -> ModuleType:
    sys.path.insert(0, str(BENCH_DIR))  # bench_peers imports its neighbours (common, llama_cpp) by name
    try:
        spec = importlib.util.spec_from_file_location("bench_peers", BENCH_DIR / "bench_peers.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_peers"] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH_DIR))


def test_ratio_summary_is_the_median_with_an_interval_around_it(peers: ModuleType) -> None:
    ratios = [0.90, 0.92, 0.95, 0.97, 1.01, 0.93, 0.94, 0.96, 0.91, 0.99, 0.95, 0.92]
    got = peers.ratio_summary(ratios)
    assert got["median"] == 0.945 and got["below_1"] == 11 and got["of"] == 12
    low, high = got["ci95"]
    assert low <= got["median"] <= high < 1.0  # every resampled median of these is below 1
    assert peers.ratio_summary(ratios) == got  # seeded: the same report every time
    tied = peers.ratio_summary([0.8, 1.2] * 6)
    assert tied["ci95"][0] < 1.0 < tied["ci95"][1]  # a tie's interval straddles 1


def test_adapter_picks_round_robin_or_base(peers: ModuleType) -> None:
    assert peers.adapter_picks(["a", "b"], 3) == ["a", "b", "a"]
    assert peers.adapter_picks([], 2) == [None, None]


def test_cpu_seconds_count_the_process_tree(peers: ModuleType) -> None:
    """A server's CPU time includes its children (lorafleet's engine may run in one): here a shell whose child
    burns CPU and then waits on its stdin."""
    burn = "import sys; sum(i * i for i in range(3_000_000)); print('done', flush=True); sys.stdin.read()"
    script = f'{sys.executable} -c "{burn}"'
    proc = subprocess.Popen(["sh", "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"done\n"  # the child finished its work
        server = peers.Server("lorafleet", "http://unused", proc)
        used = server.cpu_s()
        assert used >= 0.05, used  # the child's time counted, not only the idle shell's
        assert server.cpu_s() - used < 0.05  # and an idle tree adds next to nothing
    finally:
        assert proc.stdin is not None
        proc.stdin.close()  # the child reads end-of-file and exits, then the shell
        assert proc.wait(timeout=30) == 0
