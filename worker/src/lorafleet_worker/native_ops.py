"""Build and load the worker's C++ extensions (the CPU ops of `model/cpu_attention.py`, the base linears of
`model/cpu_gemm.py`, the grouped LoRA kernel of `lora/cpu_lora.py`).

Each extension module describes its library with an `Extension` (name, C++ source, functions, off switch)
as its `EXTENSION`; `EXTENSION_MODULES` lists those modules. Where a library comes from, first match wins:

1. Its off switch (`LORAFLEET_CPU_ATTENTION=torch`, `LORAFLEET_CPU_LORA=torch`): nothing; the torch path.
2. A prebuilt library in `$LORAFLEET_CPU_OPS_DIR`, `<name>-<level>.so`, for the best level this CPU runs
   (`prebuilt_path`; x86-64-v4: AVX-512, x86-64-v3: AVX2 + FMA). The worker image builds every extension
   for both levels in its build stage: `python -m lorafleet_worker.native_ops build DIR LEVEL`. One that
   fails to import (built against another torch, unreadable) is skipped, and the reason logged.
3. Compiled at first use with `torch.utils.cpp_extension.load_inline` (g++ and ninja, -march=native, about
   30 s once; cached under `$TORCH_EXTENSIONS_DIR` where set, otherwise in a directory of this Python
   environment's own under `~/.cache/torch_extensions`: `jit_directory`).
4. Neither: None; the reason is logged and the caller keeps its torch path.

torch.utils.cpp_extension is imported only to compile, and the extension modules only when the command
line builds them (they import this one).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib
import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# The modules that declare an extension (their `EXTENSION`), imported only by `extensions()`.
EXTENSION_MODULES = (
    "lorafleet_worker.model.cpu_attention",
    "lorafleet_worker.model.cpu_gemm",
    "lorafleet_worker.lora.cpu_lora",
)
LEVELS = ("x86-64-v4", "x86-64-v3")  # prebuilt variants, best first (v4: AVX-512; v3: AVX2 + FMA)
_LEVEL_FLAGS = {
    "x86-64-v3": {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"},
    "x86-64-v4": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
}
OPS_DIR_ENV = "LORAFLEET_CPU_OPS_DIR"


# C++ shared by the extensions' sources (each pastes it after its includes, which bring at::BFloat16): eight
# float32 lanes of float or bfloat16 under AVX2 + FMA, loaded, summed across, and stored (bfloat16 rounded to
# nearest even, a NaN kept a quiet NaN, as c10::BFloat16 rounds).
SIMD8 = r"""
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const at::BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
static inline float reduce8(__m256 a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}
static inline __m256i bf16_bits8(__m256 f) {  // round to nearest even; the 16 bits in each lane's low half
  const __m256i b = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
}
static inline void store8(float* p, __m256 f) { _mm256_storeu_ps(p, f); }
static inline void store8(at::BFloat16* p, __m256 f) {
  const __m256i b = bf16_bits8(f);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}
#endif
"""


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one per extension module, cheap as a cache key
class Extension:
    """One C++ extension: `name` (the module, JIT cache and prebuilt file name; bump it with any change to
    `source`), the C++ `source`, the `functions` it exports, `switch` (the environment variable whose value
    `torch` turns it off), and for the log what it is (`what`) and what runs without it (`fallback`)."""

    name: str
    source: str
    functions: tuple[str, ...]
    switch: str
    what: str
    fallback: str


def extensions() -> list[Extension]:
    """Every extension of the worker (imports `EXTENSION_MODULES`, and so torch)."""
    return [importlib.import_module(name).EXTENSION for name in EXTENSION_MODULES]


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo); empty where they cannot be read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def cpu_levels(flags: set[str]) -> list[str]:
    """The prebuilt levels this CPU can run, best first."""
    v3 = _LEVEL_FLAGS["x86-64-v3"] <= flags
    v4 = v3 and _LEVEL_FLAGS["x86-64-v4"] <= flags
    return [level for level, ok in zip(LEVELS, (v4, v3), strict=True) if ok]


def prebuilt_path(ext: Extension, directory: str | os.PathLike[str] | None, flags: set[str]) -> Path | None:
    """The prebuilt library of `ext` in `directory` for the best level these CPU flags run, or None."""
    if not directory:
        return None
    for level in cpu_levels(flags):
        path = Path(directory) / f"{ext.name}-{level}.so"
        if path.is_file():
            return path
    return None


def _import_prebuilt(ext: Extension, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(ext.name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def jit_directory(name: str, env: Mapping[str, str] | None = None, prefix: str | None = None) -> str | None:
    """Where a JIT build of `name` goes: torch's own choice (None) where `$TORCH_EXTENSIONS_DIR` is set;
    otherwise a directory of this Python environment's own (`prefix`, by default `sys.prefix`) under torch's
    cache root. Two checkouts (two venvs) that shared torch's default directory rebuilt each other's
    library at every start: each build command names its venv's torch headers, so ninja saw a new command."""
    from torch.utils.cpp_extension import get_default_build_root

    if (os.environ if env is None else env).get("TORCH_EXTENSIONS_DIR"):
        return None
    tag = hashlib.sha256((sys.prefix if prefix is None else prefix).encode()).hexdigest()[:10]
    return str(Path(get_default_build_root()) / f"lorafleet-{tag}" / name)


