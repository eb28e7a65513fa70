"""Two versions of the worker side by side: the installed checkout (A) against another checkout's worker code
(B, e.g. a git worktree), interleaved rounds, the same prompts and server settings as `bench_peers.py` (the real
model, 128-token prompts, 64 streamed tokens, greedy); one user by default, `--concurrency` for more.
`--threads` sets the worker's OpenMP threads (default: every core); with fewer threads than cores the client
and the server do not share a core. `--per-client K` times K requests per client (a steady closed loop
rather than one wave). By default every pass starts its own worker (rounds interleaved A B / B A); with
`--paired N` both sides' workers stay up for a cell and N pairs of passes alternate A B B A ..., each pass with
new prompts (the same for both sides), so that a pair's two passes run seconds apart rather than minutes.

B runs with `PYTHONPATH=<B>/worker/src:<B>/jobs/src`, ahead of the installed (editable) packages, so the
comparison is one venv, one machine, one run: only the worker code differs.

    python bench/one_user_ab.py --b /work/wt --precisions bf16 int8 --scenarios base one --rounds 2
    python bench/one_user_ab.py --b /work/wt --precisions int8 --scenarios base --concurrency 32
    python bench/one_user_ab.py --b /work/wt --threads 1 --per-client 2 --concurrency 32 --rounds 4
    python bench/one_user_ab.py --b /work/wt --threads 1 --precisions bf16 --scenarios base one --paired 8
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


def start(side: str, b_path: str, model: Path, adapters: list[tuple[str, Path]], precision: str, workdir: Path,
          threads: int) -> peers.Server:  # fmt: skip
    """A worker of `side`: B's code through PYTHONPATH, A's the installed packages; its logs in workdir/<side>."""
    if side == "B":
        os.environ["PYTHONPATH"] = b_path
    try:
        (workdir / side).mkdir(parents=True, exist_ok=True)
        return peers.start_lorafleet(model, adapters, precision, workdir / side, threads)
    finally:
        os.environ.pop("PYTHONPATH", None)


def measure(server: peers.Server, names: list[str], vocab: int, c: int, per_client: int, seed: int) -> dict[str, Any]:
    """max(4, c · per_client) requests at concurrency c, prompts drawn with `seed`, and the worker's memory on huge
    pages afterwards."""
    n = max(4, c * per_client)
    got = asyncio.run(peers.timed_pass(server, peers.random_prompts(n, seed, vocab), peers.adapter_picks(names, n), c))
    held = huge_bytes(Path(f"/proc/{server.proc.pid}/smaps_rollup"))  # a suspect of the passes' two speeds
    got["huge_mib"] = None if held is None else round(held / 2**20)
    return got


def cell_inputs(model: Path, trained: dict[str, Path], scenario: str) -> tuple[list[tuple[str, Path]], list[str], int]:
    """The scenario's adapters (name, directory), their names, and the model's vocabulary size."""
    adapters = peers.scenario_adapters(scenario, model, trained)
    return adapters, [name for name, _ in adapters], json.loads((model / "config.json").read_text())["vocab_size"]


def log_pass(label: str, got: dict[str, Any]) -> None:
    log(f"{label}: ITL p50 {got['itl_p50_ms']} ms, {got['tok_s']} tok/s, {got['huge_mib']} MiB on huge pages")


def warm(server: peers.Server, names: list[str], vocab: int) -> None:
    """One request (its adapter into a slot) before anything is timed."""
    asyncio.run(peers.timed_pass(server, peers.random_prompts(1, 0, vocab), peers.adapter_picks(names, 1), 1))


def cell_passes(sides: str, args: argparse.Namespace, model: Path, trained: dict[str, Path], precision: str,
                scenario: str, workdir: Path, b_path: str, seed: int) -> dict[str, dict[str, Any]]:  # fmt: skip
    """One pass of each side in `sides`' order, each on a worker of its own started for it."""
    adapters, names, vocab = cell_inputs(model, trained, scenario)
    out = {}
    for side in sides:
        server = start(side, b_path, model, adapters, precision, workdir, args.threads)
        try:
            warm(server, names, vocab)
            out[side] = measure(server, names, vocab, args.concurrency, args.per_client, seed)
        finally:
            peers.stop(server)
    return out


