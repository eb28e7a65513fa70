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

    python bench/bench_on_demand.py [--adapters 40] [--max-loaded-loras 8]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
from common import log, machine, percentile, real_model, trained_adapters, write_json  # noqa: E402

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=40, help="catalogued names (copies of the trained adapters)")
    ap.add_argument("--max-loaded-loras", type=int, default=8, help="the worker's --max-loaded-loras (< --adapters)")
    ap.add_argument("--max-tokens", type=int, default=4)
    args = ap.parse_args()
    if args.max_loaded_loras >= args.adapters:
        ap.error("--max-loaded-loras must be below --adapters, so that adapters are evicted")

    from lorafleet_devcluster.minio import MinioServer
    from lorafleet_worker_dev.launch import free_port, launch_worker, stop_worker, wait_ready

    model = real_model()
    trained = list(trained_adapters(model).values())
    work = Path(tempfile.mkdtemp(prefix="lorafleet-bench-on-demand-"))
    minio = MinioServer(work / "minio").start()
    proc = None
    try:
        bucket = minio.make_bucket("bench")
        names = [f"od-{i:04d}" for i in range(args.adapters)]
        log(f"uploading {len(names)} adapters to MinIO")
        for i, name in enumerate(names):
            minio.upload_dir(bucket, name, trained[i % len(trained)])

        port, system_port = free_port(HOST), free_port(HOST)
        env = {**minio.env(), "DYN_LORA_PATH": str(work / "cache"), "LORAFLEET_ADMIN_TOKEN": ""}
        worker_args = ["--max-loaded-loras", str(args.max_loaded_loras), "--max-loras", str(args.max_loaded_loras)]
        with (work / "worker.log").open("ab") as log_file:
            proc = launch_worker(model, name="base", host=HOST, port=port, system_port=system_port,
                                 args=worker_args, env=env, log=log_file)  # fmt: skip
        url, system_url = f"http://{HOST}:{port}", f"http://{HOST}:{system_port}"
        wait_ready(proc, system_url)
        with httpx.Client(timeout=300) as client:
            catalog = {"adapters": [{"lora_name": n, "source": {"uri": f"s3://{bucket}/{n}"}} for n in names]}
            r = client.put(f"{system_url}/v1/loras/catalog", json=catalog)
            r.raise_for_status()
            ttft(client, url, "base", args.max_tokens)  # the first request's one-off costs are not a load's
            before = counters(client, url)
            cold: list[float] = []
            warm: list[float] = []
            for name in names:
                cold.append(ttft(client, url, name, args.max_tokens))
                warm.append(ttft(client, url, name, args.max_tokens))
            reloaded = [ttft(client, url, name, args.max_tokens) for name in names]
            after = counters(client, url)
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(after)}
        results = {"cold": stats(cold), "warm": stats(warm), "reloaded_after_eviction": stats(reloaded)}
        cold_p50 = percentile(cold, 50) or 0.0
        payload = {
            "machine": machine(),
            "config": {
                "model": model.name,
                "adapters": args.adapters,
                "max_loaded_loras": args.max_loaded_loras,
                "max_tokens": args.max_tokens,
                "trained": [p.name for p in trained],
            },
            "ttft": results,
            "counters": delta,
            "samples_ms": {"names": names, "cold": ms(cold), "warm": ms(warm), "reloaded": ms(reloaded)},
            "target": {"cold_p50_s_at_most": COLD_P50_TARGET_S, "met": cold_p50 <= COLD_P50_TARGET_S},
        }
        log(json.dumps({"ttft": results, "counters": delta}))
        write_json("on_demand", payload)
    finally:
        if proc is not None:
            stop_worker(proc)
        minio.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
