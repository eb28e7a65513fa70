"""Shared test fixtures: tiny generated base models and PEFT adapters (built once per session)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ARCHS = ("llama", "qwen2", "qwen3")


class TinyModels:
    """Mapping arch -> tiny model directory; each model is built on first access."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._dirs: dict[str, Path] = {}
        self._lock = threading.Lock()

    def __getitem__(self, arch: str) -> Path:
        from lorafleet_worker_dev.tiny import make_tiny_model

        if arch not in ARCHS:
            raise KeyError(arch)
        with self._lock:
            if arch not in self._dirs:
                self._dirs[arch] = make_tiny_model(self._root / arch, arch, seed=ARCHS.index(arch))
            return self._dirs[arch]

    def __iter__(self) -> Iterator[str]:
        return iter(ARCHS)

    def __len__(self) -> int:
        return len(ARCHS)

    def keys(self) -> tuple[str, ...]:
        return ARCHS

    def items(self) -> list[tuple[str, Path]]:
        return [(arch, self[arch]) for arch in ARCHS]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    """`tiny_models["llama" | "qwen2" | "qwen3"]` -> model directory (config, safetensors, tokenizer.json)."""
    return TinyModels(tmp_path_factory.mktemp("tiny_models"))


AdapterFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_adapter_factory(tmp_path_factory: pytest.TempPathFactory) -> AdapterFactory:
    """`tiny_adapter_factory(base_dir, **make_tiny_adapter_kwargs)` -> PEFT adapter dir, cached by arguments.

    Treat the returned directory as read-only (it is shared); copy it before corrupting it.
    """
    from lorafleet_worker_dev.tiny import make_tiny_adapter

    root = tmp_path_factory.mktemp("tiny_adapters")
    cache: dict[str, Path] = {}
    lock = threading.Lock()

    def make(base_dir: Path, **kw: Any) -> Path:
        key = json.dumps({"base": str(base_dir), **kw}, sort_keys=True, default=str)
        with lock:
            if key not in cache:
                cache[key] = make_tiny_adapter(root / f"adapter{len(cache)}", base_dir, **kw)
            return cache[key]

    return make
