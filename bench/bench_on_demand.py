"""Adapters on demand: time to first token of the first request to an adapter the worker does not hold, against
the same request once it is loaded.

One real worker (`lorafleet-worker serve`) on the real model, a real MinIO holding the demo's trained adapters
under `--adapters` names (copies of the four, each its own S3 prefix, so every first request downloads), every
name in the worker's catalogue (`PUT /v1/loras/catalog`) and `--max-loaded-loras` below that count so the
least recently used adapters are evicted. Streamed completions, one at a time, `--max-tokens` tokens; TTFT is
the arrival of the first streamed token:

  cold      the first request naming an adapter: catalogue -> MinIO download -> load -> first token
  warm      the same request again at once (the adapter is loaded)
  reloaded  a second round over every name: the evicted ones load again from the worker's disk cache

Also the worker's counters over the run: `lorafleet_lora_on_demand_loads_total` and
`lorafleet_lora_on_demand_evictions_total`.

With `--long-tail`: `--catalogued` names in the catalogue of each of `--workers` workers, `--hot` of them
taking `--hot-share` of `--requests` requests from `--concurrency` clients (the hot names loaded beforehand),
every other request naming a cold adapter for the first time; each request goes to its adapter's rendezvous
worker (`lorafleet_operator.placement.rank`, as the router's on-demand fallback). Reports hot and cold TTFT.

    python bench/bench_on_demand.py [--adapters 40] [--max-loaded-loras 8]
    python bench/bench_on_demand.py --long-tail [--catalogued 1000 --hot 20 --requests 200 --workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
from common import log, machine, percentile, read_json, real_model, trained_adapters, write_json  # noqa: E402

HOST = "127.0.0.1"
PROMPT = "Tell me about the sea."
LOADS = "lorafleet_lora_on_demand_loads_total"
EVICTIONS = "lorafleet_lora_on_demand_evictions_total"
COLD_P50_TARGET_S = 1.0


def stats(samples: list[float]) -> dict[str, Any]:
    return {
        "n": len(samples),
        "p50_ms": round(1000 * (percentile(samples, 50) or 0), 1),
        "p99_ms": round(1000 * (percentile(samples, 99) or 0), 1),
        "max_ms": round(1000 * max(samples, default=0), 1),
    }


def ms(samples: list[float]) -> list[float]:
    return [round(1000 * s, 1) for s in samples]


def counters(client: httpx.Client, url: str) -> dict[str, float]:
    """The on-demand load counters by outcome and the eviction counter, from the worker's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    r = client.get(f"{url}/metrics")
    r.raise_for_status()
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if sample.name == LOADS:
                out[f"loads_{sample.labels.get('outcome', '')}"] = sample.value
            elif sample.name == EVICTIONS:
                out["evictions"] = out.get("evictions", 0.0) + sample.value
    return out


