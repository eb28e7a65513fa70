"""lorafleet side by side with llama.cpp's llama-server and vLLM's OpenAI server: one harness, the same prompts.

The servers (`--servers`, default all three) run the real model (SmolLM2-135M-Instruct) on this machine, each
alone, with the same threads; the harness is one async HTTP client that streams `/v1/completions` from each
(prompts as token ids, greedy, `ignore_eos`). Two workloads (`--workloads`):
  single    distinct prompts of 128 token ids, 64 output tokens each: nothing for a prefix cache to reuse
  chat      conversations of 4 turns: a 64-token system prompt shared by the pass's conversations, then per
            turn a 32-token user message and a 32-token reply; each turn resends the whole history (the
            server's own reply re-tokenized, as a chat client resends text) with the next message, so prefix
            caching decides the prefill (lorafleet's and vLLM's `--enable-prefix-caching`, llama.cpp's
            `cache_prompt` slot reuse); reported with the TTFT of later turns and each cache's hit rate
Scenarios:
  base      no adapter
  one       one adapter (the trained `french`: rank 16, all seven projections)
  trained4  the four trained adapters (ranks 8-32, different target modules), round-robin
  qv16      16 adapters of rank 8/8/8/16 on q_proj + v_proj
  mixed16   16 adapters of rank 8/16/32/64 on all seven projections
The trained adapters come from `python -m demo.train_adapters` when it has run on this machine; else
generated adapters of the same ranks and targets stand in (the JSON says which).

Precision pairs (`--pairs`): lorafleet's weights : llama.cpp's GGUF, e.g. f32:F32, bf16:BF16, int8:Q8_0
(int8 = `--quantization int8` with bfloat16 activations; w8a8 = `--quantization w8a8_int8`, 8-bit activations
in batches as Q8_0 computes them). vLLM (bench/vllm_server.py) runs the f32 and bf16 pairs only, at that
dtype, with `--enable-lora --max-loras N --max-lora-rank R --lora-modules name=path ...`; its OpenMP threads
are placed each way of `--vllm-bind` (auto, cores, reserve1, nobind: its CPU guide's ways), each a server of
its own (`vllm/<bind>`), and the summary keeps the better one per cell. Each (pair, scenario) first checks
greedy agreement with lorafleet (a few real-text prompts, base and up to four adapters; the rate of equal
texts is reported, not required), then times concurrency 1, 8 and 32 of each workload on each server in turn
(interleaved when `--rounds` > 1): output tokens per second of wall time (prefill included), TTFT and
inter-token latency p50/p99, and the server's peak RSS (the sum of its processes' peaks: vLLM's engine runs in
a child of its API server).

`--paired N` measures each concurrency differently: all servers stay up (the idle ones wait on their sockets;
each pass starts once they have stopped using CPU, and the CPU seconds they spend during it are recorded, so
"alone" is checked), and N passes of each alternate
A B B A ..., a pass on one server right after the same pass on the other. Each pair gives a ratio of ITL p50
(and of tok/s, and of later turns' TTFT in chat); the report is the median ratio with a bootstrap 95 % interval.
On a VM whose speed drifts by ±15 % over minutes, this compares the servers under the same drift, where
separate rounds compare two moments.

    python bench/bench_peers.py                      # writes bench/peers.json
    python bench/bench_peers.py --pairs f32:F32 --scenarios base one --concurrency 1
    python bench/bench_peers.py --pairs bf16:BF16 --scenarios base one --concurrency 1 --paired 24
    python bench/bench_peers.py --servers lorafleet vllm --pairs bf16:BF16 --scenarios base one --concurrency 1
    python bench/bench_peers.py --servers lorafleet vllm --pairs bf16:BF16 --workloads chat --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import llama_cpp
import vllm_server
from common import MIXED_RANKS, bench_adapter, log, machine, percentile, read_json, real_model, write_json

PROMPT_LEN = 128
OUTPUT_LEN = 64
SLOT_CTX = 256  # per llama.cpp slot / lorafleet --max-model-len: prompt + output + margin
# The chat workload: conversations of CHAT_TURNS turns, each turn resending the whole history (a system prompt
# shared by the pass's conversations, then user messages and the server's own replies) plus a new user message.
CHAT_TURNS = 4
CHAT_SYSTEM = 64  # tokens of the shared system prompt
CHAT_USER = 32  # tokens of each user message
CHAT_REPLY = 32  # output tokens of each turn; the reply goes back into the history re-tokenized, at most this long
CHAT_CTX = 384  # the last turn's prompt (64 + 4 x 32 + 3 x 32 = 288) and its reply, with a margin
WORKLOADS = ("single", "chat")
RESULT_KEYS = {"single": ("runs", "paired"), "chat": ("chat_runs", "chat_paired")}  # rounds, paired passes
QV_RANKS = (8, 8, 8, 16)
SCENARIOS = ("base", "one", "trained4", "qv16", "mixed16")
SERVERS = ("lorafleet", "llama.cpp", "vllm")
PEER_KEYS = {"llama.cpp": "llama", "vllm": "vllm"}  # a peer's prefix in the summary rows (llama_tok_s, ...)
LORAFLEET_PRECISIONS: dict[str, list[str]] = {
    "f32": ["--dtype", "float32"],
    "bf16": ["--dtype", "bfloat16"],
    "int8": ["--dtype", "bfloat16", "--quantization", "int8"],
    "int8-f32": ["--dtype", "float32", "--quantization", "int8"],
    "w8a8": ["--dtype", "bfloat16", "--quantization", "w8a8_int8"],
    "int4": ["--dtype", "bfloat16", "--quantization", "int4"],
}
CHECK_PROMPTS = (
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
)
CHECK_TOKENS = 24
# llama.cpp's weight repacking per GGUF type: off for the quantized ones (it segfaults on load here, llama_cpp.py)
REPACK = {"F32": True, "BF16": True, "Q8_0": False, "Q4_K_M": False}
CHECK_ADAPTERS = 4


# ---------------------------------------------------------------------------------------------- adapters


def trained_or_generated(model: Path) -> tuple[dict[str, Path], bool]:
    """The four answer-style adapters when `demo.train_adapters` has built them here, else generated stand-ins."""
    from demo.adapter_data import STYLES
    from demo.train_adapters import READY, RECIPES, adapters_dir

    root = adapters_dir()
    if all((root / style / READY).is_file() for style in STYLES):
        return {style: root / style for style in STYLES}, True
    return {s: bench_adapter(model, 200 + i, RECIPES[s].rank, RECIPES[s].targets) for i, s in enumerate(STYLES)}, False


def scenario_adapters(scenario: str, model: Path, trained: dict[str, Path]) -> list[tuple[str, Path]]:
    if scenario == "base":
        return []
    if scenario == "one":
        return [("french", trained["french"])]
    if scenario == "trained4":
        return list(trained.items())
    if scenario == "qv16":
        ranks = [QV_RANKS[i % len(QV_RANKS)] for i in range(16)]
        return [(f"q{i:03d}", bench_adapter(model, i, r, ("q_proj", "v_proj"))) for i, r in enumerate(ranks)]
    if scenario == "mixed16":
        return [(f"m{i:03d}", bench_adapter(model, 100 + i, MIXED_RANKS[i % 4])) for i in range(16)]
    raise ValueError(f"unknown scenario {scenario!r}")


# ---------------------------------------------------------------------------------------------- servers


@dataclass
class Server:
    """One running server: how to name the base model or an adapter in a request, and its process."""

    system: str  # "lorafleet", "llama.cpp" or "vllm/<bind>"
    url: str
    proc: subprocess.Popen[bytes]
    adapter_ids: dict[str, int] = field(default_factory=dict)  # llama.cpp: adapter name -> --lora index

    def body(
        self, prompt: list[int], adapter: str | None, max_tokens: int, stream: bool, prompt_cache: bool = False
    ) -> dict[str, Any]:
        """A greedy /v1/completions body; streamed (timed) requests ignore EOS so every one is `max_tokens` long.
        `prompt_cache` asks llama.cpp to reuse its slot's KV (`cache_prompt`); lorafleet and vLLM cache prefixes
        on their own (`--enable-prefix-caching`), and the single-prompt workload's prompts share none."""
        body: dict[str, Any] = {"model": "base", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                                "stream": stream, "ignore_eos": stream}  # fmt: skip
        if self.system != "llama.cpp":  # lorafleet and vLLM name the adapter (or the base model) as the model
            body["model"] = adapter or "base"
        else:  # llama.cpp picks adapters per request by --lora index; unlisted ones get scale 0. An empty list
            # means "the server's defaults" (every --lora at scale 1), so the base model lists each at scale 0.
            scales = {i: 0.0 for i in self.adapter_ids.values()}
            if adapter is not None:
                scales[self.adapter_ids[adapter]] = 1.0
            body["lora"] = [{"id": i, "scale": s} for i, s in scales.items()]
            body["cache_prompt"] = prompt_cache
        return body

    def peak_rss_mib(self) -> float | None:
        """The sum of VmHWM (peak resident memory) over the server's process and its live descendants (vLLM's
        engine runs in a child of its API server); shared pages count once per process."""
        total = 0
        for pid in self.pids(_proc_stats()[0]):
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1])
            except OSError:
                pass
        return round(total / 1024, 1) if total else None

    def cpu_s(self) -> float:
        """CPU seconds (user + system) that the server's process and its live descendants have used."""
        children, used = _proc_stats()
        return sum(used.get(pid, 0) for pid in self.pids(children)) / os.sysconf("SC_CLK_TCK")

    def pids(self, children: dict[int, list[int]]) -> list[int]:
        """The server's process and its live descendants, from every process's children."""
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo.extend(children.get(pid, []))
        return out


