"""One OpenMP thread team per worker process: the engine thread's.

torch on CPU runs its parallel ops (oneDNN / MKL GEMMs, ATen kernels, the C++ ops of `cpu_attention` and
`cpu_lora`) on OpenMP, and libgomp gives every OS thread that starts a parallel region a pool of its own
(threads - 1 workers), kept until that thread exits. Between regions the workers spin for a while, then
sleep on a futex, but libgomp cuts the spin to almost nothing as soon as it manages more threads than the
process has CPUs (`gomp_throttled_spin_count_var`). With a second pool alive (the thread that loaded the
model, an executor thread that parsed an adapter) every parallel region of the engine thread paid a futex
wake-up, which made small ops (a decode step's norms and GEMMs) several times slower.

The discipline, kept by `Engine`:
- the team is sized to the CPUs the process may use (`size_team`): OMP_NUM_THREADS when set, else the
  smaller of the CPUs in its affinity mask and its cgroup CPU limit, rounded up (torch's default is every
  core of the node, so a pod limited to 4 CPUs on a 64-core node ran 64 threads on 4 CPUs' worth of time:
  every barrier waits for a descheduled thread);
- the engine's setup (model load, weight packing, KV cache and LoRA pool allocation) runs in a thread that
  ends with it (`run_in_fresh_thread`): its pool ends too;
- threads that run torch beside the step loop (adapter parsing, the CPU-tier read-back) are `serial_here`:
  their OpenMP team size is 1, so they start no pool (their torch ops run on the calling thread);
- the step loop's thread is the one that keeps a full team.

A caller that runs parallel torch work on its own long-lived thread (a test, a notebook's main thread)
still costs the engine this throttling; `native_threads()` counts the OS threads Python did not start
(the pools' workers among them).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import torch

log = logging.getLogger(__name__)

T = TypeVar("T")
P = ParamSpec("P")
_OMP_LIBS = ("libgomp", "libiomp5", "libomp")


@functools.cache
def _omp() -> Any | None:
    """The OpenMP runtime torch loaded (found in /proc/self/maps), or None (not OpenMP, not Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith(_OMP_LIBS) and ".so" in path:
            try:
                lib = ctypes.CDLL(path)
                lib.omp_set_num_threads.argtypes = [ctypes.c_int]
                return lib
            except (OSError, AttributeError):
                continue
    log.debug("no OpenMP runtime loaded: torch threads need no discipline")
    return None


def serial_here() -> None:
    """Make torch's parallel ops on the calling thread run on that thread alone (OpenMP team size 1).

    torch first sets the thread's team size (`torch.get_num_threads()` makes it do so now), then this
    overrides it for this thread only; `torch.set_num_threads` would change every thread's."""
    torch.get_num_threads()
    lib = _omp()
    if lib is not None:
        lib.omp_set_num_threads(1)


def serial(fn: Callable[..., T]) -> Callable[..., T]:
    """`fn` run as `serial_here(); fn(...)`: for a thread's target."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> T:
        serial_here()
        return fn(*args, **kwargs)

    return run


def run_in_fresh_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) on a new thread that ends when it returns (taking its OpenMP pool with it)."""
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn(*args, **kwargs))
        except BaseException as exc:  # re-raised on the caller's thread
            error.append(exc)

    name = f"lorafleet-setup-{getattr(fn, '__name__', 'fn')}"
    thread = threading.Thread(target=target, name=name, daemon=True)  # Ctrl-C during a load exits at once
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup") -> float | None:
    """The cgroup's CPU limit in CPUs (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`);
    None when there is none or it cannot be read."""
    base = Path(root)
    try:
        quota, _, period = (base / "cpu.max").read_text().partition(" ")
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((base / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((base / "cpu" / "cpu.cfs_period_us").read_text())
        return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    except (OSError, ValueError):
        return None


def team_size(env: Any = os.environ, cgroup_root: str = "/sys/fs/cgroup") -> tuple[int, str]:
    """(threads, why) for torch's CPU thread team; see the module docstring."""
    if env.get("OMP_NUM_THREADS", "").strip().isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
        return int(env["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    limit = cgroup_cpu_limit(cgroup_root)
    if limit is not None and math.ceil(limit) < cpus:
        return max(1, math.ceil(limit)), f"the cgroup's CPU limit ({limit:g} CPUs; {cpus} in the affinity mask)"
    return cpus, f"the {cpus} CPUs of the affinity mask" + ("" if limit is None else f" (cgroup limit {limit:g})")


def size_team() -> int:
    """Set torch's thread count to `team_size()` (before the first parallel op of the engine); returns it."""
    n, why = team_size()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    log.info("torch CPU threads: %d (%s)", n, why)
    return n


def on_fresh_thread(fn: Callable[P, T]) -> Callable[P, T]:
    """`fn` that always runs through `run_in_fresh_thread` (a decorator, for a setup such as `Engine.__init__`;
    the undecorated function stays `fn.__wrapped__`)."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        return run_in_fresh_thread(fn, *args, **kwargs)

    return run


def native_threads() -> int:
    """OS threads of this process that Python did not start (OpenMP workers and the like); -1 if unknown."""
    try:
        return len(os.listdir("/proc/self/task")) - threading.active_count()
    except OSError:
        return -1


__all__ = [
    "cgroup_cpu_limit",
    "native_threads",
    "on_fresh_thread",
    "run_in_fresh_thread",
    "serial",
    "serial_here",
    "size_team",
    "team_size",
]