def ttft(client: httpx.Client, url: str, model: str, max_tokens: int) -> float:
    """Seconds from sending a streamed completion naming `model` to its first token."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    t0 = time.perf_counter()
    first: float | None = None
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{model}: HTTP {r.status_code} {r.read().decode(errors='replace')}")
        for line in r.iter_lines():
            data = line.startswith("data: ") and line != "data: [DONE]"
            if first is None and data and json.loads(line[6:])["choices"][0].get("text"):
                first = time.perf_counter()
    if first is None:
        raise RuntimeError(f"{model}: the stream carried no token")
    return first - t0


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    url: str
    system_url: str


def load_times(work: Path) -> list[float]:
    """The on-demand loads' own durations (fetch + load, no queueing nor prefill), from the workers' logs."""
    pattern = re.compile(r"loaded on demand from \S+ in ([0-9.]+)s")
    return [float(m[1]) for log_path in work.glob("worker-*.log") for m in pattern.finditer(log_path.read_text())]


def start_worker(model: Path, env: dict[str, str], work: Path, tag: str, max_loaded: int) -> Worker:
    """A worker with `--max-loaded-loras max_loaded`, its disk cache and log under `work`, ready."""
    from lorafleet_worker_dev.launch import free_port, launch_worker, stop_worker, wait_ready

    port, system_port = free_port(HOST), free_port(HOST)
    env = {**env, "DYN_LORA_PATH": str(work / f"cache-{tag}"), "LORAFLEET_ADMIN_TOKEN": ""}
    worker_args = ["--max-loaded-loras", str(max_loaded), "--max-loras", str(max_loaded)]
    with (work / f"worker-{tag}.log").open("ab") as log_file:
        proc = launch_worker(model, name="base", host=HOST, port=port, system_port=system_port,
                             args=worker_args, env=env, log=log_file)  # fmt: skip
    worker = Worker(proc, f"http://{HOST}:{port}", f"http://{HOST}:{system_port}")
    try:
        wait_ready(proc, worker.system_url)
    except BaseException:
        stop_worker(proc)
        raise
    return worker


def put_catalog(client: httpx.Client, worker: Worker, bucket: str, names: list[str]) -> None:
    catalog = {"adapters": [{"lora_name": n, "source": {"uri": f"s3://{bucket}/{n}"}} for n in names]}
    client.put(f"{worker.system_url}/v1/loras/catalog", json=catalog).raise_for_status()


def run_sweep(client: httpx.Client, worker: Worker, names: list[str], max_tokens: int) -> dict[str, Any]:
    """Cold, warm, then reloaded-after-eviction TTFTs over `names`, and the counters' deltas."""
    ttft(client, worker.url, "base", max_tokens)  # the first request's one-off costs are not a load's
    before = counters(client, worker.url)
    cold: list[float] = []
    warm: list[float] = []
    for name in names:
        cold.append(ttft(client, worker.url, name, max_tokens))
        warm.append(ttft(client, worker.url, name, max_tokens))
    reloaded = [ttft(client, worker.url, name, max_tokens) for name in names]
    after = counters(client, worker.url)
    cold_p50 = percentile(cold, 50) or 0.0
    return {
        "ttft": {"cold": stats(cold), "warm": stats(warm), "reloaded_after_eviction": stats(reloaded)},
        "counters": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(after)},
        "target": {"cold_p50_s_at_most": COLD_P50_TARGET_S, "met": cold_p50 <= COLD_P50_TARGET_S},
        "samples_ms": {"names": names, "cold": ms(cold), "warm": ms(warm), "reloaded": ms(reloaded)},
    }


