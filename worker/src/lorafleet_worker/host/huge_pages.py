"""Transparent huge pages (2 MB) for the worker's big tensors: weights, KV cache, LoRA slots.

A decode step of one sequence reads every weight once, so it runs at the memory's read speed, and on 4 KB
pages that speed depends on where the kernel put them (from one server start to the next); on 2 MB pages it
does not.

PyTorch's CPU allocator gives every allocation of 2 MB or more `madvise(MADV_HUGEPAGE)` when
`THP_MEM_ALLOC_ENABLE=1` is set at its first allocation, so the worker's entry point (`cli.main`) sets
it before torch is imported (`request`); a value already set wins (`THP_MEM_ALLOC_ENABLE=0` keeps 4 KB
pages). The node's own mode decides the rest (`kernel_mode`): `madvise` (most distributions) and
`always` serve the request, `never` does not, which the startup log says (`describe`).
"""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping
from pathlib import Path

ENV = "THP_MEM_ALLOC_ENABLE"
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def request(environ: MutableMapping[str, str] = os.environ) -> None:
    """Ask PyTorch for huge pages unless the environment already says (call before torch allocates)."""
    environ.setdefault(ENV, "1")


def kernel_mode(path: Path = THP_MODE) -> str | None:
    """The kernel's THP mode (`always`, `madvise` or `never`: the bracketed word), None where unreadable."""
    try:
        match = re.search(r"\[(\w+)\]", path.read_text())
    except OSError:
        return None
    return match.group(1) if match else None


def huge_bytes(smaps_rollup: Path = Path("/proc/self/smaps_rollup")) -> int | None:
    """Bytes of this process's anonymous memory on huge pages (`AnonHugePages`), None where unreadable."""
    try:
        text = smaps_rollup.read_text()
    except OSError:
        return None
    match = re.search(r"^AnonHugePages:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def describe(environ: MutableMapping[str, str] = os.environ, mode: str | None = None, held: int | None = None) -> str:
    """One log line: whether the big tensors are on huge pages, and why not where they are not."""
    if environ.get(ENV, "0").strip() != "1":
        return f"huge pages: off ({ENV}={environ.get(ENV, '')!r}); decode reads weights through 4 KB pages"
    if mode == "never":
        return f"huge pages: off (the node's THP mode is 'never', {THP_MODE}); decode steps may run up to 1.4x slower"
    held_text = "unknown" if held is None else f"{held / 2**20:.0f} MiB"
    return f"huge pages: on (THP mode {mode or 'unknown'}), {held_text} of the process on 2 MB pages"
