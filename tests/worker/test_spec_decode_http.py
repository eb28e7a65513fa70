"""Speculative decoding through the HTTP API: a worker started with `--speculative-config` answers greedy
completions (n > 1, stop strings, logprobs) as a worker without it does, and exports vLLM's counters."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.worker.conftest import Worker, start_worker, stop_worker

PROMPT = [5, 6, 7, 8] * 4 + [5, 6]  # repeats itself: prompt lookup finds n-grams


@pytest.fixture(scope="module")
def spec_worker(tiny_models: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    worker = start_worker(
        tiny_models["llama"],
        tmp_path_factory.mktemp("spec_worker"),
        name="tiny-llama",
        args=["--max-loras", "4", "--speculative-config", json.dumps(config)],
    )
    yield worker
    stop_worker(worker)


def _choices(worker: Worker, **kw: Any) -> list[tuple[str, str, Any]]:
    body = worker.complete(worker.model_name, PROMPT, max_tokens=16, **kw)
    return [(c["text"], c["finish_reason"], c["logprobs"]) for c in body["choices"]]


def test_answers_equal_a_worker_without_speculation(shared_worker: Worker, spec_worker: Worker) -> None:
    plain = _choices(shared_worker, n=2, logprobs=2)
    assert _same(_choices(spec_worker, n=2, logprobs=2), plain)
    text = plain[0][0]
    stop = text[len(text) // 2 : len(text) // 2 + 2]  # a stop string inside the answer
    want = _choices(shared_worker, n=2, stop=[stop])
    got = _choices(spec_worker, n=2, stop=[stop])
    assert got == want and got[0][1] == "stop" and stop not in got[0][0]
    metrics = httpx.get(f"{spec_worker.url}/metrics", timeout=30).text
    drafts = [line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_accepted_tokens_total")]
    assert drafts and float(drafts[0].rsplit(" ", 1)[1]) > 0


def _same(got: list[tuple[str, str, Any]], want: list[tuple[str, str, Any]]) -> bool:
    """Texts and finish reasons equal, log-probabilities within float rounding."""
    for (gt, gr, gl), (wt, wr, wl) in zip(got, want, strict=True):
        if (gt, gr) != (wt, wr) or gl["tokens"] != wl["tokens"]:
            return False
        if any(abs(a - b) > 1e-3 for a, b in zip(gl["token_logprobs"], wl["token_logprobs"], strict=True)):
            return False
    return len(got) == len(want)
