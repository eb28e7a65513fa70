"""Structured-output benchmark: a JSON-schema workload next to the same prompts unconstrained, one run.

On the real model (SmolLM2-135M-Instruct; the smoke model under LORAFLEET_BENCH_SMOKE=1), in the
in-process `Engine`, `--concurrency` closed-loop clients send `--requests` prompts, each for
`--max-tokens` tokens, greedy. The constrained pass gives every request a grammar that cannot
finish within max_tokens (an array of at least 64 bounded strings), the free pass sets ignore_eos,
so both generate the same number of tokens and the ratio of their throughputs is the cost of the
grammar. Passes alternate (free, constrained, free, constrained); the JSON keeps each pass and the
mean ratio, the mask time per step (computed in the background thread, and the part the step loop
waited for), and the compile time of each schema cold and from the cache.

    python bench/bench_structured.py           # writes bench/structured.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import log, machine, real_model, write_json

WORKLOAD_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 64}},
    "required": ["items"],
}
# Schemas timed for compilation (cold, then from the cache): small, nested with $defs, and the workload's.
COMPILE_SCHEMAS: dict[str, dict[str, Any]] = {
    "workload": WORKLOAD_SCHEMA,
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "format": "email"},
        },
        "required": ["name", "age"],
    },
    "nested_defs": {
        "$defs": {
            "address": {
                "type": "object",
                "properties": {"street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "zip"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {
            "home": {"$ref": "#/$defs/address"},
            "work": {"anyOf": [{"$ref": "#/$defs/address"}, {"type": "null"}]},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 5},
        },
        "required": ["home"],
    },
}


async def one_pass(engine: Any, prompts: list[list[int]], args: argparse.Namespace, grammar: Any) -> dict[str, Any]:
    from lorafleet_worker.sample.params import SamplingParams

    queue: asyncio.Queue[tuple[int, list[int]]] = asyncio.Queue()
    for item in enumerate(prompts):
        queue.put_nowait(item)
    tokens = 0
    texts: list[list[int]] = []

    async def client() -> None:
        nonlocal tokens
        while not queue.empty():
            i, prompt = queue.get_nowait()
            params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=grammar is None)
            ids = []
            async for out in engine.generate(f"r{time.perf_counter()}-{i}", prompt, params, grammar=grammar):
                if out.token_id >= 0:
                    ids.append(out.token_id)
            tokens += len(ids)
            texts.append(ids)

    masks = engine.core.structured.mask_stats
    before = (masks.steps, masks.compute_s, masks.wait_s)
    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(args.concurrency)))
    elapsed = time.perf_counter() - t0
    steps = masks.steps - before[0]
    return {
        "constrained": grammar is not None,
        "output_tokens": tokens,
        "seconds": round(elapsed, 3),
        "output_tok_s": round(tokens / elapsed, 1),
        "mask_steps": steps,
        "mask_compute_ms_per_step": round(1000 * (masks.compute_s - before[1]) / steps, 3) if steps else None,
        "mask_wait_ms_per_step": round(1000 * (masks.wait_s - before[2]) / steps, 3) if steps else None,
        "loadavg_1": round(os.getloadavg()[0], 2),
        "_texts": texts,
    }


def compile_times(compiler: Any) -> dict[str, Any]:
    from lorafleet_worker.structured.grammar import JsonSchema

    out = {}
    for name, schema in COMPILE_SCHEMAS.items():
        spec = JsonSchema.of(schema, name)
        t0 = time.perf_counter()
        compiler.compile(spec)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiler.compile(spec)
        cached = time.perf_counter() - t0
        out[name] = {"cold_ms": round(cold * 1000, 3), "cached_ms": round(cached * 1000, 4)}
        log(f"compile {name}: cold {cold * 1000:.2f} ms, cached {cached * 1000:.4f} ms")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)

    from lorafleet_worker.core.engine import Engine
    from lorafleet_worker.structured.grammar import GrammarCompiler, JsonSchema
    from lorafleet_worker.tokenizer import Tokenizer

    model = real_model()
    tokenizer = Tokenizer.from_dir(model)
    engine = Engine(model, max_loras=0, max_num_seqs=args.concurrency, max_model_len=1024)
    t0 = time.perf_counter()
    compiler = GrammarCompiler.from_model_dir(
        model, vocab_size=engine.config.vocab_size, eos_token_ids=engine.config.eos_token_ids
    )
    tokenizer_s = time.perf_counter() - t0  # llguidance reads tokenizer.json once per worker
    compiles = compile_times(compiler)
    grammar = compiler.compile(JsonSchema.of(WORKLOAD_SCHEMA, "workload"))
    topics = ["fruits", "cities", "colours", "animals", "tools", "rivers", "games", "songs"]
    prompts = [
        tokenizer.encode_chat([{"role": "user", "content": f"List {topics[i % len(topics)]} as JSON, request {i}."}])
        for i in range(args.requests)
    ]

    async def run() -> list[dict[str, Any]]:
        await engine.start()
        warm = argparse.Namespace(**{**vars(args), "concurrency": 4})
        for g in (None, grammar):
            await one_pass(engine, prompts[:4], warm, g)
        passes = []
        for r in range(args.rounds):
            for g in (None, grammar):
                res = await one_pass(engine, prompts, args, g)
                log(f"round {r} {'json_schema' if g else 'free'}: {res['output_tok_s']} tok/s, load {res['loadavg_1']}")
                passes.append(res)
        await engine.stop()
        return passes

    passes = asyncio.run(run())
    for p in passes:
        texts = p.pop("_texts")
        if p["constrained"]:  # every answer is a prefix of the schema's JSON, cut by max_tokens
            from partial_json_parser import loads

            p["valid_json_prefixes"] = sum(isinstance(loads(tokenizer.decode(t)), dict) for t in texts)
    free = [p["output_tok_s"] for p in passes if not p["constrained"]]
    constrained = [p["output_tok_s"] for p in passes if p["constrained"]]
    ratio = (sum(constrained) / len(constrained)) / (sum(free) / len(free))
    log(f"json_schema / free throughput: {ratio:.3f}")
    write_json(
        "structured",
        {
            "machine": machine(),
            "model": model.name,
            "concurrency": args.concurrency,
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "llguidance_tokenizer_s": round(tokenizer_s, 2),
            "compile": compiles,
            "compiler_stats": vars(compiler.stats),
            "passes": passes,
            "throughput_ratio_constrained_over_free": round(ratio, 3),
            "workload_schema": json.dumps(WORKLOAD_SCHEMA),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
