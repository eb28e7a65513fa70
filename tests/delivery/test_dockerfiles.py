"""Static checks of the images (no Docker here): sources exist, entrypoints are real CLIs,
stages are pinned and non-root, and the operator image cannot pull in torch."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.delivery.dockerfile import Dockerfile

ROOT = Path(__file__).resolve().parents[2]
PROJECTS = {
    "jobs": "lorafleet-sync",
    "operator": "lorafleet-operator",
    "sidecar": "lorafleet-vllm-sidecar",
    "worker": "lorafleet-worker",
}
IMAGES = {"Dockerfile.worker": {"jobs", "worker"}, "Dockerfile.operator": {"jobs", "operator", "sidecar"}}
LOCK_ARG = re.compile(r'-r "?locks/')
FORBIDDEN_IN_OPERATOR = re.compile(r"^(torch|triton|nvidia-.*|transformers|peft|accelerate)$")


def scripts(project_dir: str) -> set[str]:
    data = tomllib.loads((ROOT / project_dir / "pyproject.toml").read_text())
    return set(data["project"].get("scripts", {}))


def copied_projects(df: Dockerfile) -> set[str]:
    return {src.strip("./") for src in df.copy_sources() if src.strip("./") in PROJECTS}


def dockerignore_patterns() -> list[tuple[bool, str]]:
    """(.dockerignore) lines as (negated, pattern), in order."""
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            rules.append((line.startswith("!"), line.lstrip("!").rstrip("/")))
    return rules


def ignored(path: str) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern matching a parent matches the path."""
    result = False
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for negated, pattern in dockerignore_patterns():
        if any(fnmatch.fnmatch(p, pattern) for p in prefixes):
            result = not negated
    return result


@pytest.fixture(params=sorted(IMAGES), ids=lambda p: p)
def dockerfile(request: pytest.FixtureRequest) -> Dockerfile:
    return Dockerfile.parse(ROOT / request.param)


def test_copy_sources_exist_and_are_in_the_build_context(dockerfile: Dockerfile) -> None:
    sources = dockerfile.copy_sources()
    assert sources, "no COPY from the build context"
    for src in sources:
        assert (ROOT / src).exists(), f"{dockerfile.path.name}: COPY source {src} does not exist"
        assert not ignored(src), f"{dockerfile.path.name}: COPY source {src} is excluded by .dockerignore"


def test_copies_exactly_its_projects(dockerfile: Dockerfile) -> None:
    assert copied_projects(dockerfile) == IMAGES[dockerfile.path.name]


def test_multi_stage_pinned_and_non_root(dockerfile: Dockerfile) -> None:
    names = dockerfile.stage_names()
    assert len(names) >= 2 and all(names), f"want named multi-stage build, got stages {names}"
    assert dockerfile.of("COPY", dockerfile.final_stage), "final stage copies nothing"
    assert any("--from=" in i.args for i in dockerfile.of("COPY", dockerfile.final_stage))
    for image in dockerfile.base_images():
        if image in names:
            continue
        _, _, tag = image.partition(":")
        assert tag and tag != "latest" and re.search(r"\d+\.\d+\.\d+", tag), f"base image {image} is not pinned"
    users = dockerfile.of("USER", dockerfile.final_stage)
    assert users, "final stage runs as root"
    uid = users[-1].words()[0].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"final USER {uid} must be a numeric non-root uid"
    # Every Python package comes from a hashed lock; the projects themselves go in without dependencies.
    installs = [i.args for i in dockerfile.of("RUN") if "pip install" in i.args]
    assert installs, "no pip install"
    for args in installs:
        assert ("--require-hashes" in args and LOCK_ARG.search(args)) or "--no-deps" in args, args


def test_dependency_layers_come_before_source_layers(dockerfile: Dockerfile) -> None:
    """A source edit must not invalidate the layer that downloads torch: the lock is installed first."""
    build = [i for i in dockerfile.instructions if i.stage == 0]
    lock_install = next(n for n, i in enumerate(build) if i.keyword == "RUN" and LOCK_ARG.search(i.args))
    first_source = next(n for n, i in enumerate(build) if i.keyword == "COPY" and i.words()[0].strip("./") in PROJECTS)
    assert lock_install < first_source, "the lock is installed after the sources are copied"
    for inst in build:
        if inst.keyword == "RUN" and "uv pip install" in inst.args:
            assert "--mount=type=cache" in inst.args, f"uv install without a wheel cache mount: {inst.args[:80]}"


