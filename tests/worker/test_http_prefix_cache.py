"""Prefix caching through the worker process: on by default, off with `--no-enable-prefix-caching`, and counted
in vLLM's `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits` (tokens) on the inference port's /metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.worker.conftest import start_worker, stop_worker
from tests.worker.test_http_gateway_metrics import scrape, value

PROMPT = " ".join(f"word{i}" for i in range(60))  # well over one 16-token block


@pytest.mark.parametrize("flag", [None, "--no-enable-prefix-caching"])
def test_repeated_prompt_hits_the_cache_unless_disabled(tiny_models: Any, tmp_path: Path, flag: str | None) -> None:
    worker = start_worker(tiny_models["llama"], tmp_path, name="tiny-pc", args=[flag] if flag else [])
    try:
        answers = []
        for _ in range(2):
            r = httpx.post(
                f"{worker.url}/v1/completions",
                json={"model": "tiny-pc", "prompt": PROMPT, "max_tokens": 4, "temperature": 0},
                timeout=120,
            )
            assert r.status_code == 200, r.text
            answers.append(r.json()["choices"][0]["text"])
            prompt_tokens = r.json()["usage"]["prompt_tokens"]
        assert answers[0] == answers[1]
        m = scrape(worker)
        labels = {"model_name": "tiny-pc", "engine": "0"}
        queries = value(m, "vllm:prefix_cache_queries_total", **labels)
        hits = value(m, "vllm:prefix_cache_hits_total", **labels)
        if flag is None:
            assert queries == 2 * prompt_tokens
            assert hits == (prompt_tokens - 1) // 16 * 16  # the second request's full blocks, not its last token
        else:
            assert queries == hits == 0
    finally:
        stop_worker(worker)
