"""Prefix caching and cache-aware routing (issue 25), each against the same run without it.

Workloads, on in-process engines (the same code the worker serves; no HTTP, so TTFT is the engine's):
- chat: `--adapters` adapters picked Zipf(1.1), each with its own `--system-tokens` system prompt; each
  conversation sends `--turns` turns, each turn resending the whole history plus a new user message;
  `--concurrency` conversations run at once. One worker with the cache on / off.
- router: the same chat workload on 3 workers, routed by the router's own policies (lorafleet_router/policy.py):
  cache-aware vs fewest-in-flight, both with the cache on.
- no-reuse: every request a random prompt of the same length, cache on / off: what the cache costs.
  A small difference on a shared 2-core machine, so it is measured in `--noreuse-rounds` interleaved
  pairs (the order alternates each round) and summarised by the median of the per-round ratios, of
  wall-clock throughput and of tokens per CPU second (what the work cost, whatever else ran meanwhile).

Reports TTFT p50/p99, generated tokens/s, prefix-cache hit rate (vLLM's counters) and, through the router,
max/mean requests per pod. Writes bench/prefix.json and bench/prefix.png.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bench_adapter, bench_model, log, machine, percentile, results_dir, write_json

MODEL = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768, vocab_size=512)
USER_TOKENS, ANSWER_TOKENS = 32, 16


def zipf_choice(rng: random.Random, n: int, s: float = 1.1) -> int:
    weights = [1 / (k + 1) ** s for k in range(n)]
    return rng.choices(range(n), weights)[0]


def conversations(args: argparse.Namespace, reuse: bool, seed: int = 0) -> list[tuple[int, list[list[int]]]]:
    """(adapter index, user messages per turn) per conversation; without reuse every prompt is random."""
    rng = random.Random(seed)
    return [
        (
            zipf_choice(rng, args.adapters),
            [[rng.randrange(3, 500) for _ in range(USER_TOKENS)] for _ in range(args.turns)],
        )
        for _ in range(args.conversations)
    ]


class Fleet:
    """`n` engines and a routing policy (None: one engine)."""

    def __init__(self, engines: list[Any], policy: Any) -> None:
        self.engines, self.policy = engines, policy
        self.inflight = {i: 0 for i in range(len(engines))}
        self.routed = {i: 0 for i in range(len(engines))}
        self.peak = {i: 0 for i in range(len(engines))}

    def pick(self, adapter: str, prompt: list[int]) -> int:
        if self.policy is None:
            return 0
        from lorafleet_router.policy import Route

        keys = [str(i) for i in range(len(self.engines))]
        loads = {str(i): n for i, n in self.inflight.items()}
        return int(self.policy.choose(keys, loads, Route(adapter, " ".join(map(str, prompt)))))


def _cpu_seconds() -> float:
    """User + system CPU time of this process (every engine thread): what the work cost, whatever else runs."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def run_workload(fleet: Fleet, args: argparse.Namespace, systems: list[list[int]], reuse: bool) -> dict[str, Any]:
    from lorafleet_worker.sample.params import SamplingParams

    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0, ignore_eos=True)
    ttfts: list[float] = []
    generated = 0
    rng = random.Random(1)
    counter = iter(range(10**9))

    async def one(adapter_idx: int, turns: list[list[int]]) -> None:
        nonlocal generated
        name = f"a{adapter_idx:02d}"
        history = list(systems[adapter_idx])
        for user in turns:
            history += user
            if not reuse:  # a random prompt of the same length: nothing to find in the cache
                history = [rng.randrange(3, 500) for _ in history]
            i = fleet.pick(name, history)
            fleet.inflight[i] += 1
            fleet.routed[i] += 1
            fleet.peak[i] = max(fleet.peak[i], fleet.inflight[i])
            start, first = time.perf_counter(), None
            try:
                async for out in fleet.engines[i].generate(f"r{next(counter)}", list(history), params, name):
                    if first is None:
                        first = time.perf_counter() - start
                    history.append(out.token_id)
                    generated += 1
            finally:
                fleet.inflight[i] -= 1
            assert first is not None
            ttfts.append(first)

    convs = conversations(args, reuse)
    sem = asyncio.Semaphore(args.concurrency)

    async def limited(c: tuple[int, list[list[int]]]) -> None:
        async with sem:
            await one(*c)

    t0, cpu0 = time.perf_counter(), _cpu_seconds()
    await asyncio.gather(*(limited(c) for c in convs))
    wall, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
    queries = sum(e.stats.prefix_cache_queries for e in fleet.engines)
    hits = sum(e.stats.prefix_cache_hits for e in fleet.engines)
    routed = list(fleet.routed.values())
    return {
        "requests": len(ttfts),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "tokens_per_s": generated / wall,
        "tokens_per_cpu_s": generated / cpu,
        "wall_s": wall,
        "hit_rate": hits / queries if queries else 0.0,
        "routed_per_pod": routed,
        "max_over_mean_load": max(routed) / (sum(routed) / len(routed)),
        "peak_inflight_per_pod": list(fleet.peak.values()),
    }