def _proc_stats() -> tuple[dict[int, list[int]], dict[int, int]]:
    """Every live process's children, and its CPU clock ticks (user + system)."""
    children: dict[int, list[int]] = {}
    used: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        pid = int(stat.parent.name)
        children.setdefault(int(fields[1]), []).append(pid)  # fields[1] is the ppid
        used[pid] = int(fields[11]) + int(fields[12])  # utime + stime
    return children, used


def start_lorafleet(
    model: Path, adapters: list[tuple[str, Path]], precision: str, workdir: Path, threads: int, ctx: int = SLOT_CTX
) -> Server:
    from lorafleet_worker_dev.launch import free_port, launch_worker, wait_ready

    host = "127.0.0.1"
    port, system_port = free_port(host), free_port(host)
    args = [*LORAFLEET_PRECISIONS[precision], "--max-loras", str(max(1, len(adapters))), "--max-num-seqs", "32"]
    args += ["--max-model-len", str(ctx), "--enable-prefix-caching"]
    roots = os.pathsep.join(sorted({str(p.parent) for _, p in adapters})) or str(workdir)
    env = {"LORAFLEET_FILE_ROOTS": roots, "DYN_LORA_PATH": str(workdir / "cache"), "LORAFLEET_ADMIN_TOKEN": "",
           "OMP_NUM_THREADS": str(threads)}  # fmt: skip
    log_file = (workdir / f"lorafleet-{precision}.log").open("ab")
    proc = launch_worker(
        model, name="base", host=host, port=port, system_port=system_port, args=args, env=env, log=log_file
    )
    wait_ready(proc, f"http://{host}:{system_port}")
    for name, path in adapters:
        body = {"lora_name": name, "source": {"uri": f"file://{path}"}}
        req = urllib.request.Request(
            f"http://{host}:{system_port}/v1/loras", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            if r.status != 200:
                raise RuntimeError(f"loading {name} into lorafleet: HTTP {r.status}")
    return Server("lorafleet", f"http://{host}:{port}", proc)


def start_llama(
    model: Path, adapters: list[tuple[str, Path]], ggufs: list[Path], workdir: Path, tag: str, threads: int,
    ctx: int = SLOT_CTX,
) -> Server:  # fmt: skip
    from lorafleet_worker_dev.launch import free_port

    port = free_port("127.0.0.1")
    cmd = llama_cpp.server_command(
        model, ggufs, port=port, parallel=32, ctx_per_slot=ctx, threads=threads, repack=REPACK[tag.split("-")[0]]
    )
    log_file = (workdir / f"llama-{tag}.log").open("ab")
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}; log: {workdir}/llama-{tag}.log")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("llama-server was not healthy after 300 s")
        time.sleep(0.2)
    return Server("llama.cpp", url, proc, {name: i for i, (name, _) in enumerate(adapters)})


