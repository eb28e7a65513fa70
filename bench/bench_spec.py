"""Speculative-decoding benchmark: the same requests with and without n-gram speculation (and jump-forward),
interleaved rounds, one process.

On the real model (SmolLM2-135M-Instruct with the demo's trained adapters; the smoke model under
LORAFLEET_BENCH_SMOKE=1), two in-process `Engine`s with the same settings but `--speculative-config`
(`jump_forward` too in the structured workload) run the same requests in turn, greedy:

  grounded   one user: extraction, quoting and SQL over a text or schema given in the prompt (what
             prompt lookup finds), each request on the base model or one of the trained adapters
  json       one user: a JSON schema with long fixed keys (jump-forward computes them in one step)
  c32        32 closed-loop clients on the grounded prompts (speculation backs off above
             `disable_by_batch_size` running requests: the ratio should stay near 1)

Per pass: output tokens per second, and for the speculative engine the drafts, draft tokens and
accepted tokens; per workload the ratio speculative / plain of each round (the two engines run in turn,
the first alternating, so that a shared machine's load swings hit both), its mean and median, and whether
the two engines gave the same greedy tokens. For the grounded workload also the lookup sweep: how many steps
other `prompt_lookup_min` / `prompt_lookup_max` / `num_speculative_tokens` choices would take to give the same
greedy tokens (greedy output does not depend on them, so this is exact without running the model): the tokens per
step that bound the speedup of this workload on this model.

    python bench/bench_spec.py                                   # writes bench/spec.json
    python bench/bench_spec.py --precision int8 --workloads grounded \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SMOKE, log, machine, real_model, trained_adapters, write_json

SPEC_CONFIG = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
PRECISIONS: dict[str, dict[str, Any]] = {
    "auto": {},  # the checkpoint's dtype as the worker resolves it (float32 on a CPU without bfloat16 units)
    "bf16": {"dtype": "bfloat16"},
    "int8": {"dtype": "bfloat16", "quantization": "int8"},
}
# (prompt_lookup_min, prompt_lookup_max, num_speculative_tokens) of the lookup sweep
SWEEP = ((2, 4, 4), (1, 4, 4), (2, 4, 5), (1, 3, 5), (2, 4, 8), (1, 4, 8), (3, 5, 5), (1, 8, 8))
ARTICLE = (
    "Order 48213 was placed by Margaret Okonkwo-Hale on 12 March 2024 for a walnut writing desk and two brass "
    "lamps. It shipped from the Rotterdam warehouse to 17 Kingfisher Lane, Bristol, and was delivered on 19 "
    "March 2024. Customer support ticket 7731 notes that one lamp arrived with a dented shade and a replacement "
    "was sent on 21 March 2024."
)
SCHEMA_SQL = (
    "CREATE TABLE customers (customer_id INTEGER PRIMARY KEY, full_name TEXT, city TEXT, signup_date DATE);\n"
    "CREATE TABLE orders (order_id INTEGER PRIMARY KEY, customer_id INTEGER REFERENCES customers(customer_id), "
    "order_date DATE, total_amount NUMERIC);"
)
GROUNDED = [
    f"Here is a text:\n{ARTICLE}\nCopy the sentence that mentions the support ticket, word for word.",
    f"Here is a text:\n{ARTICLE}\nExtract the customer name, the order number and the delivery address.",
    f"Here is a database schema:\n{SCHEMA_SQL}\nWrite a SQL query that lists every customer's full_name with "
    "the total_amount of all their orders.",
    f"Here is a database schema:\n{SCHEMA_SQL}\nWrite a SQL query that returns the city and the number of "
    "orders placed by customers of each city since 2024-01-01.",
    f"Here is a text:\n{ARTICLE}\nQuote the first sentence of the text exactly.",
    f"Here is a text:\n{ARTICLE}\nRepeat the text, replacing every date with the word DATE.",
]
LONG_KEYS_SCHEMA = {
    "type": "object",
    "properties": {
        "customer_full_name_as_written_on_the_order": {"type": "string", "maxLength": 40},
        "order_reference_number_from_the_confirmation": {"type": "integer"},
        "shipping_destination_street_address_line": {"type": "string", "maxLength": 40},
        "date_of_delivery_in_iso_8601_format": {"type": "string", "maxLength": 12},
        "number_of_items_that_arrived_damaged": {"type": "integer"},
    },
    "required": [
        "customer_full_name_as_written_on_the_order",
        "order_reference_number_from_the_confirmation",
        "shipping_destination_street_address_line",
        "date_of_delivery_in_iso_8601_format",
        "number_of_items_that_arrived_damaged",
    ],
}


def lookup_sweep(
    prompts: list[list[int]], outputs: list[list[int]], configs: tuple[tuple[int, int, int], ...] = SWEEP
) -> list[dict[str, Any]]:
    """Steps n-gram speculation takes to give the greedy `outputs` (each after its prompt) with each config: the
    prefill gives the first token, then each step keeps its draft's matching prefix and one more token."""
    from lorafleet_worker.spec_decode.ngram import NgramProposer

    total = sum(len(o) for o in outputs)
    rows = []
    for lo, hi, k in configs:
        proposer = NgramProposer(lo, hi, k)
        steps = drafted = accepted = 0
        for prompt, out in zip(prompts, outputs, strict=True):
            tokens, i = [*prompt, *out[:1]], 1
            steps += 1 if out else 0
            while i < len(out):
                draft = proposer.propose(tokens, len(out) - i)
                a = 0
                while a < len(draft) and draft[a] == out[i + a]:
                    a += 1
                drafted, accepted = drafted + len(draft), accepted + a
                tokens += out[i : i + a + 1]
                i += a + 1
                steps += 1
        rows.append(
            {
                "prompt_lookup_min": lo,
                "prompt_lookup_max": hi,
                "num_speculative_tokens": k,
                "steps": steps,
                "tokens_per_step": round(total / steps, 3) if steps else None,
                "draft_tokens": drafted,
                "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
            }
        )
    return rows


