"""The one loader of the worker's C++ extensions: each library's sources in `csrc/`, its name, and where it
comes from.

An `Extension` names a library's `.cpp` files in `csrc/`; its `name` (the module, JIT cache and prebuilt file
name) ends in a hash of those files, the headers they include and the compiler flags, so a changed byte is a
new library. Where a library comes from, first match wins:

1. Its off switch (`LORAFLEET_CPU_ATTENTION=torch`, `LORAFLEET_CPU_LINEAR=torch`, `LORAFLEET_CPU_LORA=torch`):
   nothing; the torch path.
2. A prebuilt library in `$LORAFLEET_CPU_OPS_DIR`, `<name>-<level>.so`, for the best level this CPU runs
   (x86-64-v4: AVX-512, x86-64-v3: AVX2 + FMA), built by `python -m lorafleet_worker.ops.loader build DIR LEVEL`
   (the worker image's build stage). One that fails to import is skipped, and the reason logged.
3. Compiled at first use by `torch.utils.cpp_extension.load` with -march=native, cached per Python environment
   (`jit_directory`).
4. Neither: None; the reason is logged and the caller keeps its torch path.

Importing this module imports neither torch nor the extension modules.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib
import importlib.util
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# The modules that declare an extension (their `EXTENSION`), imported only by `extensions()`.
EXTENSION_MODULES = (
    "lorafleet_worker.ops.cpu_attention",
    "lorafleet_worker.ops.cpu_gemm",
    "lorafleet_worker.ops.cpu_lora",
)
CSRC = Path(__file__).resolve().parent.parent / "csrc"  # the C++ sources, shipped in the package
LEVELS = ("x86-64-v4", "x86-64-v3")  # prebuilt variants, best first (v4: AVX-512; v3: AVX2 + FMA)
_LEVEL_FLAGS = {
    "x86-64-v3": {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"},
    "x86-64-v4": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
}
OPS_DIR_ENV = "LORAFLEET_CPU_OPS_DIR"
# Every build's flags besides its -march. -fopenmp: without it ATen's headers compile at::parallel_for as a
# plain serial loop (the libgomp it links is torch's own at run time, already loaded by libtorch_cpu).
CFLAGS = ("-O3", "-fopenmp")
LDFLAGS = ("-fopenmp",)
_INCLUDE = re.compile(rb'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def source_files(sources: Iterable[str], directory: Path = CSRC) -> list[Path]:
    """`sources` (files in `directory`) and every header they include with quotes, transitively, sorted."""
    seen: set[Path] = set()
    todo = [directory / s for s in sources]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        todo += [path.parent / m.decode() for m in _INCLUDE.findall(path.read_bytes())]
    return sorted(seen)


def content_hash(sources: Iterable[str], directory: Path = CSRC) -> str:
    """16 hex digits of the SHA-256 of the compiler flags and of every file of `source_files`, named and read."""
    digest = hashlib.sha256(" ".join((*CFLAGS, *LDFLAGS)).encode())
    for path in source_files(sources, directory):
        digest.update(b"\0" + path.relative_to(directory).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one per extension module, cheap as a cache key
class Extension:
    """One C++ library: `stem` (its name's start), its `sources` in `csrc/` (compiled and linked together, one of
    them defining the Python module), `switch` (the environment variable whose value `torch` turns it off), and
    for the log what it is (`what`) and what runs without it (`fallback`)."""

    stem: str
    sources: tuple[str, ...]
    switch: str
    what: str
    fallback: str

    @functools.cached_property
    def name(self) -> str:
        """The module, JIT cache and prebuilt file name: `stem` and the sources' `content_hash`."""
        return f"{self.stem}_{content_hash(self.sources)}"

    def paths(self) -> list[str]:
        """The source files to compile."""
        return [str(CSRC / s) for s in self.sources]


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
    from torch.utils.cpp_extension import load as load_extension

    build_directory = build_directory or jit_directory(ext.name)
    if build_directory is not None:
        Path(build_directory).mkdir(parents=True, exist_ok=True)
    return load_extension(
        name=ext.name,
        sources=ext.paths(),
        extra_cflags=[*CFLAGS, *cflags],
        extra_ldflags=list(LDFLAGS),
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
    whatever its off switch says; None where neither works. For callers that checked `library` once."""
    return _locate(ext, os.environ, cpu_flags())


def library(ext: Extension) -> Any | None:
    """The library of `ext` for this process: None while its off switch says `torch` (read on every call),
    otherwise `built(ext)`."""
    if switched_off(ext):
        _log_off(ext)
        return None
    return built(ext)


@functools.cache  # one look-up per op call; a library that did not build raises (and is not cached)
def module(ext: Extension) -> Any:
    """The built library of `ext`, for op wrappers that checked `available(ext)` first."""
    mod = built(ext)
    assert mod is not None, "check available() first"
    return mod


def available(ext: Extension) -> bool:
    """True when the library of `ext` serves this process: not switched off, and built (or buildable now)."""
    return library(ext) is not None


@functools.cache
def _log_off(ext: Extension) -> None:
    log.info("%s off: %s (%s=torch)", ext.what, ext.fallback, ext.switch)


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

    Torch's loader imports what it builds, and that import may die with SIGILL here, so it runs in a child
    process: the library counts as built when the child succeeded or died of SIGILL after writing it."""
    code = (
        "import sys; from lorafleet_worker.ops import loader as n; "
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
    """`python -m lorafleet_worker.ops.loader build DIR LEVEL`: prints each library's path; 1 if one fails."""
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
    from lorafleet_worker.ops.loader import main as _main

    sys.exit(_main())


__all__ = [
    "CSRC",
    "EXTENSION_MODULES",
    "LEVELS",
    "OPS_DIR_ENV",
    "Extension",
    "build_prebuilt",
    "built",
    "content_hash",
    "cpu_flags",
    "cpu_levels",
    "extensions",
    "library",
    "load",
    "main",
    "prebuilt_path",
    "source_files",
    "switched_off",
]