def start_vllm(
    model: Path, adapters: list[tuple[str, Path]], dtype: str, workdir: Path, tag: str, bind: str, threads: int,
    kv_cache_gib: int, ctx: int = SLOT_CTX, block_size: int | None = None,
) -> Server:  # fmt: skip
    """vLLM's OpenAI server on the first `threads` CPUs this process may use (its CPU affinity: what vLLM's `auto`
    binding chooses from), its threads placed as `bind` says."""
    from lorafleet_worker_dev.launch import free_port

    port = free_port("127.0.0.1")
    cmd = vllm_server.server_command(
        model, adapters, port=port, dtype=dtype, max_num_seqs=32, max_model_len=ctx, block_size=block_size
    )
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    env = {**os.environ, **vllm_server.server_env(bind, cpus, kv_cache_gib)}
    log_path = workdir / f"vllm-{tag}-{bind}.log"
    proc = subprocess.Popen(
        cmd, stdout=log_path.open("ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
        preexec_fn=functools.partial(os.sched_setaffinity, 0, cpus),
    )  # fmt: skip
    server = Server(f"vllm/{bind}", f"http://127.0.0.1:{port}", proc)
    deadline = time.monotonic() + vllm_server.START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            stop(server)
            raise RuntimeError(f"vLLM exited with {proc.returncode}; log: {log_path}")
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=5) as r:
                if r.status == 200:
                    return server
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop(server)
            raise RuntimeError(f"vLLM was not healthy after {vllm_server.START_TIMEOUT_S} s; log: {log_path}")
        time.sleep(0.5)


def stop(server: Server) -> None:
    """SIGTERM and wait (SIGKILL if it hangs); then end what is left of its session (vLLM's engine process)."""
    from lorafleet_worker_dev.launch import stop_worker

    stop_worker(server.proc)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(server.proc.pid, signal.SIGKILL)  # every server starts its own session, whose id is its pid


# ---------------------------------------------------------------------------------------------- client


async def complete(client: httpx.AsyncClient, server: Server, prompt: list[int], adapter: str | None) -> str:
    """Greedy text of a short non-streamed completion."""
    r = await client.post(f"{server.url}/v1/completions", json=server.body(prompt, adapter, CHECK_TOKENS, False))
    r.raise_for_status()
    return str(r.json()["choices"][0]["text"])


@dataclass
class Streamed:
    """One streamed request as the client saw it."""

    ttft_s: float
    gaps_s: list[float]  # between consecutive tokens
    tokens: int
    text: str
    cached: int | None = None  # llama.cpp: prompt tokens its slot reused (`timings.cache_n`), when it says
    computed: int | None = None  # llama.cpp: prompt tokens it computed (`timings.prompt_n`)


async def stream_one(
    client: httpx.AsyncClient, server: Server, prompt: list[int], adapter: str | None, max_tokens: int = OUTPUT_LEN,
    prompt_cache: bool = False,
) -> Streamed:  # fmt: skip
    """One streamed greedy request of `max_tokens` tokens."""
    t0 = time.perf_counter()
    stamps: list[float] = []
    text: list[str] = []
    timings: dict[str, Any] = {}
    body = server.body(prompt, adapter, max_tokens, True, prompt_cache)
    async with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            timings = chunk.get("timings") or timings
            choice = (chunk.get("choices") or [{}])[0]
            if choice.get("text") or (choice.get("text") is not None and choice.get("finish_reason") is None):
                stamps.append(time.perf_counter())  # one token a chunk (an empty final chunk carries no token)
                text.append(choice["text"])
    if not stamps:
        raise RuntimeError(f"{server.system}: a streamed request returned no tokens")
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return Streamed(stamps[0] - t0, gaps, len(stamps), "".join(text), timings.get("cache_n"), timings.get("prompt_n"))


def _client(c: int) -> httpx.AsyncClient:
    # a new connection per request: llama-server (cpp-httplib) closes a kept-alive one after 5 requests, and a
    # pooled connection closed under the client reads as "Server disconnected"; every server gets the same
    return httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=c + 4, max_keepalive_connections=0))


async def timed_pass(server: Server, prompts: list[list[int]], adapters: list[str | None], c: int) -> dict[str, Any]:
    """`len(prompts)` requests through `c` closed-loop clients; throughput and latency percentiles."""
    queue = list(zip(prompts, adapters, strict=True))
    ttfts: list[float] = []
    gaps: list[float] = []
    tokens = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        while queue:
            prompt, adapter = queue.pop()
            got = await stream_one(client, server, prompt, adapter)
            ttfts.append(got.ttft_s)
            gaps.extend(got.gaps_s)
            tokens += got.tokens

    async with _client(c) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(c)))
        wall = time.perf_counter() - t0
    return {
        "requests": len(prompts),
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tok_s": round(tokens / wall, 2),
        "ttft_p50_ms": _ms(percentile(ttfts, 50)),
        "itl_p50_ms": _ms(percentile(gaps, 50)),
        "itl_p99_ms": _ms(percentile(gaps, 99)),
        "loadavg_1": round(os.getloadavg()[0], 2),
    }