async def scenario(args: argparse.Namespace, *, pods: int, caching: bool, policy: str | None, reuse: bool) -> Any:
    from lorafleet_worker.core.engine import Engine

    model = bench_model("llama-prefix", **MODEL)
    engines = []
    for _ in range(pods):
        engine = Engine(model, max_loras=args.adapters, max_num_seqs=64, block_size=16, num_kv_blocks=args.kv_blocks,
                        max_model_len=2048, enable_prefix_caching=caching)  # fmt: skip
        await engine.start()
        for k in range(args.adapters):
            await engine.add_adapter(f"a{k:02d}", bench_adapter(model, k, 8))
        engines.append(engine)
    router = None
    if policy is not None:
        from lorafleet_router.policy import make_policy

        router = make_policy(policy)
    rng = random.Random(7)
    systems = [[rng.randrange(3, 500) for _ in range(args.system_tokens)] for _ in range(args.adapters)]
    try:
        return await run_workload(Fleet(engines, router), args, systems, reuse)
    finally:
        for engine in engines:
            await engine.stop()


def plot(results: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = [("ttft_p50_s", "TTFT p50 (s)"), ("tokens_per_s", "tokens/s"), ("hit_rate", "hit rate")]
    for ax, (key, label) in zip(axes, panels, strict=True):
        ax.bar(range(len(names)), [results[n][key] for n in names])
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(label)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    log(f"wrote {png}")


async def main_async(args: argparse.Namespace) -> None:
    runs = {
        "chat-1pod-cache": dict(pods=1, caching=True, policy=None, reuse=True),
        "chat-1pod-nocache": dict(pods=1, caching=False, policy=None, reuse=True),
        "chat-3pods-cache-aware": dict(pods=3, caching=True, policy="cache-aware", reuse=True),
        "chat-3pods-fewest-in-flight": dict(pods=3, caching=True, policy="fewest-in-flight", reuse=True),
    }
    results = {}
    for name, kw in runs.items():
        log(f"{name} ...")
        results[name] = await scenario(args, **kw)
        log(f"{name}: {results[name]}")
    ratios, cpu_ratios = [], []
    for k in range(args.noreuse_rounds):
        pair = {}
        for caching in (True, False) if k % 2 == 0 else (False, True):
            pair[caching] = await scenario(args, pods=1, caching=caching, policy=None, reuse=False)
        ratios.append(pair[True]["tokens_per_s"] / pair[False]["tokens_per_s"])
        cpu_ratios.append(pair[True]["tokens_per_cpu_s"] / pair[False]["tokens_per_cpu_s"])
        log(f"no-reuse round {k + 1}/{args.noreuse_rounds}: cache on / off throughput {ratios[-1]:.3f}, "
            f"per CPU second {cpu_ratios[-1]:.3f}")  # fmt: skip
        for caching, name in ((True, "noreuse-1pod-cache"), (False, "noreuse-1pod-nocache")):
            results.setdefault(name, pair[caching])  # the tables show the first round; the summary uses them all
    r = results
    summary = {
        "ttft_p50_speedup_chat": r["chat-1pod-nocache"]["ttft_p50_s"] / r["chat-1pod-cache"]["ttft_p50_s"],
        "router_hit_rate_vs_single": r["chat-3pods-cache-aware"]["hit_rate"] / r["chat-1pod-cache"]["hit_rate"],
        "router_max_over_mean_cache_aware": r["chat-3pods-cache-aware"]["max_over_mean_load"],
        "noreuse_throughput_ratio": statistics.median(ratios),
        "noreuse_throughput_ratio_per_round": ratios,
        "noreuse_tokens_per_cpu_s_ratio": statistics.median(cpu_ratios),
    }
    log(f"summary: {summary}")
    write_json("prefix", {"machine": machine(), "args": vars(args), "results": results, "summary": summary})
    plot(results, results_dir() / "prefix.png")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--adapters", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--kv-blocks", type=int, default=3072)
    p.add_argument("--noreuse-rounds", type=int, default=15, help="interleaved cache on/off pairs (no reuse)")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
