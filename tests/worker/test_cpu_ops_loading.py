"""Where the worker's C++ extensions come from (`ops/loader.py`): off, prebuilt, JIT, or the torch path, for
each: the CPU ops (`ops/cpu_attention.py`), the panel GEMM (`ops/cpu_gemm.py`) and the grouped LoRA kernel
(`ops/cpu_lora.py`); and the name each library carries, derived from its sources."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
from lorafleet_worker.ops import cpu_attention, cpu_gemm, cpu_lora, loader

V3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
EXTENSIONS = [
    pytest.param(cpu_attention.EXTENSION, id="cpu_ops"),
    pytest.param(cpu_gemm.EXTENSION, id="cpu_gemm"),
    pytest.param(cpu_lora.EXTENSION, id="cpu_lora"),
]
NAMES = [cpu_attention.EXTENSION.name, cpu_gemm.EXTENSION.name, cpu_lora.EXTENSION.name]


def test_every_extension_is_registered() -> None:
    exts = loader.extensions()
    assert exts == [cpu_attention.EXTENSION, cpu_gemm.EXTENSION, cpu_lora.EXTENSION]
    assert [e.name for e in exts] == NAMES
    assert [e.switch for e in exts] == ["LORAFLEET_CPU_ATTENTION", "LORAFLEET_CPU_LINEAR", "LORAFLEET_CPU_LORA"]
    assert len({e.name for e in exts}) == 3  # one prebuilt file each in LORAFLEET_CPU_OPS_DIR


def test_importing_the_loader_imports_neither_torch_nor_an_extension_module() -> None:
    import subprocess
    import sys

    script = (
        "import sys\n"
        "import lorafleet_worker.ops.loader\n"
        "bad = [m for m in ('torch', 'lorafleet_worker.ops.cpu_attention', 'lorafleet_worker.ops.cpu_gemm',"
        " 'lorafleet_worker.ops.cpu_lora') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "from lorafleet_worker.ops import cpu_attention, cpu_lora\n"
        "assert 'torch.utils.cpp_extension' not in sys.modules  # only a build imports it\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


def test_cpu_flags_and_levels() -> None:
    info = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2\nbugs\t\t: none\n"
    assert loader.cpu_flags(info) == {"fpu", "sse2", "avx", "avx2"}
    assert loader.cpu_flags("no flags here") == set()
    assert loader.cpu_levels(V4) == ["x86-64-v4", "x86-64-v3"]
    assert loader.cpu_levels(V3) == ["x86-64-v3"]
    assert loader.cpu_levels(V4 - {"fma"}) == []  # v4 needs v3
    assert loader.cpu_levels(set()) == []


@pytest.mark.parametrize("ext", EXTENSIONS)
def test_prebuilt_path_picks_the_best_level_present(tmp_path: Path, ext: loader.Extension) -> None:
    other = next(e for e in loader.extensions() if e != ext)
    (tmp_path / f"{other.name}-x86-64-v4.so").write_bytes(b"")  # the other extension's library is not this one
    assert loader.prebuilt_path(ext, tmp_path, V4) is None
    (tmp_path / f"{ext.name}-x86-64-v3.so").write_bytes(b"")
    assert loader.prebuilt_path(ext, tmp_path, V4) == tmp_path / f"{ext.name}-x86-64-v3.so"
    (tmp_path / f"{ext.name}-x86-64-v4.so").write_bytes(b"")
    assert loader.prebuilt_path(ext, tmp_path, V4) == tmp_path / f"{ext.name}-x86-64-v4.so"
    assert loader.prebuilt_path(ext, tmp_path, V3) == tmp_path / f"{ext.name}-x86-64-v3.so"
    assert loader.prebuilt_path(ext, tmp_path, set()) is None  # an old CPU runs neither
    assert loader.prebuilt_path(ext, None, V4) is None
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / f"{ext.name}_old-x86-64-v4.so").write_bytes(b"")  # another version's name
    assert loader.prebuilt_path(ext, tmp_path / "old", V4) is None


class Calls:
    """Stands in for the import of a prebuilt library and the JIT build; records which ran, for which extension."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, prebuilt: Any = "mod-prebuilt", jit: Any = "mod-jit") -> None:
        self.seen: list[str] = []
        self.names: list[str] = []

        def fake(kind: str, result: Any) -> Any:
            def call(ext: loader.Extension, *args: Any, **kwargs: Any) -> Any:
                self.seen.append(kind)
                self.names.append(ext.name)
                if isinstance(result, Exception):
                    raise result
                return result

            return call

        monkeypatch.setattr(loader, "_import_prebuilt", fake("prebuilt", prebuilt))
        monkeypatch.setattr(loader, "_jit", fake("jit", jit))