@dataclass
class Conversation:
    """A scripted chat: the pass's shared system prompt, then one user message per turn, and the adapter."""

    system: list[int]
    users: list[list[int]]
    adapter: str | None


def chat_script(n: int, seed: int, vocab: int, adapters: list[str]) -> list[Conversation]:
    """`n` conversations of CHAT_TURNS user messages (random token ids), all opening with one system prompt;
    adapters round-robin. A seed is one pass: another seed shares nothing with it, so every pass starts cold."""
    rng = random.Random(seed)
    system = [rng.randrange(200, vocab) for _ in range(CHAT_SYSTEM)]
    return [
        Conversation(system, [[rng.randrange(200, vocab) for _ in range(CHAT_USER)] for _ in range(CHAT_TURNS)], a)
        for a in adapter_picks(adapters, n)
    ]


def next_prompt(prompt: list[int], reply: list[int], user: list[int]) -> list[int]:
    """The next turn's prompt: the whole history resent (this turn's prompt and the server's reply, at most
    CHAT_REPLY tokens of it) and the new user message."""
    return [*prompt, *reply[:CHAT_REPLY], *user]


async def prefix_counters(client: httpx.AsyncClient, server: Server) -> tuple[float, float] | None:
    """(hit tokens, queried tokens) of the server's prefix cache: vLLM's `vllm:prefix_cache_hits` and
    `vllm:prefix_cache_queries` counters (lorafleet exports the same names); None where /metrics has neither."""
    try:
        r = await client.get(f"{server.url}/metrics")
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    sums = {"vllm:prefix_cache_hits": 0.0, "vllm:prefix_cache_queries": 0.0}
    seen = False
    for line in r.text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0].removesuffix("_total")
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
            seen = True
    return (sums["vllm:prefix_cache_hits"], sums["vllm:prefix_cache_queries"]) if seen else None


async def chat_pass(
    server: Server, conversations: list[Conversation], c: int, encode: Callable[[str], list[int]]
) -> dict[str, Any]:
    """The conversations through `c` closed-loop clients, each one's turns in order; every turn resends the
    history with prefix caching asked for. Throughput, TTFT of first and of later turns, ITL, the prompt tokens
    sent and the share of them the server's prefix cache served."""
    queue = list(conversations)
    first: list[float] = []
    later: list[float] = []
    gaps: list[float] = []
    tokens = prompt_tokens = 0
    slot_cached: list[tuple[int, int]] = []  # llama.cpp's per-request (reused, computed) prompt tokens

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens, prompt_tokens
        while queue:
            conv = queue.pop()
            prompt, reply = [*conv.system, *conv.users[0]], list[int]()
            for turn in range(CHAT_TURNS):
                if turn:
                    prompt = next_prompt(prompt, reply, conv.users[turn])
                got = await stream_one(client, server, prompt, conv.adapter, CHAT_REPLY, prompt_cache=True)
                (later if turn else first).append(got.ttft_s)
                gaps.extend(got.gaps_s)
                tokens += got.tokens
                prompt_tokens += len(prompt)
                if got.cached is not None and got.computed is not None:
                    slot_cached.append((got.cached, got.computed))
                reply = encode(got.text)

    async with _client(c) as client:
        before = await prefix_counters(client, server)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(c)))
        wall = time.perf_counter() - t0
        after = await prefix_counters(client, server) if before is not None else None
    hit_rate = None
    if before is not None and after is not None and after[1] > before[1]:
        hit_rate = round((after[0] - before[0]) / (after[1] - before[1]), 3)
    elif slot_cached:
        reused = sum(a for a, _ in slot_cached)
        hit_rate = round(reused / max(1, reused + sum(b for _, b in slot_cached)), 3)
    return {
        "conversations": len(conversations),
        "requests": len(conversations) * CHAT_TURNS,
        "tokens": tokens,
        "prompt_tokens": prompt_tokens,
        "wall_s": round(wall, 3),
        "tok_s": round(tokens / wall, 2),
        "ttft_p50_ms": _ms(percentile(first + later, 50)),
        "ttft_first_p50_ms": _ms(percentile(first, 50)),
        "ttft_later_p50_ms": _ms(percentile(later, 50)),
        "itl_p50_ms": _ms(percentile(gaps, 50)),
        "itl_p99_ms": _ms(percentile(gaps, 99)),
        "prefix_hit_rate": hit_rate,
        "loadavg_1": round(os.getloadavg()[0], 2),
    }


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 2)


