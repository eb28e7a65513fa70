"""Engine benchmark: lorafleet vs Hugging Face transformers + PEFT, side by side in one run.

Scenarios (prompt 128 tokens, 64 output tokens, greedy, EOS ignored), each at concurrency
1, 8, 32 and 64. On the generated weight-heavy Llama (97M parameters, random weights):
  base     base model only
  one      every request uses the same adapter (rank 16)
  mixed16  16 adapters, ranks 8/16/32/64 round-robin on all seven projections (as heavy as the base)
  churn64  64 adapters, lorafleet with --max-loras 16 (slot churn)
On the real model, SmolLM2-135M-Instruct (`make setup` converts it; demo/real_model.py):
  real-base      base model only
  real-trained4  the demo's four trained adapters (ranks 8-32, different target modules), round-robin
  real-qv16      16 adapters of rank 8/8/8/16 on q_proj + v_proj (PEFT's Llama default): ~7 % of the
                 base weights, the realistic proportion

Every lorafleet run also times the parts of its decode steps at `--breakdown-concurrency` (one more
pass, with timing hooks) and the parent measures this machine's roofline (bench/roofline.py): each
scenario's JSON says how far each part is from its floor.

lorafleet runs the in-process `Engine` (continuous batching); the peer runs
`PeftModel.generate(adapter_names=...)` in static batches of `concurrency` requests, the
mixed-adapter batch inference PEFT documents. Each (system, scenario) runs in its own
subprocess so that peak memory is its own.

    python bench/bench_engine.py                 # the full run (writes bench/engine.json)
    python bench/bench_engine.py --quick         # concurrency 1 and 8, fewer scenarios
    python bench/bench_engine.py --workload varied   # bench/engine_varied.json

Workloads: `uniform` (the default) gives every request a 128-token prompt and 64 output tokens,
max(4, concurrency) requests: the best case for PEFT's static batches (no padding, everyone
finishes together). `varied` draws prompt lengths from 64..192 and output lengths from 16..112
(same means) and sends max(8, 3 x concurrency) requests through `concurrency` closed-loop
clients, like a server's traffic: PEFT pads each static batch to its longest prompt and runs it
to its longest output; lorafleet admits the next request as soon as one finishes.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import roofline
from common import (
    MIXED_RANKS,
    bench_adapter,
    bench_model,
    log,
    machine,
    peak_rss_mib,
    percentile,
    read_json,
    real_model,
    trained_adapters,
    write_json,
)

PROMPT_LEN = 128
OUTPUT_LEN = 64
DTYPES = ("float32", "bfloat16")
MAX_MODEL_LEN = PROMPT_LEN * 3 // 2 + OUTPUT_LEN * 7 // 4 + 16  # fits the varied workload
QV_RANKS = (8, 8, 8, 16)
QV_TARGETS = ("q_proj", "v_proj")
BREAKDOWN_CONTEXT = PROMPT_LEN + OUTPUT_LEN // 2  # mean context of a uniform pass's decode steps


@dataclass(frozen=True)
class Scenario:
    model: str  # "random": the generated weight-heavy Llama; "real": SmolLM2-135M-Instruct
    adapters: int
    kind: str = "mixed"  # "mixed" (ranks 8-64, all projections), "qv" (QV_RANKS on QV_TARGETS), "trained"
    base: str = "base"  # the scenario that `lorafleet_vs_base` divides by
    max_loras: int = 16


SCENARIOS: dict[str, Scenario] = {
    "base": Scenario("random", 0),
    "one": Scenario("random", 1),
    "mixed16": Scenario("random", 16),
    "churn64": Scenario("random", 64),
    "real-base": Scenario("real", 0, base="real-base"),
    "real-trained4": Scenario("real", 4, kind="trained", base="real-base"),
    "real-qv16": Scenario("real", 16, kind="qv", base="real-base"),
}


def scenario_model(scenario: str) -> Path:
    return real_model() if SCENARIOS[scenario].model == "real" else bench_model()


def scenario_adapters(scenario: str, model: Path) -> list[tuple[str, Path]]:
    """(name, directory) of the scenario's adapters, built (or trained) and cached on first use."""
    spec = SCENARIOS[scenario]
    if spec.kind == "trained":
        return list(trained_adapters(model).items())
    if spec.kind == "qv":
        ranks = [QV_RANKS[i % len(QV_RANKS)] for i in range(spec.adapters)]
        return [(f"q{i:03d}", bench_adapter(model, i, r, QV_TARGETS)) for i, r in enumerate(ranks)]
    return [(name, bench_adapter(model, int(name[1:]), rank)) for name, rank in adapter_plan(spec.adapters)]