async def one_pass(
    engine: Any, jobs: list[tuple[list[int], str | None]], c: int, max_tokens: int, grammar: Any
) -> dict[str, Any]:
    """`jobs` (prompt, adapter) through `c` closed-loop clients; tokens per second and the spec counters."""
    from lorafleet_worker.sample.params import SamplingParams

    queue: asyncio.Queue[tuple[int, tuple[list[int], str | None]]] = asyncio.Queue()
    for item in enumerate(jobs):
        queue.put_nowait(item)
    texts: dict[int, list[int]] = {}

    async def client() -> None:
        while not queue.empty():
            i, (prompt, adapter) = queue.get_nowait()
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            rid = f"r{time.perf_counter()}-{i}"
            texts[i] = [
                o.token_id
                async for o in engine.generate(rid, prompt, params, adapter, grammar=grammar)
                if o.token_id >= 0
            ]

    before = engine.stats
    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(c)))
    elapsed = time.perf_counter() - t0
    after = engine.stats
    tokens = sum(len(t) for t in texts.values())
    drafted = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    return {
        "output_tokens": tokens,
        "seconds": round(elapsed, 3),
        "output_tok_s": round(tokens / elapsed, 2),
        "steps": after.steps - before.steps,
        "drafts": after.spec_drafts - before.spec_drafts,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
        "loadavg_1": round(os.getloadavg()[0], 2),
        "_tokens": [texts[i] for i in sorted(texts)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--c32-requests", type=int, default=32)
    parser.add_argument("--c32-max-tokens", type=int, default=32)
    parser.add_argument("--workloads", nargs="+", default=["grounded", "json", "c32"])
    parser.add_argument("--speculative-config", default=SPEC_CONFIG, help="the speculative engine's (vLLM's JSON)")
    parser.add_argument("--precision", choices=list(PRECISIONS), default="auto", help="both engines' weights")
    parser.add_argument("--out", default="spec", help="bench/<out>.json")
    args = parser.parse_args(argv)

    from lorafleet_worker.core.engine import Engine
    from lorafleet_worker.spec_decode.config import SpeculativeConfig
    from lorafleet_worker.structured.grammar import JsonSchema
    from lorafleet_worker.tokenizer import Tokenizer

    model = real_model()
    adapters = trained_adapters(model)
    tokenizer = Tokenizer.from_dir(model)
    common: dict[str, Any] = {"max_loras": 4, "max_num_seqs": 32, "max_model_len": 1024, **PRECISIONS[args.precision]}
    spec_config = SpeculativeConfig.parse(args.speculative_config)
    engines = {
        "plain": Engine(model, **common),
        "spec": Engine(model, **common, speculative_config=spec_config, jump_forward=True),
    }
    grammar = engines["plain"].compile(JsonSchema.of(LONG_KEYS_SCHEMA, "bench"))
    names: list[str | None] = [None, *adapters]
    prompts = [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in GROUNDED]
    grounded = [(p, names[i % len(names)]) for i, p in enumerate(prompts)]
    json_prompt = f"Here is a text:\n{ARTICLE}\nFill in the JSON fields from the text."
    json_jobs: list[tuple[list[int], str | None]] = [
        (tokenizer.encode_chat([{"role": "user", "content": json_prompt}]), None)
    ] * 3
    c32 = [(prompts[i % len(prompts)], names[i % len(names)]) for i in range(args.c32_requests)]
    workloads: dict[str, tuple[list[tuple[list[int], str | None]], int, int, Any]] = {
        "grounded": (grounded, 1, args.max_tokens, None),
        "json": (json_jobs, 1, 96, grammar),
        "c32": (c32, 32, args.c32_max_tokens, None),
    }

    async def run() -> dict[str, Any]:
        for engine in engines.values():
            await engine.start()
            for name, path in adapters.items():
                await engine.add_adapter(name, path)
            await one_pass(engine, grounded[:2], 2, 8, None)  # warm-up
        results: dict[str, Any] = {}
        for w in args.workloads:
            jobs, c, max_tokens, g = workloads[w]
            passes: list[dict[str, Any]] = []
            for r in range(args.rounds):
                order = ["plain", "spec"] if r % 2 == 0 else ["spec", "plain"]
                for kind in order:
                    res = await one_pass(engines[kind], jobs, c, max_tokens, g)
                    res.update(engine=kind, round=r)
                    log(
                        f"{w} round {r} {kind}: {res['output_tok_s']} tok/s, accepted {res['accepted_tokens']}/"
                        f"{res['draft_tokens']}, load {res['loadavg_1']}"
                    )
                    passes.append(res)
            same = all(
                p["_tokens"] == q["_tokens"]
                for p in passes
                if p["engine"] == "plain"
                for q in passes
                if q["engine"] == "spec" and q["round"] == p["round"]
            )
            sweep = None
            if w == "grounded":
                plain = next(p["_tokens"] for p in passes if p["engine"] == "plain")
                sweep = lookup_sweep([prompt for prompt, _ in jobs], plain)
            for p in passes:
                p.pop("_tokens")
            ratios = []
            for r in range(args.rounds):
                by = {p["engine"]: p["output_tok_s"] for p in passes if p["round"] == r}
                ratios.append(by["spec"] / by["plain"])
            ratio = sum(ratios) / len(ratios)
            median = statistics.median(ratios)
            log(f"{w}: spec / plain throughput mean {ratio:.3f}, median {median:.3f}, same tokens {same}")
            results[w] = {
                "concurrency": c,
                "requests": len(jobs),
                "max_tokens": max_tokens,
                "passes": passes,
                "ratio_rounds": [round(x, 3) for x in ratios],
                "throughput_ratio_spec_over_plain": round(ratio, 3),
                "median_ratio_spec_over_plain": round(median, 3),
                "same_greedy_tokens": same,
            }
            if sweep is not None:
                results[w]["lookup_sweep"] = sweep
        for engine in engines.values():
            await engine.stop()
        return results

    results = asyncio.run(run())
    write_json(
        args.out,
        {
            "machine": machine(),
            "command": "python bench/bench_spec.py " + " ".join(sys.argv[1:]),
            "model": model.name,
            "smoke": SMOKE,
            "precision": args.precision,
            "speculative_config": args.speculative_config,
            "disable_by_batch_size": spec_config.disable_by_batch_size,
            "jump_forward": True,
            "json_schema": json.dumps(LONG_KEYS_SCHEMA),
            "workloads": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