@pytest.mark.parametrize("ext", EXTENSIONS)
def test_selection_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ext: loader.Extension) -> None:
    (tmp_path / f"{ext.name}-x86-64-v4.so").write_bytes(b"")
    env = {"LORAFLEET_CPU_OPS_DIR": str(tmp_path)}
    calls = Calls(monkeypatch)
    assert loader.load(ext, env, V4) == "mod-prebuilt" and calls.seen == ["prebuilt"]
    assert calls.names == [ext.name]
    calls.seen.clear()
    assert loader.load(ext, env, V3) == "mod-jit" and calls.seen == ["jit"]  # no v3 build present
    calls.seen.clear()
    assert loader.load(ext, {}, V4) == "mod-jit" and calls.seen == ["jit"]  # no directory set
    calls.seen.clear()
    assert loader.load(ext, {**env, ext.switch: "torch"}, V4) is None and calls.seen == []
    assert loader.load(ext, {**env, ext.switch: "Torch"}, V4) is None and calls.seen == []
    assert loader.switched_off(ext, {ext.switch: "torch"}) and not loader.switched_off(ext, {})


def test_each_python_environment_jit_builds_into_its_own_directory() -> None:
    """Two checkouts' venvs never share a JIT build directory (they rebuilt each other's libraries at every
    worker start); `$TORCH_EXTENSIONS_DIR` where set is torch's to use."""
    one, same, other = (loader.jit_directory("ops", env={}, prefix=p) for p in ("/a/.venv", "/a/.venv", "/b/.venv"))
    assert one == same and one != other and one is not None and one.endswith("/ops")
    assert loader.jit_directory("ops", env={"TORCH_EXTENSIONS_DIR": "/x"}) is None


def test_each_switch_turns_off_only_its_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    Calls(monkeypatch)
    env = {"LORAFLEET_CPU_LORA": "torch"}
    assert loader.load(cpu_lora.EXTENSION, env, V4) is None
    assert loader.load(cpu_attention.EXTENSION, env, V4) == "mod-jit"
    env = {"LORAFLEET_CPU_ATTENTION": "torch"}
    assert loader.load(cpu_attention.EXTENSION, env, V4) is None
    assert loader.load(cpu_lora.EXTENSION, env, V4) == "mod-jit"


@pytest.mark.parametrize("ext", EXTENSIONS)
def test_fallbacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, ext: loader.Extension
) -> None:
    caplog.set_level(logging.INFO, logger=loader.__name__)
    (tmp_path / f"{ext.name}-x86-64-v4.so").write_bytes(b"")
    env = {"LORAFLEET_CPU_OPS_DIR": str(tmp_path)}
    calls = Calls(monkeypatch, prebuilt=ImportError("undefined symbol"))
    assert loader.load(ext, env, V4) == "mod-jit" and calls.seen == ["prebuilt", "jit"]
    assert "undefined symbol" in caplog.text and f"{ext.name}-x86-64-v4.so" in caplog.text  # why it was skipped
    caplog.clear()
    calls = Calls(monkeypatch, prebuilt=ImportError("undefined symbol"), jit=RuntimeError("no g++"))
    assert loader.load(ext, env, V4) is None and calls.seen == ["prebuilt", "jit"]  # the torch path
    assert "no g++" in caplog.text and ext.fallback in caplog.text


@pytest.mark.parametrize("ext", EXTENSIONS)
def test_each_library_reads_its_switch_on_every_call(monkeypatch: pytest.MonkeyPatch, ext: loader.Extension) -> None:
    monkeypatch.setattr(loader, "built", lambda ext: f"built {ext.name}")
    monkeypatch.delenv(ext.switch, raising=False)
    assert loader.library(ext) == f"built {ext.name}"
    monkeypatch.setenv(ext.switch, "torch")
    assert loader.library(ext) is None


