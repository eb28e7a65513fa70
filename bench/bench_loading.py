"""Adapter loading latency, p50/p99, for ranks 8 and 64 on the benchmark model:

  cold  download from MinIO (s3://) into an empty disk cache + validate + CPU tier
  warm  disk-cache hit + validate + CPU tier (the adapter had been unloaded)
  hot   CPU tier -> a GPU slot (`AdapterManager.activate`; on CPU the "slot" is the pool buffer)

Uses a real MinIO (built by `make setup`), the worker's `AdapterSources` and `AdapterManager`.

    python bench/bench_loading.py [--repeats 10]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
from common import bench_adapter, bench_model, log, machine, percentile, write_json  # noqa: E402


def stats(samples: list[float]) -> dict[str, Any]:
    return {
        "n": len(samples),
        "p50_ms": round(1000 * (percentile(samples, 50) or 0), 2),
        "p99_ms": round(1000 * (percentile(samples, 99) or 0), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()

    import torch
    from lorafleet_devcluster.minio import MinioServer
    from lorafleet_sync.sources import AdapterSources
    from lorafleet_worker.config import ModelConfig
    from lorafleet_worker.lora.manager import AdapterManager

    model = bench_model()
    config = ModelConfig.from_dir(model)
    work = Path(tempfile.mkdtemp(prefix="lorafleet-bench-load-"))
    minio = MinioServer(work / "minio").start()
    try:
        import os

        os.environ.update(minio.env())
        bucket = minio.make_bucket("bench")
        results: dict[str, Any] = {}
        for rank in (8, 64):
            adapter = bench_adapter(model, 500 + rank, rank)
            minio.upload_dir(bucket, f"r{rank}", adapter)
            uri = f"s3://{bucket}/r{rank}"
            manager = AdapterManager(
                config, max_loras=2, max_cpu_loras=4, max_lora_rank=64, device="cpu", dtype=torch.float32
            )
            cold: list[float] = []
            warm: list[float] = []
            hot: list[float] = []
            for i in range(args.repeats):
                cache = work / f"cache-{rank}-{i}"
                sources = AdapterSources(cache_dir=cache, file_roots=[])
                t0 = time.perf_counter()
                path = asyncio.run(sources.fetch(uri))
                manager.load("x", path)
                cold.append(time.perf_counter() - t0)
                manager.remove("x")
                t0 = time.perf_counter()
                path = asyncio.run(sources.fetch(uri))
                manager.load("x", path)
                warm.append(time.perf_counter() - t0)
                # hot: evict "x" from its slot by filling both slots with other versions, then activate
                for other in ("y", "z"):
                    if other not in manager.names():
                        manager.load(other, path)
                    ref = manager.acquire(other)
                    manager.activate(ref)
                    manager.release(ref)
                ref = manager.acquire("x")
                t0 = time.perf_counter()
                slot = manager.activate(ref)
                hot.append(time.perf_counter() - t0)
                assert slot is not None
                manager.release(ref)
                manager.remove("x")
                shutil.rmtree(cache, ignore_errors=True)
            results[f"rank{rank}"] = {"cold_s3": stats(cold), "warm_disk": stats(warm), "hot_cpu_to_slot": stats(hot)}
            log(f"rank {rank}: {results[f'rank{rank}']}")
        write_json("loading", {"machine": machine(), "results": results})
    finally:
        minio.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