def _jit(ext: Extension, cflags: list[str], build_directory: str | None = None) -> Any:
    from torch.utils.cpp_extension import load_inline

    build_directory = build_directory or jit_directory(ext.name)
    if build_directory is not None:
        Path(build_directory).mkdir(parents=True, exist_ok=True)
    return load_inline(
        name=ext.name,
        cpp_sources=[ext.source],
        functions=list(ext.functions),
        # -fopenmp: without it ATen's headers compile at::parallel_for as a plain serial loop. The
        # libgomp it links is torch's own at run time (same soname, already loaded by libtorch_cpu).
        extra_cflags=["-O3", *cflags, "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=build_directory,
        verbose=False,
    )


def switched_off(ext: Extension, env: Mapping[str, str] | None = None) -> bool:
    """True where `ext`'s off switch is `torch` (in `env`, by default the process environment)."""
    return (os.environ if env is None else env).get(ext.switch, "").lower() == "torch"


def load(ext: Extension, env: Mapping[str, str] | None = None, flags: set[str] | None = None) -> Any | None:
    """The library of `ext`: off, prebuilt, JIT-compiled, or None (the torch path); see the module docstring.
    `env` and `flags` default to this process's environment and CPU. Not cached: each call looks again."""
    env = os.environ if env is None else env
    if switched_off(ext, env):
        log.info("%s off: %s (%s=torch)", ext.what, ext.fallback, ext.switch)
        return None
    return _locate(ext, env, cpu_flags() if flags is None else flags)


@functools.cache
def built(ext: Extension) -> Any | None:
    """The library of `ext` for this process, prebuilt or JIT-compiled at the first call (then cached),
    whatever its off switch says; None where neither works."""
    return _locate(ext, os.environ, cpu_flags())


def _locate(ext: Extension, env: Mapping[str, str], flags: set[str]) -> Any | None:
    path = prebuilt_path(ext, env.get(OPS_DIR_ENV), flags)
    if path is not None:
        try:
            mod = _import_prebuilt(ext, path)
            log.info("%s: prebuilt %s", ext.what, path)
            return mod
        except Exception as exc:  # built against another torch, or unreadable: try the JIT build
            log.warning("%s: prebuilt %s not loaded (%s); compiling it", ext.what, path, exc)
    try:
        mod = _jit(ext, ["-march=native"])
    except Exception as exc:  # no compiler, no ninja, a read-only cache: the torch path still works
        log.warning("%s not built (%s); %s", ext.what, exc, ext.fallback)
        return None
    log.info("%s: JIT build %s (-march=native)", ext.what, getattr(mod, "__file__", ext.name))
    return mod


def _compile_only(ext: Extension, level: str, build_directory: str) -> None:
    """Compile `ext` for a `level` this CPU cannot run (an AVX2 build host making the AVX-512 library).

    `load_inline` imports what it builds, and that import may die with SIGILL here, so it runs in a child
    process: the library counts as built when the child succeeded or died of SIGILL after writing it."""
    code = (
        "import sys; from lorafleet_worker import native_ops as n; "
        "n._jit(next(e for e in n.extensions() if e.name == sys.argv[1]), ['-march=' + sys.argv[2]], sys.argv[3])"
    )
    child = subprocess.run(
        [sys.executable, "-c", code, ext.name, level, build_directory], capture_output=True, text=True, check=False
    )
    built_ok = child.returncode in (0, -signal.SIGILL) and (Path(build_directory) / f"{ext.name}.so").exists()
    if not built_ok:
        raise RuntimeError(f"compiling for {level} failed (exit {child.returncode}): {child.stderr[-2000:]}")


def build_prebuilt(ext: Extension, directory: str | os.PathLike[str], level: str) -> Path:
    """Compile `ext` for `level` (one of LEVELS) into `directory` as `<name>-<level>.so`."""
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r} (one of {', '.join(LEVELS)})")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if level in cpu_levels(cpu_flags()):
            _jit(ext, [f"-march={level}"], build_directory=tmp)
        else:
            _compile_only(ext, level, tmp)
        target = out / f"{ext.name}-{level}.so"
        shutil.copy(Path(tmp) / f"{ext.name}.so", target)
    return target


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__name__}",
        description="Build the worker's C++ extensions ahead of time (the worker image's build stage).",
        epilog=f"Extensions: the EXTENSION of {', '.join(EXTENSION_MODULES)}. At run time the worker loads "
        f"the best level its CPU runs from ${OPS_DIR_ENV}.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    build = commands.add_parser(
        "build",
        help="compile every extension for one x86-64 level into DIR as <name>-<level>.so",
        description="Compile every extension for LEVEL into DIR as <name>-<level>.so (g++, ninja, torch headers).",
    )
    build.add_argument("directory", metavar="DIR", help="where the libraries go (created if missing)")
    build.add_argument("level", metavar="LEVEL", choices=LEVELS, help=f"one of {', '.join(LEVELS)}")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m lorafleet_worker.native_ops build DIR LEVEL`: prints each library's path; 1 if one fails."""
    args = _parser().parse_args(argv)
    for ext in extensions():
        try:
            print(build_prebuilt(ext, args.directory, args.level), flush=True)
        except Exception as exc:
            print(f"{ext.name} ({ext.what}) not built for {args.level}: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    # Run as the package's module, not as __main__: the extension modules import that one.
    from lorafleet_worker.native_ops import main as _main

    sys.exit(_main())


__all__ = [
    "EXTENSION_MODULES",
    "LEVELS",
    "OPS_DIR_ENV",
    "Extension",
    "build_prebuilt",
    "built",
    "cpu_flags",
    "cpu_levels",
    "extensions",
    "load",
    "main",
    "prebuilt_path",
    "switched_off",
]