def test_cpu_lora_reads_its_switch_on_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "built", lambda ext: f"built {ext.name}")
    monkeypatch.delenv(cpu_lora.ENV, raising=False)
    assert cpu_lora.available()
    monkeypatch.setenv(cpu_lora.ENV, "torch")
    assert not cpu_lora.available()


@pytest.mark.parametrize("ext", EXTENSIONS)
def test_a_library_is_named_by_its_sources_and_headers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ext: loader.Extension
) -> None:
    """A changed byte in any file a library compiles (its .cpp files, the headers they include) or in its
    flags is a new name, so neither a stale JIT build nor a stale prebuilt file is loaded."""
    csrc = tmp_path / "csrc"
    shutil.copytree(loader.CSRC, csrc)
    files = loader.source_files(ext.sources, csrc)
    assert {p.name for p in files} >= set(ext.sources) and all(p.is_file() for p in files)
    assert ext.name == f"{ext.stem}_{loader.content_hash(ext.sources, csrc)}"
    assert ext.name.isidentifier()  # the Python module's name
    for path in files:
        original = path.read_bytes()
        path.write_bytes(original.replace(b"\n", b"\n ", 1))
        assert loader.content_hash(ext.sources, csrc) != loader.content_hash(ext.sources, loader.CSRC), path
        path.write_bytes(original)
    assert loader.content_hash(ext.sources, csrc) == loader.content_hash(ext.sources, loader.CSRC)
    (csrc / "unused.h").write_text("// included by no library\n")
    assert loader.content_hash(ext.sources, csrc) == loader.content_hash(ext.sources, loader.CSRC)
    monkeypatch.setattr(loader, "CFLAGS", ("-O2", "-fopenmp"))
    assert loader.content_hash(ext.sources, csrc) != ext.name.rpartition("_")[2]


def test_every_header_is_compiled_into_some_library() -> None:
    used = {p.name for e in loader.extensions() for p in loader.source_files(e.sources)}
    assert used == {p.name for p in loader.CSRC.iterdir() if p.suffix in (".cpp", ".h")}


