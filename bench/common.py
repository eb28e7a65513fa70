"""Helpers shared by the benchmarks: the cached bench model/adapters, percentiles, JSON output."""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from lorafleet_worker.host import huge_pages

CACHE = Path(os.environ.get("LORAFLEET_CACHE", Path.home() / ".cache" / "lorafleet")) / "bench"
OUT_DIR = Path(__file__).resolve().parent
if str(OUT_DIR.parent) not in sys.path:  # the repository root: `demo` prepares the real model and adapters
    sys.path.append(str(OUT_DIR.parent))

# In-process engines run on 2 MB pages as the worker does (its entry point asks the same, `huge_pages.py`);
# PyTorch reads the switch at its first allocation, so this module is imported before torch allocates.
huge_pages.request()

# ~97M parameters, Llama family, fp32: big enough that compute dominates on a CPU.
BENCH_MODEL = dict(hidden_size=768, num_layers=14, num_heads=12, num_kv_heads=4, intermediate_size=2304, vocab_size=512)
# LORAFLEET_BENCH_SMOKE=1: a ~1M-parameter model, to check that the scripts run end to end in seconds.
SMOKE = os.environ.get("LORAFLEET_BENCH_SMOKE", "") not in ("", "0")
SMOKE_MODEL = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256, vocab_size=512)
MIXED_RANKS = (8, 16, 32, 64)


def log(msg: str) -> None:
    """Progress on stderr (a child's stdout carries its JSON result)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def bench_model(name: str | None = None, **overrides: Any) -> Path:
    """The benchmark base model (the smoke model under LORAFLEET_BENCH_SMOKE), generated once and cached."""
    from lorafleet_worker_dev.tiny import make_tiny_model

    name = name or ("llama-smoke" if SMOKE else "llama-100m")
    out = CACHE / name
    if not (out / "config.json").exists():
        log(f"generating the benchmark model {name} in {out}")
        shutil.rmtree(out.with_suffix(".tmp"), ignore_errors=True)
        make_tiny_model(out.with_suffix(".tmp"), "llama", **{**(SMOKE_MODEL if SMOKE else BENCH_MODEL), **overrides})
        out.with_suffix(".tmp").rename(out)
    return out


def bench_adapter(base: Path, index: int, rank: int, targets: tuple[str, ...] | None = None) -> Path:
    """Random adapter `index` of rank `rank` for `base` (all seven projections unless `targets`), cached."""
    from lorafleet_worker_dev.tiny import ALL_TARGETS, make_tiny_adapter

    suffix = "" if targets is None else "-" + "-".join(t.removesuffix("_proj") for t in targets)
    out = CACHE / f"{base.name}-adapters" / f"a{index:03d}-r{rank}{suffix}"
    if not (out / "adapter_config.json").exists():
        tmp = out.with_suffix(".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        make_tiny_adapter(tmp, base, rank=rank, seed=1000 + index, strength=0.3, targets=targets or ALL_TARGETS)
        tmp.rename(out)
    return out


def real_model() -> Path:
    """SmolLM2-135M-Instruct converted by `make setup` (demo.real_model); the smoke model under SMOKE."""
    if SMOKE:
        return bench_model("llama-smoke-real", vocab_size=1024)
    from demo.real_model import prepare_model

    return prepare_model()


def trained_adapters(base: Path) -> dict[str, Path]:
    """The demo's four answer-style adapters (demo.train_adapters; not the tools adapter); under SMOKE, random
    ones of the same shapes."""
    from demo.adapter_data import STYLES
    from demo.train_adapters import RECIPES, trained_adapters

    if SMOKE:
        return {s: bench_adapter(base, i, RECIPES[s].rank, RECIPES[s].targets) for i, s in enumerate(STYLES)}
    adapters = trained_adapters()
    return {s: adapters[s] for s in STYLES}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def machine() -> dict[str, Any]:
    import torch

    return {
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "smoke": SMOKE,
    }


def results_dir() -> Path:
    """Where results go: bench/ (bench/smoke/ under LORAFLEET_BENCH_SMOKE)."""
    return OUT_DIR / "smoke" if SMOKE else OUT_DIR


def read_json(name: str) -> dict[str, Any] | None:
    """bench/<name>.json (see `results_dir`), or None if it was not written."""
    path = results_dir() / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def write_json(name: str, payload: dict[str, Any]) -> Path:
    """Write bench/<name>.json (see `results_dir`)."""
    path = results_dir() / f"{name}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    log(f"wrote {path}")
    return path
