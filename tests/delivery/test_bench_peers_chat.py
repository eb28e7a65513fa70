"""bench/bench_peers.py's multi-turn chat workload, its vLLM rows and their report, against a stand-in server."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.worker.test_bench_peers import _bench_module


@pytest.fixture(scope="module")
def peers() -> ModuleType:
    return _bench_module("bench_peers")


@pytest.fixture(scope="module")
def report() -> ModuleType:
    return _bench_module("report")


class FakeServer:
    """A streaming /v1/completions stand-in: each request gets `max_tokens` chunks " w<request>_<i>", and, when
    `timings` is set, llama.cpp's `timings` (the longest prompt prefix it saw before as reused); /metrics serves
    vLLM's prefix-cache counters (hits: that same prefix) unless `timings` is set (llama.cpp has none here)."""

    def __init__(self, timings: bool) -> None:
        self.timings = timings
        self.bodies: list[dict[str, Any]] = []
        self.seen: list[list[int]] = []
        self.hits = self.queries = 0
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                if fake.timings:
                    self.send_error(501)
                    return
                text = (f"# TYPE vllm:prefix_cache_hits counter\n"
                        f'vllm:prefix_cache_hits_total{{engine="0",model_name="base"}} {float(fake.hits)}\n'
                        f'vllm:prefix_cache_queries_total{{engine="0",model_name="base"}} {float(fake.queries)}\n'
                        f'vllm:prefix_cache_hits_created{{engine="0",model_name="base"}} 1.7e9\n').encode()  # fmt: skip
                self.send_response(200)
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = body["prompt"]
                with fake.lock:
                    n = len(fake.bodies)
                    fake.bodies.append(body)
                    reused = max((_common(prompt, old) for old in fake.seen), default=0)
                    fake.seen.append(prompt)
                    fake.hits += reused
                    fake.queries += len(prompt)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for i in range(body["max_tokens"]):
                    self.wfile.write(f"data: {json.dumps({'choices': [{'text': f' w{n}_{i}'}]})}\n\n".encode())
                final: dict[str, Any] = {"choices": [{"text": "", "finish_reason": "length"}]}
                if fake.timings:
                    final["timings"] = {"cache_n": reused, "prompt_n": len(prompt) - reused}
                self.wfile.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@pytest.fixture