def test_cli_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        loader.main(["--help"])
    assert exit_.value.code == 0 and "build" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        loader.main(["build", "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "DIR" in out and "x86-64-v4" in out and "x86-64-v3" in out
    for argv in (["build", "/tmp/x", "x86-64-v9"], ["build", "/tmp/x"], [], ["make", "/tmp/x", "x86-64-v3"]):
        with pytest.raises(SystemExit) as exit_:
            loader.main(argv)
        assert exit_.value.code == 2, argv
        assert "usage:" in capsys.readouterr().err


def test_cli_builds_every_extension_for_the_level(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    flags: list[tuple[str, list[str]]] = []

    def jit(ext: loader.Extension, cflags: list[str], build_directory: str | None = None) -> None:
        assert build_directory is not None  # never the shared JIT cache
        flags.append((ext.name, cflags))
        (Path(build_directory) / f"{ext.name}.so").write_bytes(ext.name.encode())

    monkeypatch.setattr(loader, "_jit", jit)
    monkeypatch.setattr(loader, "cpu_levels", lambda flags: list(loader.LEVELS))  # this CPU runs both
    assert loader.main(["build", str(tmp_path / "lib"), "x86-64-v3"]) == 0
    assert sorted(p.name for p in (tmp_path / "lib").iterdir()) == sorted(f"{n}-x86-64-v3.so" for n in NAMES)
    assert flags == [(n, ["-march=x86-64-v3"]) for n in NAMES]

    def broken(ext: loader.Extension, cflags: list[str], build_directory: str | None = None) -> None:
        raise RuntimeError("g++ failed")

    monkeypatch.setattr(loader, "_jit", broken)
    assert loader.main(["build", str(tmp_path / "lib2"), "x86-64-v4"]) == 1


@pytest.mark.skipif(
    not (cpu_attention.available() and cpu_gemm.available() and cpu_lora.available()),
    reason="no C++ toolchain here to build the libraries",
)
def test_prebuilt_libraries_build_load_and_agree(tmp_path: Path) -> None:
    """The image's path end to end: build every extension for the portable level (x86-64-v3) with the CLI, load
    them as the worker would (in a fresh process, LORAFLEET_CPU_OPS_DIR set, nothing compiled), and compare
    decode attention with the torch path, the panel GEMM and the LoRA kernel with dense references."""
    import os
    import subprocess
    import sys

    if "x86-64-v3" not in loader.cpu_levels(loader.cpu_flags()):
        pytest.skip("this CPU does not run x86-64-v3")
    script = (
        "import logging, sys, torch\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from lorafleet_worker.ops import cpu_attention as c\n"
        "from lorafleet_worker.ops import cpu_lora as l\n"
        "from lorafleet_worker.ops import cpu_gemm as g\n"
        "from lorafleet_worker.model.attention import _torch_decode\n"
        "from tests.worker.test_cpu_attention import decode_batch\n"
        "assert c.available() and l.available() and g.available()\n"
        "torch.manual_seed(0)\n"
        "kc, vc = torch.randn(6, 4, 2, 16), torch.randn(6, 4, 2, 16)\n"
        "tables = torch.tensor([[1, 2, 3], [4, 5, 0]], dtype=torch.int32)\n"
        "batch = decode_batch([11, 6], tables, 4, None)\n"
        "q = torch.randn(2, 4, 16)\n"
        "ours = c.paged_decode(q, kc, vc, tables, batch.decode_seq_lens, 0.25, None)\n"
        "assert (ours - _torch_decode(q, kc, vc, batch, 0.25)).abs().max().item() < 1e-5\n"
        # two adapters (ranks 4 and 2) on one 8-column slice, B stored [out, rank]; rows 0-1 slot 0, row 2 slot 1
        "x, A, B = torch.randn(3, 16), torch.randn(2, 1, 4, 16), torch.randn(2, 8, 4)\n"
        "ranks, scalings = torch.tensor([[4], [2]], dtype=torch.int32), torch.tensor([[0.5], [2.0]])\n"
        "rows, segs = torch.arange(3, dtype=torch.int32), torch.tensor([[0, 0, 2], [1, 2, 3]])\n"
        "out = torch.zeros(3, 8)\n"
        "l.lora_small(x, out, A, B, ranks, scalings, (0, 8), rows, segs)\n"
        "ref = torch.cat([0.5 * x[:2] @ A[0, 0].T @ B[0].T, 2.0 * x[2:] @ A[1, 0, :2].T @ B[1, :, :2].T])\n"
        "assert (out - ref).abs().max().item() < 1e-4, (out, ref)\n"
        "w, xg = torch.randn(20, 24), torch.randn(3, 24)\n"
        "assert (g.pack(w).matmul(xg) - xg @ w.T).abs().max().item() < 1e-4\n"
    )
    built = subprocess.run(
        [sys.executable, "-m", "lorafleet_worker.ops.loader", "build", str(tmp_path / "lib"), "x86-64-v3"],
        capture_output=True, text=True, env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")},
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "lib").iterdir()) == sorted(f"{n}-x86-64-v3.so" for n in NAMES)
    env = {**os.environ, "LORAFLEET_CPU_OPS_DIR": str(tmp_path / "lib"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "no")}
    for switch in ("LORAFLEET_CPU_ATTENTION", "LORAFLEET_CPU_LINEAR", "LORAFLEET_CPU_LORA"):
        env.pop(switch, None)
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=root)
    assert run.returncode == 0, run.stderr[-2000:]
    for name, what in (
        (cpu_attention.EXTENSION.name, "CPU C++ ops"),
        (cpu_gemm.EXTENSION.name, "CPU panel GEMM"),
        (cpu_lora.EXTENSION.name, "CPU LoRA kernel"),
    ):
        assert f"{what}: prebuilt {tmp_path / 'lib' / name}-x86-64-v3.so" in run.stderr, run.stderr[-2000:]
    assert not (tmp_path / "no").exists()  # nothing was compiled at load
