"""One user (concurrency 1), two versions of the worker side by side: the installed checkout (A) against
another checkout's worker code (B, e.g. a git worktree), interleaved rounds, the same prompts and server
settings as `bench_peers.py` (the real model, 128-token prompts, 64 streamed tokens, greedy).

B runs with `PYTHONPATH=<B>/worker/src:<B>/jobs/src`, ahead of the installed (editable) packages, so the
comparison is one venv, one machine, one run: only the worker code differs.

    python bench/one_user_ab.py --b /work/wt --precisions bf16 int8 --scenarios base one --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import bench_peers as peers
from common import log, machine, real_model, write_json


def one_pass(model: Path, trained: dict[str, Path], precision: str, scenario: str, workdir: Path) -> dict[str, Any]:
    """Start a worker (this process's environment decides which code), warm up, time 4 requests at c = 1."""
    adapters = peers.scenario_adapters(scenario, model, trained)
    server = peers.start_lorafleet(model, adapters, precision, workdir, os.cpu_count() or 1)
    try:
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        prompts = peers.random_prompts(5, seed=1, vocab=vocab)
        picks: list[str | None] = [adapters[0][0] if adapters else None] * 5
        asyncio.run(peers.timed_pass(server, prompts[:1], picks[:1], 1))  # warm-up (adapter into a slot)
        return asyncio.run(peers.timed_pass(server, prompts[1:], picks[1:], 1))
    finally:
        peers.stop(server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--b", type=Path, required=True, help="the other checkout (its worker/src and jobs/src)")
    parser.add_argument("--precisions", nargs="+", default=["bf16", "int8"], choices=sorted(peers.LORAFLEET_PRECISIONS))
    parser.add_argument("--scenarios", nargs="+", default=["base", "one"], choices=peers.SCENARIOS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="one_user_ab", help="bench/<out>.json")
    args = parser.parse_args()
    model = real_model()
    trained, _ = peers.trained_or_generated(model)
    workdir = Path(tempfile.mkdtemp(prefix="lorafleet-ab-"))
    b_path = os.pathsep.join(str(args.b.resolve() / p) for p in ("worker/src", "jobs/src"))
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for rnd in range(args.rounds):
        for precision in args.precisions:
            for scenario in args.scenarios:
                for side in ("A", "B") if rnd % 2 == 0 else ("B", "A"):
                    if side == "B":
                        os.environ["PYTHONPATH"] = b_path
                    else:
                        os.environ.pop("PYTHONPATH", None)
                    got = one_pass(model, trained, precision, scenario, workdir)
                    runs.setdefault(f"{precision} {scenario}", {}).setdefault(side, []).append(got)
                    log(f"round {rnd + 1} {side} {precision} {scenario}: ITL p50 {got['itl_p50_ms']} ms")
    os.environ.pop("PYTHONPATH", None)
    summary = {
        key: {side: round(statistics.median(r["itl_p50_ms"] for r in got), 2) for side, got in sides.items()}
        for key, sides in runs.items()
    }
    for key, s in summary.items():
        s["B/A"] = round(s["B"] / s["A"], 3)
        log(f"{key}: ITL p50 median A {s['A']} ms, B {s['B']} ms, B/A {s['B/A']}")
    write_json(args.out, {"machine": machine(), "b": str(args.b), "runs": runs, "itl_p50_median_ms": summary})


if __name__ == "__main__":
    main()