def run_long_tail(
    client: httpx.Client, workers: dict[str, Worker], hot: list[str], cold: list[str], args: Any
) -> dict[str, Any]:
    """Hot names (loaded first) take `--hot-share` of the requests, the rest each go to a cold name once; each
    request goes to its name's rendezvous worker; `--concurrency` clients."""
    from lorafleet_operator.placement import rank

    def home(name: str) -> Worker:
        return workers[rank(name, workers)[0]]

    for name in hot:
        ttft(client, home(name).url, name, args.max_tokens)
    before = {pod: counters(client, w.url) for pod, w in workers.items()}
    rng = random.Random(7)
    pending = iter(cold)
    plan: list[tuple[str, str]] = []
    for _ in range(args.requests):
        pick = next(pending, None) if rng.random() >= args.hot_share else None
        plan.append(("cold", pick) if pick is not None else ("hot", rng.choice(hot)))
    with ThreadPoolExecutor(args.concurrency) as pool:
        times = list(pool.map(lambda kn: ttft(client, home(kn[1]).url, kn[1], args.max_tokens), plan))
    by_kind = {k: [t for (kind, _), t in zip(plan, times, strict=True) if kind == k] for k in ("hot", "cold")}
    after = {pod: counters(client, w.url) for pod, w in workers.items()}
    return {
        "config": {
            "catalogued": args.catalogued,
            "hot": len(hot),
            "requests": args.requests,
            "hot_share": args.hot_share,
            "concurrency": args.concurrency,
            "workers": len(workers),
            "max_loaded_loras": args.max_loaded_loras,
        },
        "ttft": {k: stats(v) for k, v in by_kind.items()},
        "requests_per_worker": {pod: sum(home(n) is w for _, n in plan) for pod, w in workers.items()},
        "counters": {
            pod: {k: after[pod].get(k, 0.0) - before[pod].get(k, 0.0) for k in sorted(after[pod])} for pod in workers
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=40, help="catalogued names (copies of the trained adapters)")
    ap.add_argument(
        "--max-loaded-loras",
        type=int,
        help="each worker's --max-loaded-loras (default 8, below --adapters; 16 for "
        "--long-tail, room for a worker's share of the hot names)",
    )
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--long-tail", action="store_true", help="the long-tail run instead (merged into the JSON)")
    ap.add_argument("--catalogued", type=int, default=1000, help="long tail: names in each worker's catalogue")
    ap.add_argument("--hot", type=int, default=20, help="long tail: hot names")
    ap.add_argument("--hot-share", type=float, default=0.8, help="long tail: share of requests to hot names")
    ap.add_argument("--requests", type=int, default=200, help="long tail: requests measured")
    ap.add_argument("--concurrency", type=int, default=4, help="long tail: clients")
    ap.add_argument("--workers", type=int, default=2, help="long tail: worker processes")
    args = ap.parse_args()
    args.max_loaded_loras = args.max_loaded_loras or (16 if args.long_tail else 8)
    if not args.long_tail and args.max_loaded_loras >= args.adapters:
        ap.error("--max-loaded-loras must be below --adapters, so that adapters are evicted")

    from lorafleet_devcluster.minio import MinioServer
    from lorafleet_worker_dev.launch import stop_worker

    model = real_model()
    trained = list(trained_adapters(model).values())
    work = Path(tempfile.mkdtemp(prefix="lorafleet-bench-on-demand-"))
    minio = MinioServer(work / "minio").start()
    workers: dict[str, Worker] = {}
    try:
        bucket = minio.make_bucket("bench")
        if args.long_tail:
            names = [f"lt-{i:04d}" for i in range(args.catalogued)]
            hot = names[: args.hot]
            cold = names[args.hot : args.hot + round(args.requests * (1 - args.hot_share)) + 10]
            used = hot + cold  # only names that may be requested need objects in the store
        else:
            names = used = [f"od-{i:04d}" for i in range(args.adapters)]
        log(f"uploading {len(used)} adapters to MinIO")
        for i, name in enumerate(used):
            minio.upload_dir(bucket, name, trained[i % len(trained)])
        pods = [f"w{i}" for i in range(args.workers if args.long_tail else 1)]
        for pod in pods:
            workers[pod] = start_worker(model, minio.env(), work, pod, args.max_loaded_loras)
        with httpx.Client(timeout=300) as client:
            for w in workers.values():
                put_catalog(client, w, bucket, names)
            if args.long_tail:
                result = run_long_tail(client, workers, hot, cold, args)
            else:
                result = run_sweep(client, workers["w0"], names, args.max_tokens)
        result["load_from_worker_log"] = stats(load_times(work))
        log(json.dumps({k: result[k] for k in ("ttft", "counters", "load_from_worker_log")}))
        if args.long_tail:
            payload = read_json("on_demand") or {}
            payload["long_tail"] = {"machine": machine(), **result}
        else:
            config = {"model": model.name, "adapters": args.adapters, "max_loaded_loras": args.max_loaded_loras,
                      "max_tokens": args.max_tokens, "trained": [p.name for p in trained]}  # fmt: skip
            payload = {"machine": machine(), "config": config, **result}
        write_json("on_demand", payload)
    finally:
        for w in workers.values():
            stop_worker(w.proc)
        minio.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