def fake_server(request: pytest.FixtureRequest) -> Iterator[FakeServer]:
    server = FakeServer(timings=request.param)
    thread = threading.Thread(target=server.httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()
        thread.join(timeout=10)


def _encode(text: str) -> list[int]:
    """The stand-in tokenizer: " w<n>_<i>" is the token id 100_000 * n + i (a reply re-tokenizes to itself)."""
    return [100_000 * int(w[1:].split("_")[0]) + int(w.split("_")[1]) for w in text.split()]


def test_a_chat_script_shares_its_system_prompt_and_rotates_adapters(peers: ModuleType) -> None:
    convs = peers.chat_script(5, seed=3, vocab=1000, adapters=["a", "b"])
    assert [c.adapter for c in convs] == ["a", "b", "a", "b", "a"]
    assert all(c.system == convs[0].system and len(c.system) == peers.CHAT_SYSTEM for c in convs)
    assert all(len(c.users) == peers.CHAT_TURNS and {len(u) for u in c.users} == {peers.CHAT_USER} for c in convs)
    assert len({tuple(c.users[0]) for c in convs}) == 5  # each conversation its own messages
    assert peers.chat_script(5, seed=3, vocab=1000, adapters=["a", "b"]) == convs  # a seed is one pass, repeatable
    assert peers.chat_script(1, seed=4, vocab=1000, adapters=[])[0].system != convs[0].system  # another pass: cold
    assert peers.chat_script(2, seed=3, vocab=1000, adapters=[])[0].adapter is None
    longest = peers.CHAT_SYSTEM + peers.CHAT_TURNS * peers.CHAT_USER + (peers.CHAT_TURNS - 1) * peers.CHAT_REPLY
    assert longest + peers.CHAT_REPLY <= peers.CHAT_CTX  # the last turn and its reply fit the servers' context


@pytest.mark.parametrize("fake_server", [False], indirect=True)
def test_each_turn_resends_the_history_with_the_servers_reply(peers: ModuleType, fake_server: FakeServer) -> None:
    """lorafleet / vLLM: turn k + 1's prompt is turn k's prompt, the reply it streamed (re-tokenized, at most
    CHAT_REPLY tokens) and the next user message; the prefix-cache hit rate comes from their /metrics."""
    server = peers.Server("vllm/auto", fake_server.url, None)
    convs = peers.chat_script(3, seed=1, vocab=1000, adapters=["french"])
    got = asyncio.run(peers.chat_pass(server, convs, 2, _encode))
    bodies = fake_server.bodies
    assert len(bodies) == got["requests"] == 3 * peers.CHAT_TURNS
    assert got["tokens"] == 3 * peers.CHAT_TURNS * peers.CHAT_REPLY
    assert all(b["max_tokens"] == peers.CHAT_REPLY and b["model"] == "french" and b["ignore_eos"] for b in bodies)
    assert all("cache_prompt" not in b for b in bodies)  # only llama.cpp is asked
    for conv in convs:
        first = [*conv.system, *conv.users[0]]
        i = next(i for i, b in enumerate(bodies) if b["prompt"] == first)
        turns = [i]
        for turn in range(1, peers.CHAT_TURNS):
            prev = bodies[turns[-1]]["prompt"]
            want = [*prev, *(100_000 * turns[-1] + k for k in range(peers.CHAT_REPLY)), *conv.users[turn]]
            turns.append(next(j for j, b in enumerate(bodies) if b["prompt"] == want))
        assert len(bodies[turns[-1]]["prompt"]) == 64 + 4 * 32 + 3 * 32
    assert got["prompt_tokens"] == sum(len(b["prompt"]) for b in bodies)
    assert got["prefix_hit_rate"] == round(fake_server.hits / fake_server.queries, 3) and got["prefix_hit_rate"] > 0.5
    assert got["ttft_first_p50_ms"] is not None and got["ttft_later_p50_ms"] is not None


@pytest.mark.parametrize("fake_server", [True], indirect=True)
def test_llama_cpp_is_asked_to_reuse_its_slot_and_reports_what_it_reused(
    peers: ModuleType, fake_server: FakeServer
) -> None:
    server = peers.Server("llama.cpp", fake_server.url, None, {"french": 0})
    convs = peers.chat_script(2, seed=2, vocab=1000, adapters=["french"])
    got = asyncio.run(peers.chat_pass(server, convs, 1, _encode))
    assert all(b["cache_prompt"] is True and b["lora"] == [{"id": 0, "scale": 1.0}] for b in fake_server.bodies)
    assert got["prefix_hit_rate"] == round(fake_server.hits / fake_server.queries, 3)
    single = server.body([1, 2], "french", 8, True)
    assert single["cache_prompt"] is False  # the single-prompt workload: nothing to reuse, nothing asked


def _chat_pass(tok_s: float, later: float, hit: float | None) -> dict[str, Any]:
    return {"tok_s": tok_s, "itl_p50_ms": round(1000 / tok_s, 2), "ttft_p50_ms": later, "ttft_first_p50_ms": 300.0,
            "ttft_later_p50_ms": later, "itl_p99_ms": 50.0, "prefix_hit_rate": hit, "loadavg_1": 1.0}  # fmt: skip


def test_paired_chat_rows_compare_later_turns_and_hit_rates_with_vllms_better_placement(
    peers: ModuleType, report: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    passes = {
        "lorafleet": [_chat_pass(t, 40.0, 0.8) for t in (100.0, 104.0, 102.0)],
        "vllm/auto": [_chat_pass(t, 80.0, 0.7) for t in (50.0, 52.0, 51.0)],
        "vllm/cores": [_chat_pass(t, 90.0, 0.7) for t in (40.0, 41.0, 42.0)],
    }
    paired = peers.paired_summary(passes, 3, 8)
    assert paired["by_peer"]["vllm/auto"]["ttft_later_ratio"]["median"] == 0.5
    assert paired["ttft_later_p50_ms"] == {"lorafleet": 40.0, "vllm/auto": 80.0, "vllm/cores": 90.0}
    greedy = [{"adapter": "base", "agree": 2, "of": 3, "first_diff": [None, 5, None], "texts": []}]
    results = [{"pair": "bf16:BF16", "scenario": "one", "runs": {}, "chat_paired": {"8": paired},
                "greedy_by_server": {"vllm/auto": greedy}}]  # fmt: skip
    assert peers.summarize(results, "vllm") == []  # no single-prompt passes
    (row,) = peers.summarize(results, "vllm", "chat")
    assert (row["bind"], row["workload"], row["lorafleet_tok_s"], row["vllm_tok_s"]) == ("auto", "chat", 102.0, 51.0)
    assert (row["lorafleet_ttft_later_p50_ms"], row["vllm_ttft_later_p50_ms"], row["ttft_later_ratio"]) == (
        40.0,
        80.0,
        0.5,
    )
    assert (row["lorafleet_prefix_hit_rate"], row["vllm_prefix_hit_rate"]) == (0.8, 0.7)
    rates = peers.greedy_rates(results)
    assert rates["vllm/auto"]["rate"] == 0.667 and rates["vllm/auto"]["by_pair"]["bf16:BF16"]["same"] == 2
    older = [{"pair": "f32:F32", "scenario": "base", "greedy": [{**greedy[0], "agree": 3}]}]  # llama.cpp alone
    whole = {"same": 3, "of": 3, "rate": 1.0}
    assert peers.greedy_rates(older)["llama.cpp"] == {**whole, "by_pair": {"f32:F32": whole}}

    monkeypatch.setattr(report, "results_dir", lambda: tmp_path)
    data = {"machine": {"cpu_count": 2, "torch": "x", "loadavg_1_5_15": [0, 0, 0]}, "llama_cpp": "0.3.36",
            "threads": 2, "prompt_len": 128, "output_len": 64, "adapters": "trained", "results": results,
            "vllm": {"version": "0.32.0", "binds": ["auto", "cores"], "ld_preload": []},
            "chat": {"turns": 4, "system_tokens": 64, "user_tokens": 32, "reply_tokens": 32},
            "ratios": [], "vllm_ratios": [], "chat_ratios": [], "vllm_chat_ratios": [row],
            "greedy_rates": rates}  # fmt: skip
    text = "\n".join(report.peers_section(data))
    ratio = row["tok_s_ratio"]
    low, high = row["tok_s_ratio_ci95"]
    assert f"| bf16:BF16 | one | 8 | 102.0 | 51.0 | {ratio} [{low}, {high}] | 40.0 | 80.0 | 0.5 [" in text
    assert "| bf16:BF16 | one | vllm/auto | 8 | 51.0 | 300.0 | 80.0 |" in text  # every chat run, median pass
    assert "| bf16:BF16 | one | vllm/auto | base | 2/3 | None, 5, None |" in text
    assert "| vllm/auto | 2/3 | 0.667 | bf16:BF16 0.667 |" in text
    report.plot_peers(data, "peers_vllm.png")
    assert (tmp_path / "peers_vllm.png").read_bytes()[:4] == b"\x89PNG"


def test_rounds_chat_rows_use_each_sides_best_round(peers: ModuleType) -> None:
    runs = {"lorafleet": {"1": [_chat_pass(30.0, 20.0, 0.9), _chat_pass(33.0, 22.0, 0.9)]},
            "llama.cpp": {"1": [_chat_pass(22.0, 30.0, 0.85)]}}  # fmt: skip
    results = [{"pair": "f32:F32", "scenario": "base", "runs": {}, "chat_runs": runs}]
    (row,) = peers.summarize(results, "llama.cpp", "chat")
    assert (row["lorafleet_tok_s"], row["llama_tok_s"], row["tok_s_ratio"]) == (33.0, 22.0, 1.5)
    assert (row["ttft_later_ratio"], row["ttft_later_ratio_ci95"], row["llama_prefix_hit_rate"]) == (0.73, None, 0.85)
    assert "bind" not in row


def test_vllm_binds_auto_within_the_benchmarks_cpus_and_caches_prefixes(tmp_path: Path) -> None:
    vllm = _bench_module("vllm_server")
    env = vllm.server_env("auto", [0, 1], 1, preload=[])
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "auto" and "OMP_NUM_THREADS" not in env and "LD_PRELOAD" not in env
    assert vllm.DEFAULT_BINDS == ("auto", "cores")
    cmd = vllm.server_command(tmp_path, [], port=1, dtype="bfloat16", max_num_seqs=32, max_model_len=384)
    assert "--enable-prefix-caching" in cmd and cmd[cmd.index("--max-model-len") + 1] == "384"
    assert "--block-size" not in cmd  # vLLM's own CPU default (128) unless asked
    small = vllm.server_command(tmp_path, [], port=1, dtype="bfloat16", max_num_seqs=32, max_model_len=384,
                                block_size=32)  # fmt: skip
    assert small[small.index("--block-size") + 1] == "32"


def test_the_bench_peers_command_line_names_its_workloads() -> None:
    """`--help` parses (the defaults are computed at parse time) and offers both workloads and vLLM's binds."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([str(root / ".venv" / "bin" / "python"), str(root / "bench" / "bench_peers.py"), "--help"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "--workloads {single,chat}" in out.stdout and "auto,cores,reserve1,nobind" in out.stdout
