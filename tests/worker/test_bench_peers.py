"""bench/bench_peers.py's paired comparison: the ratio summary and the idle server's CPU accounting."""

from __future__ import annotations

import importlib.util
import statistics
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def _bench_module(name: str) -> ModuleType:
    sys.path.insert(0, str(BENCH_DIR))  # bench scripts import their neighbours (common, llama_cpp) by name
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH_DIR / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH_DIR))


@pytest.fixture(scope="module")
def peers() -> ModuleType:
    return _bench_module("bench_peers")


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


def _paired(peers: ModuleType, ours: list[float], theirs: list[float]) -> dict:
    """A paired result as `paired_passes` records it, from each pass's tok/s (ITL: 1000 / tok/s)."""
    passes = {name: [{"tok_s": t, "itl_p50_ms": round(1000 / t, 2), "ttft_p50_ms": 500.0, "itl_p99_ms": 90.0,
                      "loadavg_1": 1.0} for t in tok]
              for name, tok in (("lorafleet", ours), ("llama.cpp", theirs))}  # fmt: skip
    return {"passes": passes, "pairs": len(ours), "requests_per_pass": 32,
            "itl_ratio": peers.ratio_summary([b / a for a, b in zip(ours, theirs, strict=True)]),
            "tok_s_ratio": peers.ratio_summary([a / b for a, b in zip(ours, theirs, strict=True)]),
            "itl_p50_ms": {n: statistics.median(p["itl_p50_ms"] for p in ps) for n, ps in passes.items()}}  # fmt: skip


def test_a_paired_run_reports_its_medians_intervals_and_plot(
    peers: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`make bench-report` on a paired `bench_peers` run: each row has both servers' median tok/s and the
    ratio's interval, and the plot across concurrency is drawn (it failed on paired rows before)."""
    results = [{"pair": "w8a8:Q8_0", "scenario": "one", "runs": {},
                "paired": {"1": _paired(peers, [30.0, 32.0, 31.0], [28.0, 29.0, 30.0]),
                           "32": _paired(peers, [400.0, 430.0, 420.0], [160.0, 170.0, 165.0])}}]  # fmt: skip
    rows = peers.summarize(results)
    c32 = next(r for r in rows if r["concurrency"] == 32)
    assert (c32["lorafleet_tok_s"], c32["llama_tok_s"]) == (420.0, 165.0)
    low, high = c32["tok_s_ratio_ci95"]
    assert low <= c32["tok_s_ratio"] <= high and 2.4 < c32["tok_s_ratio"] < 2.7
    report = _bench_module("report")
    monkeypatch.setattr(report, "results_dir", lambda: tmp_path)
    data = {"machine": {"platform": "test", "cpu_count": 2, "torch": "x", "loadavg_1_5_15": [0, 0, 0]},
            "llama_cpp": "0.3.36", "threads": 2, "prompt_len": 128, "output_len": 64, "adapters": "generated",
            "results": results, "ratios": rows}  # fmt: skip
    text = "\n".join(report.peers_section(data))
    assert f"| w8a8:Q8_0 | one | 32 | 420.0 | 165.0 | {c32['tok_s_ratio']} [{low}, {high}] |" in text
    assert "| w8a8:Q8_0 | one | llama.cpp | 32 | 165.0 | 500.0 |" in text  # each server's median pass
    report.plot_peers(data, "peers.png")
    assert (tmp_path / "peers.png").read_bytes()[:4] == b"\x89PNG"