def test_entrypoints_are_cli_scripts_of_installed_projects(dockerfile: Dockerfile) -> None:
    available: set[str] = set().union(*(scripts(p) for p in IMAGES[dockerfile.path.name]))
    commands = dockerfile.of("ENTRYPOINT", dockerfile.final_stage) or dockerfile.of("CMD", dockerfile.final_stage)
    assert commands, "no ENTRYPOINT or CMD"
    program = commands[-1].words()[0]
    assert program in available, f"{program} is not one of {sorted(available)}"
    # The installing RUN lines name each copied project.
    installs = " ".join(i.args for i in dockerfile.of("RUN") if "pip install" in i.args)
    for project in IMAGES[dockerfile.path.name]:
        assert f"./{project}" in installs, f"{project} is copied but not installed"


def test_worker_command_leaves_backend_and_dtype_to_the_worker() -> None:
    df = Dockerfile.parse(ROOT / "Dockerfile.worker")
    words = [w for i in df.of("CMD", df.final_stage) + df.of("ENTRYPOINT", df.final_stage) for w in i.words()]
    assert not {"--lora-backend", "--dtype"} & set(words), words


def dependency_closure(dist: str) -> set[str]:
    """Names of every distribution `dist` requires, transitively (from installed metadata)."""
    seen: set[str] = set()
    todo = [dist]
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        for spec in metadata.requires(name) or []:
            req = Requirement(spec)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue  # optional extra, not installed by the image
            todo.append(req.name)
    return seen


def test_operator_image_requirements_have_no_torch() -> None:
    closure = dependency_closure("lorafleet-operator") | dependency_closure("lorafleet-sync")
    closure |= dependency_closure("lorafleet-vllm-sidecar")
    assert {"lorafleet-operator", "lorafleet-sync", "lorafleet-vllm-sidecar", "kopf", "boto3"} <= closure
    bad = sorted(n for n in closure if FORBIDDEN_IN_OPERATOR.match(n))
    assert not bad, f"the operator image would install {bad}"
    # ... and the worker closure does hold torch, so the check above can fail.
    assert "torch" in dependency_closure("lorafleet-worker")
    df = Dockerfile.parse(ROOT / "Dockerfile.operator")
    assert "worker" not in copied_projects(df)


def test_dockerignore_keeps_secrets_and_local_state_out() -> None:
    for path in (".venv", ".git", "tests", "charts", ".env", "bench"):
        assert ignored(path), f"{path} would be sent to the Docker build context"
    for path in ("jobs/pyproject.toml", "operator/src", "worker/src", "locks/worker.txt", "locks/tools.txt"):
        assert not ignored(path), f"{path} is needed by the Dockerfiles but ignored"


def test_worker_image_prebuilds_the_cpp_extensions_where_the_worker_loads_them() -> None:
    """The build stage runs the extension loader's build command for every x86-64 level once the worker is
    installed, into the directory the runtime's LORAFLEET_CPU_OPS_DIR names, and the worker's wheel carries
    every C++ source file the loader compiles."""
    from lorafleet_worker.ops import loader

    df = Dockerfile.parse(ROOT / "Dockerfile.worker")
    build = [i for i in df.instructions if i.stage == 0]
    command = re.compile(rf"python -m {re.escape(loader.__name__)}\s+build\s")
    prebuilds = [n for n, i in enumerate(build) if i.keyword == "RUN" and command.search(i.args)]
    assert len(prebuilds) == 1, "no (or more than one) prebuild step"
    prebuild = build[prebuilds[0]].args
    install = next(n for n, i in enumerate(build) if i.keyword == "RUN" and "./worker" in i.args)
    assert install < prebuilds[0], "the extensions are built before the worker is installed"
    assert all(level in prebuild for level in loader.LEVELS), prebuild
    env = " ".join(i.args for i in df.of("ENV", df.final_stage))
    ops_dir = re.search(rf"{loader.OPS_DIR_ENV}=(\S+)", env)
    assert ops_dir and ops_dir.group(1) in prebuild and ops_dir.group(1).startswith("/opt/lorafleet/")
    package_data = tomllib.loads((ROOT / "worker" / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = package_data["lorafleet_worker"]
    for path in loader.CSRC.iterdir():
        name = path.relative_to(loader.CSRC.parent).as_posix()
        assert any(fnmatch.fnmatch(name, pattern) for pattern in shipped), f"{name} is not package data"
