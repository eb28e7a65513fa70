"""Kernel tests: compiled Triton on a GPU when there is one, else Triton's interpreter on CPU.

The interpreter is switched on by setting `TRITON_INTERPRET=1` for this package's tests only (the kernels
jit lazily and read the flag at launch, so it does not matter what was imported before). Large shapes
(`gpu_large`) are deselected unless `LORAFLEET_GPU_LARGE=1`. With `LORAFLEET_REQUIRE_GPU=1` (`make gpu-check`)
the run fails without a CUDA GPU, and a skipped test counts as failed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

ON_GPU = torch.cuda.is_available()
REQUIRE_GPU = os.environ.get("LORAFLEET_REQUIRE_GPU") == "1"


def pytest_configure(config: pytest.Config) -> None:
    if REQUIRE_GPU and not ON_GPU:
        raise pytest.UsageError("LORAFLEET_REQUIRE_GPU=1 but torch sees no CUDA GPU")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_GPU and report.skipped:
        report.outcome = "failed"
        report.longrepr = f"skipped under LORAFLEET_REQUIRE_GPU=1: {report.longrepr}"


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
