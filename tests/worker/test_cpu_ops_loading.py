"""Where the CPU C++ ops come from (`cpu_attention.load_module`): off, prebuilt, JIT, or the torch path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from lorafleet_worker.model import cpu_attention

V3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


def test_cpu_flags_and_levels() -> None:
    info = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2\nbugs\t\t: none\n"
    assert cpu_attention.cpu_flags(info) == {"fpu", "sse2", "avx", "avx2"}
    assert cpu_attention.cpu_flags("no flags here") == set()
    assert cpu_attention.cpu_levels(V4) == ["x86-64-v4", "x86-64-v3"]
    assert cpu_attention.cpu_levels(V3) == ["x86-64-v3"]
    assert cpu_attention.cpu_levels(V4 - {"fma"}) == []  # v4 needs v3
    assert cpu_attention.cpu_levels(set()) == []


def test_prebuilt_path_picks_the_best_level_present(tmp_path: Path) -> None:
    name = cpu_attention.EXT_NAME
    assert cpu_attention.prebuilt_path(tmp_path, V4) is None
    (tmp_path / f"{name}-x86-64-v3.so").write_bytes(b"")
    assert cpu_attention.prebuilt_path(tmp_path, V4) == tmp_path / f"{name}-x86-64-v3.so"
    (tmp_path / f"{name}-x86-64-v4.so").write_bytes(b"")
    assert cpu_attention.prebuilt_path(tmp_path, V4) == tmp_path / f"{name}-x86-64-v4.so"
    assert cpu_attention.prebuilt_path(tmp_path, V3) == tmp_path / f"{name}-x86-64-v3.so"
    assert cpu_attention.prebuilt_path(tmp_path, set()) is None  # an old CPU runs neither
    assert cpu_attention.prebuilt_path(None, V4) is None
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "lorafleet_cpu_ops_v1-x86-64-v4.so").write_bytes(b"")  # another version's name
    assert cpu_attention.prebuilt_path(tmp_path / "old", V4) is None


class Calls:
    def __init__(self, monkeypatch: pytest.MonkeyPatch, prebuilt: Any = "mod-prebuilt", jit: Any = "mod-jit") -> None:
        self.seen: list[str] = []

        def fake(kind: str, result: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                self.seen.append(kind)
                if isinstance(result, Exception):
                    raise result
                return result

            return call

        monkeypatch.setattr(cpu_attention, "_import_prebuilt", fake("prebuilt", prebuilt))
        monkeypatch.setattr(cpu_attention, "_jit", fake("jit", jit))


def test_selection_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / f"{cpu_attention.EXT_NAME}-x86-64-v4.so").write_bytes(b"")
    env = {"LORAFLEET_CPU_OPS_DIR": str(tmp_path)}
    calls = Calls(monkeypatch)
    assert cpu_attention.load_module(env, V4) == "mod-prebuilt" and calls.seen == ["prebuilt"]
    calls.seen.clear()
    assert cpu_attention.load_module(env, V3) == "mod-jit" and calls.seen == ["jit"]  # no v3 build present
    calls.seen.clear()
    assert cpu_attention.load_module({}, V4) == "mod-jit" and calls.seen == ["jit"]  # no directory set
    calls.seen.clear()
    assert cpu_attention.load_module({**env, "LORAFLEET_CPU_ATTENTION": "torch"}, V4) is None and calls.seen == []


def test_fallbacks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / f"{cpu_attention.EXT_NAME}-x86-64-v4.so").write_bytes(b"")
    env = {"LORAFLEET_CPU_OPS_DIR": str(tmp_path)}
    calls = Calls(monkeypatch, prebuilt=ImportError("undefined symbol"))
    assert cpu_attention.load_module(env, V4) == "mod-jit" and calls.seen == ["prebuilt", "jit"]
    calls = Calls(monkeypatch, prebuilt=ImportError("undefined symbol"), jit=RuntimeError("no g++"))
    assert cpu_attention.load_module(env, V4) is None and calls.seen == ["prebuilt", "jit"]  # the torch path


def test_cli_usage() -> None:
    with pytest.raises(SystemExit):
        cpu_attention.main(["build", "/tmp/x", "x86-64-v9"])


@pytest.mark.skipif(not cpu_attention.available(), reason="no C++ toolchain here to build the library")
def test_a_prebuilt_library_builds_loads_and_agrees(tmp_path: Path) -> None:
    """The image's path end to end: build the portable (x86-64-v3) library, load it as the worker would
    (in a fresh process, LORAFLEET_CPU_OPS_DIR set), and compare its decode attention with the torch path."""
    import os
    import subprocess
    import sys

    if "x86-64-v3" not in cpu_attention.cpu_levels(cpu_attention.cpu_flags()):
        pytest.skip("this CPU does not run x86-64-v3")
    script = (
        "import logging, sys, torch\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from lorafleet_worker.model import cpu_attention as c\n"
        "from lorafleet_worker.model.attention import _torch_decode\n"
        "from tests.worker.test_cpu_attention import decode_batch\n"
        "assert c.available()\n"
        "torch.manual_seed(0)\n"
        "kc, vc = torch.randn(6, 4, 2, 16), torch.randn(6, 4, 2, 16)\n"
        "tables = torch.tensor([[1, 2, 3], [4, 5, 0]], dtype=torch.int32)\n"
        "batch = decode_batch([11, 6], tables, 4, None)\n"
        "q = torch.randn(2, 4, 16)\n"
        "ours = c.paged_decode(q, kc, vc, tables, batch.decode_seq_lens, 0.25, None)\n"
        "assert (ours - _torch_decode(q, kc, vc, batch, 0.25)).abs().max().item() < 1e-5\n"
    )
    built = subprocess.run(
        [sys.executable, "-m", "lorafleet_worker.model.cpu_attention", "build", str(tmp_path / "lib"), "x86-64-v3"],
        capture_output=True, text=True, env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")},
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-2000:]
    env = {**os.environ, "LORAFLEET_CPU_OPS_DIR": str(tmp_path / "lib"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "no")}
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=root)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "CPU C++ ops: prebuilt" in run.stderr and "x86-64-v3.so" in run.stderr
    assert not (tmp_path / "no").exists()  # nothing was compiled at load