def paired_cell(args: argparse.Namespace, model: Path, trained: dict[str, Path], precision: str, scenario: str,
                workdir: Path, b_path: str) -> dict[str, list[dict[str, Any]]]:  # fmt: skip
    """Both sides' workers up at once for the cell (the idle one waits on its socket), `--paired` pairs of passes
    in the order A B B A A B ..., pair i (from 0) with prompts of seed i + 1 on both sides."""
    adapters, names, vocab = cell_inputs(model, trained, scenario)
    servers: dict[str, peers.Server] = {}
    try:
        for side in "AB":
            servers[side] = start(side, b_path, model, adapters, precision, workdir, args.threads)
            warm(servers[side], names, vocab)
        runs: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
        for i in range(args.paired):
            for side in "AB" if i % 2 == 0 else "BA":
                idle = servers["B" if side == "A" else "A"]
                idle_before = idle.cpu_s()
                got = measure(servers[side], names, vocab, args.concurrency, args.per_client, seed=1 + i)
                got["idle_side_cpu_s"] = round(idle.cpu_s() - idle_before, 3)  # the waiting worker's, to be ~0
                runs[side].append(got)
                log_pass(f"pair {i + 1} {side} {precision} {scenario}", got)
        return runs
    finally:
        for server in servers.values():
            peers.stop(server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--b", type=Path, required=True, help="the other checkout (its worker/src and jobs/src)")
    parser.add_argument("--precisions", nargs="+", default=["bf16", "int8"], choices=sorted(peers.LORAFLEET_PRECISIONS))
    parser.add_argument("--scenarios", nargs="+", default=["base", "one"], choices=peers.SCENARIOS)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of one worker start per pass")
    parser.add_argument("--paired", type=int, default=0, metavar="N", help="both workers up per cell, N pairs ABBA")
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
    if args.paired:
        for precision in args.precisions:
            for scenario in args.scenarios:
                key = f"{precision} {scenario}"
                runs[key] = paired_cell(args, model, trained, precision, scenario, workdir, b_path)
    for rnd in range(0 if args.paired else args.rounds):
        for precision in args.precisions:
            for scenario in args.scenarios:
                order = "AB" if rnd % 2 == 0 else "BA"
                got = cell_passes(order, args, model, trained, precision, scenario, workdir, b_path, seed=1)
                for side in order:
                    runs.setdefault(f"{precision} {scenario}", {}).setdefault(side, []).append(got[side])
                    log_pass(f"round {rnd + 1} {side} {precision} {scenario}", got[side])
    summary: dict[str, dict[str, float]] = {}
    for key, sides in runs.items():
        s = summary[key] = {}
        for metric in ("itl_p50_ms", "tok_s"):
            a, b = (statistics.median(r[metric] for r in sides[side]) for side in ("A", "B"))
            s[f"A {metric}"], s[f"B {metric}"], s[f"B/A {metric}"] = round(a, 2), round(b, 2), round(b / a, 3)
            # each round's (pair's) B ÷ A: the two sides' passes of a round ran next to each other
            paired = statistics.median(rb[metric] / ra[metric] for ra, rb in zip(sides["A"], sides["B"], strict=True))
            s[f"paired B/A {metric}"] = round(paired, 3)
        log(f"{key}: " + ", ".join(f"{k} {v}" for k, v in s.items()))
    write_json(args.out, {"machine": machine(), "command": "python bench/one_user_ab.py " + " ".join(sys.argv[1:]),
                          "b": str(args.b), "concurrency": args.concurrency, "threads": args.threads,
                          "per_client": args.per_client, "paired": args.paired, "runs": runs,
                          "medians": summary})  # fmt: skip


if __name__ == "__main__":
    main()