def adapter_plan(n: int) -> list[tuple[str, int]]:
    """(name, rank) of the scenario's adapters; a single adapter is rank 16."""
    if n == 1:
        return [("a000", 16)]
    return [(f"a{i:03d}", MIXED_RANKS[i % len(MIXED_RANKS)]) for i in range(n)]


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    adapter: str | None
    max_tokens: int = OUTPUT_LEN


WORKLOADS = ("uniform", "varied")


def requests_for(concurrency: int, adapters: list[str], vocab: int, workload: str = "uniform") -> list[Request]:
    """The fixed request set of one pass (seeded by the concurrency, so every system gets the same)."""
    import torch

    gen = torch.Generator().manual_seed(concurrency)
    varied = workload == "varied"
    n = max(8, 3 * concurrency) if varied else max(4, concurrency)
    out = []
    for i in range(n):
        plen = (
            int(torch.randint(PROMPT_LEN // 2, PROMPT_LEN * 3 // 2 + 1, (1,), generator=gen)) if varied else PROMPT_LEN
        )
        olen = (
            int(torch.randint(OUTPUT_LEN // 4, OUTPUT_LEN * 7 // 4 + 1, (1,), generator=gen)) if varied else OUTPUT_LEN
        )
        prompt = torch.randint(10, vocab, (plen,), generator=gen).tolist()
        out.append(Request(prompt, adapters[i % len(adapters)] if adapters else None, olen))
    return out


def summarize(
    wall: float, ttfts: list[float], itls: list[float], tokens: int, concurrency: int, n: int
) -> dict[str, Any]:
    return {
        "concurrency": concurrency,
        "requests": n,
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "output_tok_s": round(tokens / wall, 2),
        "ttft_p50_ms": _ms(percentile(ttfts, 50)),
        "ttft_p99_ms": _ms(percentile(ttfts, 99)),
        "itl_p50_ms": _ms(percentile(itls, 50)),
        "itl_p99_ms": _ms(percentile(itls, 99)),
    }


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 2)


# ---------------------------------------------------------------------------- lorafleet


def run_lorafleet(
    model: Path,
    scenario: str,
    concurrencies: list[int],
    device: str,
    workload: str = "uniform",
    breakdown_c: int = 0,
    dtype: str = "float32",
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Throughput passes at each concurrency, then (if `breakdown_c`) one timed pass: ms per decode-step part."""
    from lorafleet_worker.core.engine import Engine
    from lorafleet_worker.sample.params import SamplingParams

    spec = SCENARIOS[scenario]
    adapters = scenario_adapters(scenario, model)
    engine = Engine(
        model,
        device=device,
        dtype=dtype,
        max_loras=spec.max_loras,
        max_cpu_loras=max(64, len(adapters)),
        max_lora_rank=64,
        max_num_seqs=max(*concurrencies, breakdown_c),
        max_model_len=MAX_MODEL_LEN,
    )

    async def main() -> tuple[list[dict[str, Any]], dict[str, float]]:
        await engine.start()
        for name, path in adapters:
            await engine.add_adapter(name, path)
        names = [n for n, _ in adapters]
        results = []
        await one_pass(engine, SamplingParams, requests_for(1, names, engine.config.vocab_size)[:1], 1)  # warm-up
        for c in concurrencies:
            reqs = requests_for(c, names, engine.config.vocab_size, workload)
            res = await one_pass(engine, SamplingParams, reqs, c)
            log(f"lorafleet {scenario} c={c}: {res['output_tok_s']} tok/s")
            results.append(res)
        breakdown: dict[str, float] = {}
        if breakdown_c:
            hooks = roofline.StepBreakdown(engine)
            reqs = requests_for(breakdown_c, names, engine.config.vocab_size)
            await one_pass(engine, SamplingParams, reqs, breakdown_c)
            hooks.remove()
            breakdown = hooks.decode_ms()
            log(f"lorafleet {scenario} c={breakdown_c} decode step breakdown (ms): {breakdown}")
        await engine.stop()
        return results, breakdown

    return asyncio.run(main())


async def one_pass(engine: Any, params_cls: Any, reqs: list[Request], c: int) -> dict[str, Any]:
    """`c` closed-loop clients send `reqs` to the engine (each sends its next one when one ends)."""
    queue: asyncio.Queue[tuple[int, Request]] = asyncio.Queue()
    for i, req in enumerate(reqs):
        queue.put_nowait((i, req))
    ttfts: list[float] = []
    itls: list[float] = []
    tokens = 0

    async def client() -> None:
        nonlocal tokens
        while not queue.empty():
            i, req = queue.get_nowait()
            params = params_cls(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
            t0 = last = time.perf_counter()
            first = True
            async for _ in engine.generate(f"r{c}-{i}-{t0}", req.prompt, params, req.adapter):
                now = time.perf_counter()
                (ttfts if first else itls).append(now - (t0 if first else last))
                first, last = False, now
                tokens += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(c)))
    return summarize(time.perf_counter() - t0, ttfts, itls, tokens, c, len(reqs))


# ---------------------------------------------------------------------------- transformers + PEFT


def load_peft(model: Path, adapters: list[tuple[str, Path]], device: str, dtype: str = "float32") -> Any:
    """The transformers model in `dtype`, wrapped by PEFT with the scenario's adapters (if any)."""
    import torch
    from transformers import AutoModelForCausalLM

    auto: Any = AutoModelForCausalLM
    hf: Any = auto.from_pretrained(model, dtype=getattr(torch, dtype)).to(device).eval()
    if adapters:
        from peft import PeftModel

        name0, path0 = adapters[0]
        hf = PeftModel.from_pretrained(hf, path0, adapter_name=name0)
        for name, path in adapters[1:]:
            hf.load_adapter(path, adapter_name=name)
        hf.eval()
    return hf


def peft_generate(hf: Any, batch: list[Request], device: str) -> tuple[float, list[float]]:
    """One static batch through `generate` (mixed adapters via `adapter_names` when `hf` is a PeftModel).

    Prompts are left-padded to the longest; the batch runs to its longest `max_tokens` (what a
    transformers server does with a static batch). Returns the start time and the time of every
    decoding step (the first one ends the prefill).
    """
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class StepClock(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            self.times.append(time.perf_counter())
            return scores

    longest = max(len(r.prompt) for r in batch)
    ids = torch.tensor([[0] * (longest - len(r.prompt)) + r.prompt for r in batch], device=device)
    mask = torch.tensor([[0] * (longest - len(r.prompt)) + [1] * len(r.prompt) for r in batch], device=device)
    steps = max(r.max_tokens for r in batch)
    clock = StepClock()
    kwargs: dict[str, Any] = {}
    if hasattr(hf, "peft_config"):
        kwargs["adapter_names"] = [r.adapter or "__base__" for r in batch]
    t0 = time.perf_counter()
    with torch.no_grad():
        hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            logits_processor=LogitsProcessorList([clock]),
            pad_token_id=0,
            **kwargs,
        )
    return t0, clock.times


def peft_pass(hf: Any, reqs: list[Request], c: int, device: str) -> dict[str, Any]:
    """The requests in static batches of `c` (what a transformers + PEFT server does).

    A request counts only its own `max_tokens` tokens and latencies; the steps its batch runs
    beyond them are the static batch's waste.
    """
    ttfts: list[float] = []
    itls: list[float] = []
    tokens = 0
    start = time.perf_counter()
    for i in range(0, len(reqs), c):
        batch = reqs[i : i + c]
        t0, times = peft_generate(hf, batch, device)
        for req in batch:
            own = times[: req.max_tokens]
            ttfts.append(own[0] - t0)
            itls += [b - a for a, b in itertools.pairwise(own)]
            tokens += len(own)
    return summarize(time.perf_counter() - start, ttfts, itls, tokens, c, len(reqs))


def run_peft(
    model: Path, scenario: str, concurrencies: list[int], device: str, workload: str = "uniform", dtype: str = "float32"
) -> list[dict[str, Any]]:
    adapters = scenario_adapters(scenario, model)
    hf = load_peft(model, adapters, device, dtype)
    names = [n for n, _ in adapters]
    vocab = hf.config.vocab_size
    peft_generate(hf, requests_for(1, names, vocab)[:1], device)  # warm-up
    results = []
    for c in concurrencies:
        res = peft_pass(hf, requests_for(c, names, vocab, workload), c, device)
        log(f"peft {scenario} c={c}: {res['output_tok_s']} tok/s")
        results.append(res)
    return results


# ---------------------------------------------------------------------------- interleaved A/B


AB_SYSTEMS = ("lorafleet/base", "lorafleet/mixed16")


def run_ab(model: Path, concurrencies: list[int], rounds: int, device: str) -> dict[str, Any]:
    """lorafleet base and lorafleet mixed16 on ONE Engine, pass after pass (base requests carry no adapter).

    On a noisy machine both see the same load: each round runs every (system, concurrency) once,
    and the ratio uses the best pass of each. The peer is deliberately not in this process: an
    idle Engine in the same process halved PEFT mixed16's throughput (61.3 -> 32.2 tok/s at c=32,
    bench/README.md), so comparisons with the peer come from the separate-process runs.
    """
    from lorafleet_worker.core.engine import Engine
    from lorafleet_worker.sample.params import SamplingParams

    adapters = scenario_adapters("mixed16", model)
    names = [n for n, _ in adapters]
    engine = Engine(model, device=device, max_loras=16, max_cpu_loras=64, max_lora_rank=64,
                    max_num_seqs=max(concurrencies), max_model_len=MAX_MODEL_LEN)  # fmt: skip
    vocab = engine.config.vocab_size
    passes: dict[str, list[dict[str, Any]]] = {f"{k}@{c}": [] for k in AB_SYSTEMS for c in concurrencies}

    async def main() -> None:
        await engine.start()
        for name, path in adapters:
            await engine.add_adapter(name, path)
        await one_pass(engine, SamplingParams, requests_for(1, names, vocab)[:1], 1)
        for r in range(rounds):
            for c in concurrencies:
                for key in AB_SYSTEMS:
                    reqs = requests_for(c, [] if key.endswith("base") else names, vocab)
                    res = await one_pass(engine, SamplingParams, reqs, c)
                    res["loadavg_1m"] = round(os.getloadavg()[0], 2)
                    passes[f"{key}@{c}"].append(res)
                    log(f"A/B round {r + 1}: {key} c={c}: {res['output_tok_s']} tok/s")
        await engine.stop()

    asyncio.run(main())
    best = {k: max(v, key=lambda res: res["output_tok_s"]) for k, v in passes.items()}
    ratios = [
        {
            "concurrency": c,
            "mixed16_vs_base": ratio(
                best[f"lorafleet/mixed16@{c}"]["output_tok_s"], best[f"lorafleet/base@{c}"]["output_tok_s"]
            ),
        }
        for c in concurrencies
    ]
    return {"rounds": rounds, "passes": passes, "best": best, "ratios": ratios}


# ---------------------------------------------------------------------------- driver


def child(args: argparse.Namespace) -> None:
    model = scenario_model(args.scenario)
    breakdown: dict[str, float] = {}
    if args.system == "lorafleet":
        results, breakdown = run_lorafleet(
            model, args.scenario, args.concurrency, args.device, args.workload, args.breakdown_concurrency, args.dtype
        )
    else:
        results = run_peft(model, args.scenario, args.concurrency, args.device, args.workload, args.dtype)
    out: dict[str, Any] = {"results": results, "peak_rss_mib": round(peak_rss_mib(), 1)}
    if breakdown:
        out["decode_breakdown_ms"] = breakdown
    print(json.dumps(out))


def roofline_of(
    scenario: str, concurrency: int, machines: dict[str, dict[str, Any]], dtype: str = "float32"
) -> dict[str, Any]:
    """This machine's roofline at the scenario's decode shapes (measured once per model and dtype) and its floors."""
    from lorafleet_worker.config import ModelConfig

    model = scenario_model(scenario)
    config = ModelConfig.from_dir(model)
    key = f"{model.name}@{dtype}"
    if key not in machines:
        log(f"measuring the roofline: read bandwidth, {dtype} GEMMs at {model.name}'s shapes (M = {concurrency}, 512)")
        machines[key] = roofline.measure_machine(config, concurrency, dtype)
    shapes = [roofline.AdapterShape.read(path) for _, path in scenario_adapters(scenario, model)]
    floors = roofline.floors_ms(
        config, shapes, concurrency, BREAKDOWN_CONTEXT, machines[key], roofline.dtype_bytes(dtype)
    )
    return {
        "model": model.name,
        "dtype": dtype,
        "concurrency": concurrency,
        "context": BREAKDOWN_CONTEXT,
        "machine": machines[key],
        "adapter_weight_pct": round(100 * roofline.adapter_weight_share(config, shapes), 2),
        "floors_ms": floors,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="concurrency 1 and 8; scenarios base and mixed16")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--systems", nargs="+", default=["lorafleet", "peft"], choices=["lorafleet", "peft"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workload", default="uniform", choices=WORKLOADS, help="see the module docstring")
    ap.add_argument("--merge", action="store_true", help="keep the runs already in bench/engine.json")
    ap.add_argument("--ab", type=int, metavar="ROUNDS", help="interleaved A/B in one process (bench/engine_ab.json)")
    ap.add_argument("--breakdown-concurrency", type=int, default=32, metavar="C",
                    help="time the parts of lorafleet's decode steps in one more pass at C (0: skip)")  # fmt: skip
    ap.add_argument("--dtype", nargs="+", default=["float32"], choices=DTYPES,
                    help="weights and KV cache of both systems; several: each (scenario, system) runs in each "
                         "dtype back to back; keys of runs not in float32 end in @dtype")  # fmt: skip
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--system", help=argparse.SUPPRESS)
    ap.add_argument("--scenario", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.dtype = args.dtype[0]
        child(args)
        return
    if args.quick:
        args.concurrency, args.scenarios = [1, 8], ["base", "mixed16"]
    if args.ab:
        model = bench_model()
        result = run_ab(model, args.concurrency, args.ab, args.device)
        write_json("engine_ab", {"machine": machine(), "model": {"path": str(model)}, **result})
        return

    for scenario in args.scenarios:  # build, convert or train what the scenarios need before timing anything
        scenario_adapters(scenario, scenario_model(scenario))
    out_name = "engine" if args.workload == "uniform" else f"engine_{args.workload}"
    previous = read_json(out_name) if args.merge else None
    runs: dict[str, dict[str, Any]] = dict(previous["runs"]) if previous else {}
    rooflines: dict[str, dict[str, Any]] = dict(previous.get("roofline", {})) if previous else {}
    machines: dict[str, dict[str, Any]] = {}
    # both systems (and every dtype) back to back: they see the same machine load
    for scenario, dtype, system in itertools.product(args.scenarios, args.dtype, args.systems):
        log(f"running {system} / {scenario} ({dtype}) at concurrency {args.concurrency}")
        breakdown_c = args.breakdown_concurrency  # every dtype: the roofline counts that dtype's bytes and peak
        cmd = [sys.executable, __file__, "--child", "--system", system, "--scenario", scenario, "--device",
               args.device, "--workload", args.workload, "--concurrency", *map(str, args.concurrency),
               "--breakdown-concurrency", str(breakdown_c), "--dtype", dtype]  # fmt: skip
        t0 = time.time()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
        run = json.loads(proc.stdout.strip().splitlines()[-1])
        run["started"] = time.strftime("%H:%M:%S", time.gmtime(t0))
        run["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
        run["dtype"] = dtype
        runs[run_key(system, scenario, dtype)] = run
        if "decode_breakdown_ms" in run:
            entry = roofline_of(scenario, args.breakdown_concurrency, machines, dtype)
            entry.update(roofline.distance(run["decode_breakdown_ms"], entry["floors_ms"]))
            rooflines[run_key("lorafleet", scenario, dtype).partition("/")[2]] = entry
        models = {s: str(scenario_model(s)) for s in SCENARIOS if any(scenario_of(k) == s for k in runs)}
        model_info = {"prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN, "models": models}
        write_json(
            out_name,
            {
                "workload": args.workload,
                "machine": machine(),
                "model": model_info,
                "runs": runs,
                "ratios": ratios(runs),
                "roofline": rooflines,
            },
        )


def scenario_of(key: str) -> str:
    """The scenario of a run key (`system/scenario[@dtype]`)."""
    return key.partition("/")[2].partition("@")[0]


def run_key(system: str, scenario: str, dtype: str) -> str:
    """`system/scenario` in float32, `system/scenario@dtype` in another dtype."""
    return f"{system}/{scenario}" + ("" if dtype == "float32" else f"@{dtype}")


def ratios(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Throughput ratios per (concurrency, scenario[@dtype]) present in `runs`; for a dtype other than
    float32, also each system in that dtype ÷ the same system in float32 (`vs_float32`)."""

    def tok_s(key: str, c: int) -> float | None:
        for r in runs.get(key, {}).get("results", []):
            if r["concurrency"] == c:
                return float(r["output_tok_s"])
        return None

    concurrencies = sorted({r["concurrency"] for run in runs.values() for r in run["results"]})
    labels = list(dict.fromkeys(k.partition("/")[2] for k in runs))  # scenario or scenario@dtype
    labels.sort(key=lambda lab: (list(SCENARIOS).index(lab.partition("@")[0]), lab))
    out = []
    for c in concurrencies:
        for label in labels:
            scenario, _, dtype = label.partition("@")
            suffix = f"@{dtype}" if dtype else ""
            row: dict[str, Any] = {
                "concurrency": c,
                "scenario": label,
                "lorafleet_vs_base": ratio(
                    tok_s(f"lorafleet/{label}", c), tok_s(f"lorafleet/{SCENARIOS[scenario].base}{suffix}", c)
                ),
                "lorafleet_vs_peft": ratio(tok_s(f"lorafleet/{label}", c), tok_s(f"peft/{label}", c)),
            }
            if dtype:
                row["vs_float32"] = {
                    system: ratio(tok_s(f"{system}/{label}", c), tok_s(f"{system}/{scenario}", c))
                    for system in ("lorafleet", "peft")
                }
            out.append(row)
    return out


if __name__ == "__main__":
    main()
