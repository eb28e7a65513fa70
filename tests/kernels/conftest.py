"""Kernel tests: compiled Triton on a GPU when there is one, else Triton's interpreter on CPU.

The interpreter is switched on by setting `TRITON_INTERPRET=1` for this package's tests only (the kernels
jit lazily and read the flag at launch, so it does not matter what was imported before). Large shapes
(`gpu_large`) are deselected unless `LORAFLEET_GPU_LARGE=1`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

ON_GPU = torch.cuda.is_available()


@pytest.fixture(autouse=True, scope="package")
def triton_interpreter() -> Iterator[None]:
    if ON_GPU:
        yield
        return
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if ON_GPU else "cpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("LORAFLEET_GPU_LARGE") == "1":
        return
    large = [it for it in items if it.get_closest_marker("gpu_large")]
    if large:
        config.hook.pytest_deselected(items=large)
        items[:] = [it for it in items if not it.get_closest_marker("gpu_large")]
