"""What one adapter costs one user: decode tokens/s with one trained adapter against the base model, in one
in-process engine (the real model, 128-token prompts, 64 output tokens, greedy), passes interleaved so that the
ratio is taken under the same load; optionally the same for another checkout's worker code (`--b`), each side
in its own child process, sides alternated A B B A.

    python bench/one_adapter.py --precisions int8 bf16 --rounds 4
    python bench/one_adapter.py --b /tmp/before --precisions int8 --rounds 3 --repeats 2
    python bench/one_adapter.py --precisions int8 --scenarios base --concurrency 32 --b /tmp/before

A side's figure is the median over rounds of (adapter ITL p50 ÷ base ITL p50) and tokens/s the other way
(one ÷ base); with `--b`, B ÷ A of each figure too. Absolute numbers move with the shared VM's load: read the
ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import OUTPUT_LEN, PROMPT_LEN, one_pass, requests_for
from common import log, machine, real_model, write_json

PRECISIONS: dict[str, dict[str, Any]] = {
    "int8": {"dtype": "bfloat16", "quantization": "int8"},
    "bf16": {"dtype": "bfloat16"},
    "f32": {"dtype": "float32"},
}
SCENARIOS = ("base", "one", "mixed16")


def scenario_adapters(scenario: str, model: Path) -> list[tuple[str, Path]]:
    import bench_peers as peers

    trained, _ = peers.trained_or_generated(model)
    return peers.scenario_adapters(scenario, model, trained)


def side(precision: str, scenarios: list[str], rounds: int, concurrency: int) -> dict[str, Any]:
    """One engine, every scenario's adapters loaded, `rounds` interleaved passes of each scenario."""
    from lorafleet_worker.core.engine import Engine
    from lorafleet_worker.sample.params import SamplingParams

    model = real_model()
    adapters = {s: scenario_adapters(s, model) for s in scenarios}
    every = {name: path for pairs in adapters.values() for name, path in pairs}
    engine = Engine(
        model,
        max_loras=max(1, len(every)),
        max_cpu_loras=max(64, len(every)),
        max_lora_rank=64,
        max_num_seqs=max(concurrency, 32),
        max_model_len=PROMPT_LEN + OUTPUT_LEN + 16,
        **PRECISIONS[precision],
    )
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in scenarios}

    async def run() -> None:
        await engine.start()
        for name, path in every.items():
            await engine.add_adapter(name, path)
        reqs = {s: requests_for(concurrency, [n for n, _ in adapters[s]], engine.config.vocab_size) for s in scenarios}
        for s in scenarios:  # warm-up: adapters into slots, kernels built
            await one_pass(engine, SamplingParams, reqs[s][:1], 1)
        for rnd in range(rounds):
            for s in scenarios if rnd % 2 == 0 else scenarios[::-1]:
                runs[s].append(await one_pass(engine, SamplingParams, reqs[s][: max(1, concurrency)], concurrency))
        await engine.stop()

    asyncio.run(run())
    return runs


def ratios(runs: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """Per scenario other than base: median over rounds of its ITL p50 / base's and tokens/s / base's."""
    out: dict[str, float] = {}
    for s, passes in runs.items():
        out[f"{s} itl_p50_ms"] = statistics.median(p["itl_p50_ms"] for p in passes)
        out[f"{s} tok_s"] = statistics.median(p["output_tok_s"] for p in passes)
        if s != "base" and "base" in runs:
            pairs = list(zip(passes, runs["base"], strict=True))
            out[f"{s}/base itl"] = round(statistics.median(p["itl_p50_ms"] / b["itl_p50_ms"] for p, b in pairs), 3)
            tok_s = statistics.median(p["output_tok_s"] / b["output_tok_s"] for p, b in pairs)
            out[f"{s}/base tok_s"] = round(tok_s, 3)
    return out


def child(args: argparse.Namespace, precision: str, code: Path | None) -> dict[str, Any]:
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join(str(code.resolve() / p) for p in ("worker/src", "jobs/src"))
    else:
        env.pop("PYTHONPATH", None)
    cmd = [sys.executable, __file__, "--child", precision, "--scenarios", *args.scenarios,
           "--rounds", str(args.rounds), "--concurrency", str(args.concurrency)]  # fmt: skip
    got = subprocess.run(cmd, env=env, check=True, stdout=subprocess.PIPE, text=True)
    runs: dict[str, Any] = json.loads(got.stdout.strip().splitlines()[-1])
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precisions", nargs="+", default=["int8"], choices=list(PRECISIONS))
    parser.add_argument("--scenarios", nargs="+", default=["base", "one"], choices=SCENARIOS)
    parser.add_argument("--rounds", type=int, default=4, help="interleaved passes of each scenario per child")
    parser.add_argument("--repeats", type=int, default=1, help="children per side (A B B A ...)")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--b", type=Path, help="another checkout (its worker/src) to run as side B")
    parser.add_argument("--out", default="one_adapter", help="bench/<out>.json")
    parser.add_argument("--child", choices=list(PRECISIONS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(side(args.child, args.scenarios, args.rounds, args.concurrency)), flush=True)
        return
    results: dict[str, Any] = {}
    for precision in args.precisions:
        sides: dict[str, list[dict[str, Any]]] = {}
        for rep in range(args.repeats):
            order = ("A", "B") if rep % 2 == 0 else ("B", "A")
            for name in order if args.b else ("A",):
                runs = child(args, precision, args.b if name == "B" else None)
                sides.setdefault(name, []).append(runs)
                log(f"{precision} {name} repeat {rep + 1}: {ratios(runs)}")
        merged = {
            name: ratios({s: [p for runs in reps for p in runs[s]] for s in args.scenarios})
            for name, reps in sides.items()
        }
        if "B" in merged:
            merged["B/A"] = {k: round(merged["B"][k] / merged["A"][k], 3) for k in merged["A"] if merged["A"][k]}
        results[precision] = {"sides": sides, "summary": merged}
        log(f"{precision}: {json.dumps(merged)}")
    cmd = "python bench/one_adapter.py " + " ".join(sys.argv[1:])
    write_json(args.out, {"machine": machine(), "command": cmd, "b": str(args.b) if args.b else None,
                          "concurrency": args.concurrency, "results": results})  # fmt: skip


if __name__ == "__main__":
    main()
