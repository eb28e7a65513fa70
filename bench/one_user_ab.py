"""Two versions of the worker side by side: the installed checkout (A) against another checkout's worker code
(B, e.g. a git worktree), interleaved rounds, the same prompts and server settings as `bench_peers.py` (the real
model, 128-token prompts, 64 streamed tokens, greedy); one user by default, `--concurrency` for more.
`--threads` sets the worker's OpenMP threads (default: every core); with fewer threads than cores the client
and the server do not share a core. `--per-client K` times K requests per client (a steady closed loop
rather than one wave).

B runs with `PYTHONPATH=<B>/worker/src:<B>/jobs/src`, ahead of the installed (editable) packages, so the
comparison is one venv, one machine, one run: only the worker code differs.

    python bench/one_user_ab.py --b /work/wt --precisions bf16 int8 --scenarios base one --rounds 2
    python bench/one_user_ab.py --b /work/wt --precisions int8 --scenarios base --concurrency 32
    python bench/one_user_ab.py --b /work/wt --threads 1 --per-client 2 --concurrency 32 --rounds 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import bench_peers as peers
from common import log, machine, real_model, write_json
from lorafleet_worker.host.huge_pages import huge_bytes


def one_pass(
    model: Path, trained: dict[str, Path], precision: str, scenario: str, workdir: Path, c: int, threads: int,
    per_client: int,
) -> dict[str, Any]:  # fmt: skip
    """Start a worker (this process's environment decides which code), warm up, time max(4, c · per_client)
    requests at concurrency c."""
    adapters = peers.scenario_adapters(scenario, model, trained)
    server = peers.start_lorafleet(model, adapters, precision, workdir, threads)
    try:
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        n = max(4, c * per_client) + 1
        prompts = peers.random_prompts(n, seed=1, vocab=vocab)
        picks = peers.adapter_picks([name for name, _ in adapters], n)
        asyncio.run(peers.timed_pass(server, prompts[:1], picks[:1], 1))  # warm-up (adapter into a slot)
        got = asyncio.run(peers.timed_pass(server, prompts[1:], picks[1:], c))
        held = huge_bytes(Path(f"/proc/{server.proc.pid}/smaps_rollup"))  # a suspect of the passes' two speeds
        got["huge_mib"] = None if held is None else round(held / 2**20)
        return got
    finally:
        peers.stop(server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--b", type=Path, required=True, help="the other checkout (its worker/src and jobs/src)")
    parser.add_argument("--precisions", nargs="+", default=["bf16", "int8"], choices=sorted(peers.LORAFLEET_PRECISIONS))
    parser.add_argument("--scenarios", nargs="+", default=["base", "one"], choices=peers.SCENARIOS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the worker's OpenMP threads")
    parser.add_argument("--per-client", type=int, default=1, help="requests timed per client (at least 4 in all)")
    parser.add_argument("--out", default="one_user_ab", help="bench/<out>.json")
    args = parser.parse_args()
    if not (args.b / "worker" / "src" / "lorafleet_worker").is_dir():  # else B would silently run A's code
        parser.error(f"--b {args.b}: no worker/src/lorafleet_worker there (a checkout or git worktree of lorafleet)")
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
                    got = one_pass(model, trained, precision, scenario, workdir, args.concurrency, args.threads,
                                   args.per_client)  # fmt: skip
                    runs.setdefault(f"{precision} {scenario}", {}).setdefault(side, []).append(got)
                    itl, tok_s, huge = got["itl_p50_ms"], got["tok_s"], got["huge_mib"]
                    pass_name = f"round {rnd + 1} {side} {precision} {scenario}"
                    log(f"{pass_name}: ITL p50 {itl} ms, {tok_s} tok/s, {huge} MiB on huge pages")
    os.environ.pop("PYTHONPATH", None)
    summary: dict[str, dict[str, float]] = {}
    for key, sides in runs.items():
        s = summary[key] = {}
        for metric in ("itl_p50_ms", "tok_s"):
            a, b = (statistics.median(r[metric] for r in sides[side]) for side in ("A", "B"))
            s[f"A {metric}"], s[f"B {metric}"], s[f"B/A {metric}"] = round(a, 2), round(b, 2), round(b / a, 3)
            # each round's B ÷ A (the two sides' passes of a round ran next to each other)
            paired = statistics.median(rb[metric] / ra[metric] for ra, rb in zip(sides["A"], sides["B"], strict=True))
            s[f"paired B/A {metric}"] = round(paired, 3)
        log(f"{key}: " + ", ".join(f"{k} {v}" for k, v in s.items()))
    write_json(args.out, {"machine": machine(), "command": "python bench/one_user_ab.py " + " ".join(sys.argv[1:]),
                          "b": str(args.b), "concurrency": args.concurrency, "threads": args.threads,
                          "per_client": args.per_client, "runs": runs, "medians": summary})  # fmt: skip


if __name__ == "__main__":
    main()
