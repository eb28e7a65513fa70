"""Each image's Python packages installed alone, the way its Dockerfile installs them, into a clean venv
(no podman needed): the hashed lock, then the projects without dependencies. Every module of the image's
packages must import, every module they import must be installed, `uv pip check` must pass and each
console script must answer `--help`. This is what catches an entry point importing an undeclared package
(the operator's `kubernetes` was one). Installs link from the shared uv cache, so a warm run is quick.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
UV = Path(sys.executable).parent / "uv"
CACHE = Path(os.environ.get("LORAFLEET_CACHE", Path.home() / ".cache" / "lorafleet"))


def extra_modules(project: str, extra: str) -> list[str]:
    """Import names of an optional extra's packages (dist name with '-' -> '_')."""
    data = tomllib.loads((ROOT / project / "pyproject.toml").read_text())["project"]
    return [Requirement(r).name.replace("-", "_").lower() for r in data["optional-dependencies"][extra]]


@dataclass(frozen=True)
class Image:
    """One image's Python content: its lock, the projects installed on top, their packages and scripts."""

    lock: str
    projects: tuple[str, ...]
    packages: tuple[str, ...]
    scripts: tuple[str, ...]
    may_lack: tuple[str, ...] = ()


IMAGES = {
    "operator": Image(
        "operator",
        ("jobs", "operator", "sidecar"),
        ("lorafleet_sync", "lorafleet_operator", "lorafleet_router", "lorafleet_sidecar"),
        ("lorafleet-operator", "lorafleet-router", "lorafleet-sync", "lorafleet-vllm-sidecar"),
    ),
    "worker": Image(
        "worker",
        ("jobs", "worker"),
        ("lorafleet_sync", "lorafleet_worker"),
        ("lorafleet-worker", "lorafleet-sync"),
        may_lack=tuple(extra_modules("worker", "dev")),
    ),
    "worker-dev": Image(
        "worker-dev",
        ("jobs", "worker", "worker/dev"),
        ("lorafleet_sync", "lorafleet_worker", "lorafleet_worker_dev"),
        ("lorafleet-worker", "lorafleet-sync", "lorafleet-dev"),
    ),
}


def uv(*args: str) -> None:
    env = {**os.environ, "UV_CACHE_DIR": str(CACHE / "uv"), "UV_LINK_MODE": "hardlink"}
    done = subprocess.run([str(UV), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, f"uv {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"


@pytest.fixture(scope="module", params=sorted(IMAGES))
def image_venv(request: pytest.FixtureRequest) -> Iterator[tuple[Image, Path]]:
    image = IMAGES[request.param]
    # On the cache's filesystem, so that uv hardlinks the wheels (torch) instead of copying them.
    (CACHE / "image-venvs").mkdir(parents=True, exist_ok=True)
    venv = Path(tempfile.mkdtemp(prefix=f"{request.param}-", dir=CACHE / "image-venvs"))
    uv("venv", "--quiet", "--clear", "--python", sys.executable, str(venv))
    python = str(venv / "bin" / "python")
    uv("pip", "install", "--quiet", "--python", python, "--require-hashes", "-r", f"locks/{image.lock}.txt")
    uv("pip", "install", "--quiet", "--python", python, "--no-deps", *(f"./{p}" for p in image.projects))
    yield image, venv
    shutil.rmtree(venv, ignore_errors=True)


def test_every_module_imports_and_finds_what_it_imports(image_venv: tuple[Image, Path]) -> None:
    image, venv = image_venv
    argv = [str(venv / "bin" / "python"), str(ROOT / "tests" / "delivery" / "import_all.py"), *image.packages]
    if image.may_lack:
        argv += ["--may-lack", *image.may_lack]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd="/")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert not report["failed"], "modules that do not import:\n" + "\n".join(report["failed"].values())
    assert not report["missing"], f"imported but not installed (undeclared dependencies): {report['missing']}"
    assert {p for p in image.packages} <= set(report["imported"])


def test_dependencies_are_consistent(image_venv: tuple[Image, Path]) -> None:
    _, venv = image_venv
    uv("pip", "check", "--python", str(venv / "bin" / "python"))


def test_console_scripts_answer_help(image_venv: tuple[Image, Path]) -> None:
    image, venv = image_venv
    for script in image.scripts:
        done = subprocess.run([str(venv / "bin" / script), "--help"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and "usage" in done.stdout.lower(), f"{script} --help:\n{done.stderr[-2000:]}"


def test_worker_ships_the_cpp_sources_of_every_extension(image_venv: tuple[Image, Path]) -> None:
    """The installed worker (not this checkout) holds every file its C++ extensions compile, so its libraries
    carry the same content-hashed names as the checkout's: the image's prebuilt files are the ones it loads."""
    image, venv = image_venv
    if "lorafleet_worker" not in image.packages:
        pytest.skip("no worker in this image")
    from lorafleet_worker.ops import loader

    code = (
        "import json; from lorafleet_worker.ops import loader\n"
        "print(json.dumps({'csrc': str(loader.CSRC), 'names': [e.name for e in loader.extensions()]}))\n"
    )
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=300, cwd="/"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    installed = json.loads(done.stdout.splitlines()[-1])
    assert Path(installed["csrc"]).is_relative_to(venv.resolve()), installed["csrc"]
    assert installed["names"] == [e.name for e in loader.extensions()]