def random_prompts(n: int, seed: int, vocab: int) -> list[list[int]]:
    """`n` distinct prompts of PROMPT_LEN token ids (no prefix shared, so no prompt cache helps)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(200, vocab) for _ in range(PROMPT_LEN)] for _ in range(n)]


# ---------------------------------------------------------------------------------------------- the run


def run_pair(
    pair: str, scenario: str, model: Path, trained: dict[str, Path], args: argparse.Namespace, workdir: Path
) -> dict[str, Any]:
    """Greedy check, then the timed passes of each workload, for one precision pair and scenario."""
    precision, ftype = pair.split(":")
    adapters = scenario_adapters(scenario, model, trained)
    adapter_names = [name for name, _ in adapters]
    names: list[str | None] = [None, *(n for n, _ in adapters[:CHECK_ADAPTERS])] if scenario != "base" else [None]
    from lorafleet_worker.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model)
    check_prompts = [tok.encode(p) for p in CHECK_PROMPTS]
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    runners = {w: pass_runner(w, vocab, adapter_names, tok) for w in args.workloads}
    result: dict[str, Any] = {"pair": pair, "scenario": scenario, "adapters": len(adapters), "runs": {}}
    starts = server_starts(args.servers, precision, ftype, scenario, model, adapters, workdir, args)
    if "vllm" in args.servers and precision not in vllm_server.DTYPES:
        result["vllm_skipped"] = f"vLLM has no peer of {precision} here (it runs {', '.join(vllm_server.DTYPES)})"
    if args.paired:
        servers: dict[str, Server] = {}
        try:
            for system, start in starts.items():
                log(f"{pair} {scenario}: starting {system}")
                servers[system] = start()
            if args.check:
                checked = {system: asyncio.run(_texts(sv, names, check_prompts)) for system, sv in servers.items()}
                result.update(_agreements(checked, names))
            for workload, run in runners.items():
                for c in args.concurrency:
                    for sv in servers.values():
                        warm_up(sv, vocab, adapter_names)
                    log(f"{pair} {scenario}: {workload} c={c}")
                    paired = paired_passes(servers, c, args.paired, run, PASS_SEEDS[workload])
                    result.setdefault(RESULT_KEYS[workload][1], {})[str(c)] = paired
            result["peak_rss_mib"] = {system: sv.peak_rss_mib() for system, sv in servers.items()}
        finally:
            for sv in servers.values():
                stop(sv)
        return result
    texts: dict[str, list[str]] = {}
    for rnd in range(args.rounds):
        order = list(starts) if rnd % 2 == 0 else list(reversed(starts))
        for system in order:
            log(f"{pair} {scenario}: {system} round {rnd + 1}")
            server = starts[system]()
            try:
                if rnd == 0 and args.check:
                    texts[system] = asyncio.run(_texts(server, names, check_prompts))
                for workload, run in runners.items():
                    runs = result.setdefault(RESULT_KEYS[workload][0], {}).setdefault(system, {})
                    for c in args.concurrency:
                        warm_up(server, vocab, adapter_names)
                        got = run(server, c, max(4, c), PASS_SEEDS[workload] + 1000 * rnd + c)
                        runs.setdefault(str(c), []).append(got)
                        log(f"  {workload} c={c}: {got['tok_s']} tok/s, TTFT p50 {got['ttft_p50_ms']} ms, ITL p50 "
                            f"{got['itl_p50_ms']} ms (load {got['loadavg_1']})")  # fmt: skip
                result.setdefault("peak_rss_mib", {})[system] = server.peak_rss_mib()
            finally:
                stop(server)
    result.update(_agreements(texts, names))
    return result


PassRunner = Callable[[Server, int, int, int], dict[str, Any]]  # (server, c, n, seed) -> one timed pass
PASS_SEEDS = {"single": 10_000, "chat": 20_000}  # each workload's prompts differ from the other's


def pass_runner(workload: str, vocab: int, adapters: list[str], tok: Any) -> PassRunner:
    """One timed pass of `workload` on a server: `n` single prompts (`timed_pass`) or `n` conversations
    (`chat_pass`, replies re-tokenized with the model's tokenizer `tok`), the same for every server at one seed."""
    if workload == "single":
        return lambda server, c, n, seed: asyncio.run(
            timed_pass(server, random_prompts(n, seed, vocab), adapter_picks(adapters, n), c)
        )
    if workload == "chat":

        def encode(text: str) -> list[int]:
            return list(tok.encode(text, add_special_tokens=False))

        return lambda server, c, n, seed: asyncio.run(
            chat_pass(server, chat_script(n, seed, vocab, adapters), c, encode)
        )
    raise ValueError(f"unknown workload {workload!r}")


def warm_up(server: Server, vocab: int, adapters: list[str]) -> None:
    """One short request (an adapter into a slot, the first-request costs) on a prompt no pass sends."""
    asyncio.run(timed_pass(server, random_prompts(1, seed=7, vocab=vocab), adapter_picks(adapters, 1), 1))


def server_ctx(workloads: list[str]) -> int:
    """The context every server of a run gets (`--max-model-len`, llama.cpp's per-slot context)."""
    return CHAT_CTX if "chat" in workloads else SLOT_CTX


def server_starts(
    servers: list[str], precision: str, ftype: str, scenario: str, model: Path, adapters: list[tuple[str, Path]],
    workdir: Path, args: argparse.Namespace,
) -> dict[str, Callable[[], Server]]:  # fmt: skip
    """How to start each server of this (pair, scenario), by name: lorafleet first, then llama.cpp, then vLLM in
    each `--vllm-bind` placement (`vllm/<bind>`); vLLM only at the precisions it has (f32, bf16)."""
    starts: dict[str, Callable[[], Server]] = {}
    ctx = server_ctx(args.workloads)
    if "lorafleet" in servers:
        starts["lorafleet"] = lambda: start_lorafleet(model, adapters, precision, workdir, args.threads, ctx)
    if "llama.cpp" in servers:
        ggufs = [llama_cpp.adapter_gguf(path, model) for _, path in adapters]
        base = llama_cpp.base_gguf(ftype)
        tag = f"{ftype}-{scenario}"
        starts["llama.cpp"] = lambda: start_llama(base, adapters, ggufs, workdir, tag, args.threads, ctx)
    if "vllm" in servers and precision in vllm_server.DTYPES:
        dtype = vllm_server.DTYPES[precision]
        for bind in args.vllm_bind:
            starts[f"vllm/{bind}"] = functools.partial(
                start_vllm, model, adapters, dtype, workdir, f"{precision}-{scenario}", bind, args.threads,
                args.vllm_kv_cache_gib, ctx, args.vllm_block_size,
            )  # fmt: skip
    return starts


def adapter_picks(names: list[str], n: int) -> list[str | None]:
    """The adapter of each of `n` requests: `names` round-robin, or the base model when there are none."""
    return [names[i % len(names)] if names else None for i in range(n)]


SETTLE_WINDOW_S = 0.25  # a peer is idle once it used under SETTLE_CPU_S of CPU in one window
SETTLE_CPU_S = 0.02
SETTLE_MAX_S = 20.0


def settle(idle: list[Server]) -> float:
    """Wait until the idle servers stop using CPU, and return how long that took. A server that just finished
    a pass can keep its cores busy for a while (vLLM's engine polls for about a second after its last request),
    which the next pass on the other server would pay for. Gives up after SETTLE_MAX_S (the pass then records
    the idle peers' CPU seconds as always)."""
    t0 = time.perf_counter()
    used = sum(sv.cpu_s() for sv in idle)
    while time.perf_counter() - t0 < SETTLE_MAX_S:
        time.sleep(SETTLE_WINDOW_S)
        now = sum(sv.cpu_s() for sv in idle)
        if now - used < SETTLE_CPU_S:
            break
        used = now
    return round(time.perf_counter() - t0, 2)


def paired_passes(servers: dict[str, Server], c: int, n: int, run: PassRunner, seed: int) -> dict[str, Any]:
    """`n` passes of `max(4, c)` requests or conversations (one for c = 1) on each server, alternating A B B A ...
    (A B C C B A with three); each pass's prompts are the same for all. Ratios are lorafleet ÷ each peer per pass:
    median and bootstrap 95 % interval (`by_peer`; llama.cpp's also at the top level, as the report reads them)."""
    size = 1 if c == 1 else max(4, c)
    passes: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
    for i in range(n):
        order = list(servers) if i % 4 in (0, 3) else list(reversed(servers))
        for system in order:
            idle = [sv for name, sv in servers.items() if name != system]
            settled_s = settle(idle)
            idle_before = sum(sv.cpu_s() for sv in idle)
            busy_before, client_before = servers[system].cpu_s(), time.process_time()
            got = run(servers[system], c, size, seed + 100 * c + i)
            got["idle_peer_cpu_s"] = round(sum(sv.cpu_s() for sv in idle) - idle_before, 3)  # the others, together
            got["settle_s"] = settled_s
            # the server's CPU seconds in the pass, and the harness's own (it shares the cores with the server)
            got["server_cpu_s"] = round(servers[system].cpu_s() - busy_before, 3)
            got["client_cpu_s"] = round(time.process_time() - client_before, 3)
            passes[system].append(got)
        itl = ", ".join(f"{name} {ps[-1]['itl_p50_ms']}" for name, ps in passes.items())
        log(f"  c={c} pass {i + 1}/{n}: ITL p50 ms {itl} (load {os.getloadavg()[0]:.2f})")
    return paired_summary(passes, n, size)


def paired_summary(passes: dict[str, list[dict[str, Any]]], n: int, size: int) -> dict[str, Any]:
    """Per peer, the paired ratios lorafleet ÷ peer of ITL p50 and tok/s (and of later turns' TTFT p50 where the
    passes are conversations); each server's median ITL p50 (and later-turn TTFT)."""
    result: dict[str, Any] = {"passes": passes, "pairs": n, "requests_per_pass": size, "by_peer": {}}
    ours = passes.get("lorafleet")
    for peer, theirs in passes.items():
        if ours is None or peer == "lorafleet":
            continue
        pairs = list(zip(ours, theirs, strict=True))
        result["by_peer"][peer] = {
            "itl_ratio": ratio_summary([a["itl_p50_ms"] / b["itl_p50_ms"] for a, b in pairs]),
            "tok_s_ratio": ratio_summary([a["tok_s"] / b["tok_s"] for a, b in pairs]),
        }
        if all(a.get("ttft_later_p50_ms") and b.get("ttft_later_p50_ms") for a, b in pairs):
            later = [a["ttft_later_p50_ms"] / b["ttft_later_p50_ms"] for a, b in pairs]
            result["by_peer"][peer]["ttft_later_ratio"] = ratio_summary(later)
    if "llama.cpp" in result["by_peer"]:
        result.update(result["by_peer"]["llama.cpp"])
    result["itl_p50_ms"] = {name: round(statistics.median(p["itl_p50_ms"] for p in ps), 2)
                            for name, ps in passes.items()}  # fmt: skip
    if all(p.get("ttft_later_p50_ms") is not None for ps in passes.values() for p in ps):
        result["ttft_later_p50_ms"] = {name: round(statistics.median(p["ttft_later_p50_ms"] for p in ps), 2)
                                       for name, ps in passes.items()}  # fmt: skip
    result["idle_peer_cpu_s_max"] = max((p.get("idle_peer_cpu_s", 0.0) for ps in passes.values() for p in ps),
                                        default=0.0)  # fmt: skip
    return result


def ratio_summary(ratios: list[float], resamples: int = 2000) -> dict[str, Any]:
    """Median of paired ratios, with a percentile-bootstrap 95 % interval of the median (seeded)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return {
        "median": round(statistics.median(ratios), 3),
        "ci95": [round(medians[int(0.025 * resamples)], 3), round(medians[int(0.975 * resamples) - 1], 3)],
        "below_1": sum(r < 1 for r in ratios),
        "of": len(ratios),
    }


async def _texts(server: Server, names: list[str | None], prompts: list[list[int]]) -> list[str]:
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        return [await complete(client, server, p, n) for n in names for p in prompts]


def _agreements(texts: dict[str, list[str]], names: list[str | None]) -> dict[str, Any]:
    """Each peer's greedy texts against lorafleet's: `greedy_by_server` (and llama.cpp's as `greedy`)."""
    if "lorafleet" not in texts:
        return {}
    by_server = {system: _agreement(texts["lorafleet"], theirs, names)
                 for system, theirs in texts.items() if system != "lorafleet"}  # fmt: skip
    out: dict[str, Any] = {"greedy_by_server": by_server} if by_server else {}
    if "llama.cpp" in by_server:
        out["greedy"] = by_server["llama.cpp"]
    return out


def _agreement(ours: list[str], theirs: list[str], names: list[str | None]) -> list[dict[str, Any]]:
    per = len(CHECK_PROMPTS)
    rows = []
    for i, name in enumerate(names):
        pairs = list(zip(ours[i * per : (i + 1) * per], theirs[i * per : (i + 1) * per], strict=True))
        rows.append({"adapter": name or "base", "agree": sum(a == b for a, b in pairs), "of": per,
                     "first_diff": [_common_prefix(a, b) if a != b else None for a, b in pairs],
                     "texts": pairs})  # fmt: skip
    return rows


def _common_prefix(a: str, b: str) -> int:
    """How many leading characters `a` and `b` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def peer_systems(peer: str, systems: Any) -> list[str]:
    """The servers of `peer` among `systems`: llama.cpp is one; vLLM is one per placement (`vllm/<bind>`)."""
    return [s for s in systems if s == peer or s.startswith(f"{peer}/")]


def summarize(results: list[dict[str, Any]], peer: str = "llama.cpp", workload: str = "single") -> list[dict[str, Any]]:
    """lorafleet / `peer` per (pair, scenario, concurrency) of `workload`: tok/s and ITL p50 ratios (paired passes:
    the median of the per-pair ratios with its 95 % interval, tok/s the median pass of each; rounds: best round).
    Where the peer ran in several placements (vLLM's binds), the row is the placement with the higher tok/s, named
    in `bind`. Chat rows also hold each side's TTFT p50 of later turns (their ratio) and prefix-cache hit rate."""
    key = PEER_KEYS[peer]
    runs_key, paired_key = RESULT_KEYS[workload]
    rows = []
    for r in results:
        for c, p in r.get(paired_key, {}).items():
            tok_s = {name: round(statistics.median(x["tok_s"] for x in xs), 2) for name, xs in p["passes"].items()}
            systems = peer_systems(peer, p["passes"])
            if "lorafleet" not in tok_s or not systems:
                continue
            best = max(systems, key=lambda s: tok_s[s])
            ratios = p.get("by_peer", {}).get(best) or {"itl_ratio": p["itl_ratio"], "tok_s_ratio": p["tok_s_ratio"]}
            row = {
                "pair": r["pair"], "scenario": r["scenario"], "concurrency": int(c), "paired": p["pairs"],
                "lorafleet_tok_s": tok_s["lorafleet"], f"{key}_tok_s": tok_s[best],
                "lorafleet_itl_p50_ms": p["itl_p50_ms"]["lorafleet"], f"{key}_itl_p50_ms": p["itl_p50_ms"][best],
                "itl_ratio": ratios["itl_ratio"]["median"], "itl_ratio_ci95": ratios["itl_ratio"]["ci95"],
                "tok_s_ratio": ratios["tok_s_ratio"]["median"], "tok_s_ratio_ci95": ratios["tok_s_ratio"]["ci95"],
            }  # fmt: skip
            if workload == "chat":
                median = {s: _median_of(p["passes"][s], ("ttft_later_p50_ms", "prefix_hit_rate")) for s in tok_s}
                row |= _chat_fields(key, median["lorafleet"], median[best], ratios.get("ttft_later_ratio"))
            rows.append(row | ({"bind": best.partition("/")[2]} if best != peer else {}))
        runs = r.get(runs_key, {})
        for c, ours in runs.get("lorafleet", {}).items():
            theirs = {s: runs[s][c] for s in peer_systems(peer, runs) if runs[s].get(c)}
            if not theirs:
                continue
            best = max(theirs, key=lambda s: max(x["tok_s"] for x in theirs[s]))
            a, b = max(ours, key=lambda x: x["tok_s"]), max(theirs[best], key=lambda x: x["tok_s"])
            itl = a["itl_p50_ms"] / b["itl_p50_ms"] if a["itl_p50_ms"] and b["itl_p50_ms"] else None
            row = {
                "pair": r["pair"], "scenario": r["scenario"], "concurrency": int(c),
                "lorafleet_tok_s": a["tok_s"], f"{key}_tok_s": b["tok_s"],
                "tok_s_ratio": round(a["tok_s"] / b["tok_s"], 2),
                "lorafleet_itl_p50_ms": a["itl_p50_ms"], f"{key}_itl_p50_ms": b["itl_p50_ms"],
                "itl_ratio": None if itl is None else round(itl, 2),
            }  # fmt: skip
            if workload == "chat":
                later = a["ttft_later_p50_ms"] / b["ttft_later_p50_ms"] if b.get("ttft_later_p50_ms") else None
                ratio = None if later is None else {"median": round(later, 2), "ci95": None}
                row |= _chat_fields(key, a, b, ratio)
            rows.append(row | ({"bind": best.partition("/")[2]} if best != peer else {}))
    return rows


def _median_of(passes: list[dict[str, Any]], fields: tuple[str, ...]) -> dict[str, Any]:
    """Each of `fields` as the median over the passes that have it (None where none has)."""
    out: dict[str, Any] = {}
    for f in fields:
        values = [p[f] for p in passes if p.get(f) is not None]
        out[f] = round(statistics.median(values), 3) if values else None
    return out


def _chat_fields(
    key: str, ours: dict[str, Any], theirs: dict[str, Any], ratio: dict[str, Any] | None
) -> dict[str, Any]:
    """A chat row's later-turn TTFT of each side, their ratio (with its interval when paired), and hit rates."""
    return {
        "workload": "chat",
        "lorafleet_ttft_later_p50_ms": ours.get("ttft_later_p50_ms"),
        f"{key}_ttft_later_p50_ms": theirs.get("ttft_later_p50_ms"),
        "ttft_later_ratio": None if ratio is None else ratio["median"],
        "ttft_later_ratio_ci95": None if ratio is None else ratio["ci95"],
        "lorafleet_prefix_hit_rate": ours.get("prefix_hit_rate"),
        f"{key}_prefix_hit_rate": theirs.get("prefix_hit_rate"),
    }


def greedy_rates(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per peer server, over every (pair, scenario) checked: how many greedy texts equal lorafleet's, of how many,
    and the rate; by pair too, since rounding differs by precision."""
    rates: dict[str, dict[str, Any]] = {}
    for r in results:
        by_server = r.get("greedy_by_server") or ({"llama.cpp": r["greedy"]} if r.get("greedy") else {})
        for system, rows in by_server.items():  # (runs before vLLM joined kept llama.cpp's alone, as `greedy`)
            same, of = sum(g["agree"] for g in rows), sum(g["of"] for g in rows)
            for entry in (rates.setdefault(system, {"same": 0, "of": 0, "by_pair": {}}),
                          rates[system]["by_pair"].setdefault(r["pair"], {"same": 0, "of": 0})):  # fmt: skip
                entry["same"] += same
                entry["of"] += of
    for entry in rates.values():
        for e in (entry, *entry["by_pair"].values()):
            e["rate"] = round(e["same"] / e["of"], 3) if e["of"] else None
    return rates


def default_pairs() -> list[str]:
    """The precision pairs of a default run: w8a8:Q8_0 only where `--quantization w8a8_int8` runs (AVX512-VNNI;
    elsewhere the worker refuses it at startup)."""
    from lorafleet_worker.ops.loader import cpu_flags

    return ["f32:F32", "bf16:BF16", "int8:Q8_0"] + (["w8a8:Q8_0"] if "avx512_vnni" in cpu_flags() else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pairs_help = "LORAFLEET:GGUF (default: %(default)s; w8a8:Q8_0 where the CPU has AVX512-VNNI)"
    parser.add_argument("--pairs", nargs="+", default=default_pairs(), help=pairs_help)
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--servers", nargs="+", default=list(SERVERS), choices=SERVERS,
                        help="lorafleet and its peers (default: all); vLLM runs the f32 and bf16 pairs")  # fmt: skip
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS,
                        help="single: distinct one-turn prompts; chat: multi-turn conversations resending their "
                             "history, prefix caching on every server (default: %(default)s)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="per server (default: all CPUs)")
    parser.add_argument("--vllm-bind", nargs="+", default=list(vllm_server.DEFAULT_BINDS), choices=vllm_server.BINDS,
                        help="vLLM's OpenMP placements, each a server (default: %(default)s)")  # fmt: skip
    parser.add_argument("--vllm-kv-cache-gib", type=int, default=vllm_server.KV_CACHE_GIB,
                        help="VLLM_CPU_KVCACHE_SPACE (default %(default)s GiB; 32 x 384 tokens need 0.3)")  # fmt: skip
    parser.add_argument("--vllm-block-size", type=int, default=None, metavar="N",
                        help="vLLM's --block-size: its KV blocks and prefix-cache granularity (default: vLLM's "
                             "CPU default, 128 tokens; its CPU attention takes multiples of 32)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1, help="rounds per server, interleaved (default 1)")
    parser.add_argument("--paired", type=int, default=0, metavar="N",
                        help="all servers up, N alternating passes each, ratios per pair (default: off)")  # fmt: skip
    parser.add_argument("--no-check", dest="check", action="store_false", help="skip the greedy agreement check")
    parser.add_argument("--out", default="peers", help="bench/<out>.json (default peers)")
    parser.add_argument("--merge", action="store_true", help="keep the other (pair, scenario) results of --out")
    args = parser.parse_args()
    if "lorafleet" not in args.servers:
        parser.error("--servers: lorafleet is what the peers are compared with; name it too")
    for pair in args.pairs:
        precision, ftype = pair.partition(":")[::2]
        if precision not in LORAFLEET_PRECISIONS or ftype not in llama_cpp.FTYPES:
            parser.error(
                f"--pairs {pair}: want LORAFLEET:GGUF with {sorted(LORAFLEET_PRECISIONS)} and {llama_cpp.FTYPES}"
            )
    payload: dict[str, Any] = {"machine": machine(), "llama_cpp": llama_cpp.VERSION, "threads": args.threads,
                               "prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN, "servers": args.servers,
                               "workloads": args.workloads, "max_model_len": server_ctx(args.workloads)}  # fmt: skip
    if "chat" in args.workloads:
        payload["chat"] = {"turns": CHAT_TURNS, "system_tokens": CHAT_SYSTEM, "user_tokens": CHAT_USER,
                           "reply_tokens": CHAT_REPLY}  # fmt: skip
    if "llama.cpp" in args.servers:
        try:
            llama_cpp.build()
        except llama_cpp.Unavailable as e:
            payload["skipped"] = str(e)
            args.servers.remove("llama.cpp")
    if "vllm" in args.servers:
        try:
            vllm_server.install()
            payload["vllm"] = {"version": vllm_server.VERSION, "binds": args.vllm_bind,
                               "kv_cache_gib": args.vllm_kv_cache_gib, "block_size": args.vllm_block_size,
                               "ld_preload": vllm_server.preloads()}  # fmt: skip
        except vllm_server.Unavailable as e:
            payload["vllm_skipped"] = str(e)
            args.servers.remove("vllm")
    if args.servers == ["lorafleet"]:
        write_json(args.out, payload)  # no peer could be built here: the skips say why
        return
    model = real_model()
    trained, is_trained = trained_or_generated(model)
    payload["adapters"] = "trained (demo.train_adapters)" if is_trained else "generated stand-ins (same ranks/targets)"
    previous = (read_json(args.out) or {}).get("results", []) if args.merge else []
    redo = {(p, sc) for p in args.pairs for sc in args.scenarios}
    results = [r for r in previous if (r["pair"], r["scenario"]) not in redo]
    workdir = Path(tempfile.mkdtemp(prefix="lorafleet-peers-"))
    log(f"server logs in {workdir}")
    for pair in args.pairs:
        for scenario in args.scenarios:
            results.append(run_pair(pair, scenario, model, trained, args, workdir))
            payload["results"] = results
            payload["ratios"] = summarize(results, "llama.cpp")
            payload["vllm_ratios"] = summarize(results, "vllm")
            payload["chat_ratios"] = summarize(results, "llama.cpp", "chat")
            payload["vllm_chat_ratios"] = summarize(results, "vllm", "chat")
            payload["greedy_rates"] = greedy_rates(results)
            write_json(args.out, payload)  # after each scenario: a long run keeps what it measured
    payload["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    write_json(args.out, payload)


if __name__ == "__main__":
    main()
