"""Gateway metrics in vLLM's names on the inference port, scraped under a mixed-adapter load.

A fresh worker with one GPU slot (`--max-loras 1`) and three adapters, two requests each: the first
adapter's two (long) requests are admitted, then the other four arrive and wait for the slot. The scrape
must show that split (queue depth, running count, the LoRA info gauge's adapter lists, KV-cache use);
after the load, the token counters, the request counter and the latency histograms must add up to what
the responses reported. The split is a transient state: the first adapter's requests are long (most of
the tiny model's context) so that they still run when the others have arrived, however fast the CPU.

The names, types and labels checked first are those the Gateway API Inference Extension's model-server protocol
requires (docs/proposals/003-model-server-protocol/README.md in kubernetes-sigs/gateway-api-inference-extension):
TotalQueuedRequests `vllm:num_requests_waiting`, TotalRunningRequests `vllm:num_requests_running`,
KVCacheUtilization `vllm:kv_cache_usage_perc` (all gauges), the optional BlockSize / NumGPUBlocks labels of
`vllm:cache_config_info`, and the LoRA gauge `vllm:lora_requests_info`, whose value is the last update's timestamp
and whose labels are `max_lora` and the comma-separated `running_lora_adapters` / `waiting_lora_adapters`.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.worker.conftest import Worker, start_worker, stop_worker, wait_until

ADAPTERS = ("gw/a", "gw/b", "gw/c")
PER_ADAPTER = 2
FIRST_TOKENS = 1600  # the first adapter's requests: still running when the others arrive
MAX_TOKENS = 160
SAMPLE_RE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$")
LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(worker: Worker) -> dict[str, list[tuple[dict[str, str], float]]]:
    """`/metrics` of the inference port as {name: [(labels, value), ...]}."""
    r = httpx.get(f"{worker.url}/metrics", timeout=30)
    assert r.status_code == 200, r.text
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in r.text.splitlines():
        m = SAMPLE_RE.match(line)
        if m and not line.startswith("#"):
            labels = dict(LABEL_RE.findall(m["labels"] or ""))
            out.setdefault(m["name"], []).append((labels, float(m["value"])))
    return out


def value(metrics: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    """The one sample of `name` whose labels include `labels`."""
    found = [v for ls, v in metrics.get(name, []) if all(ls.get(k) == want for k, want in labels.items())]
    assert len(found) == 1, f"{name}{labels}: {metrics.get(name)}"
    return found[0]


def total(metrics: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels` (0 when there is none yet)."""
    return sum(v for ls, v in metrics.get(name, []) if all(ls.get(k) == want for k, want in labels.items()))


@pytest.fixture(scope="module")
def worker(tiny_models: Any, tiny_adapter_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    paths = [tiny_adapter_factory(tiny_models["llama"], rank=4, seed=31 + i) for i in range(len(ADAPTERS))]
    w = start_worker(
        tiny_models["llama"],
        tmp_path_factory.mktemp("gateway_metrics"),
        name="tiny-gw",
        file_root=Path(paths[0]).parent,
        args=["--max-loras", "1", "--max-num-seqs", "16"],
    )
    try:
        for name, path in zip(ADAPTERS, paths, strict=True):
            w.load(name, path)
        yield w
    finally:
        stop_worker(w)


def metric_types(worker: Worker) -> dict[str, str]:
    """`# TYPE` of every metric family on the inference port."""
    r = httpx.get(f"{worker.url}/metrics", timeout=30)
    return {p[2]: p[3] for p in (line.split() for line in r.text.splitlines()) if p[:2] == ["#", "TYPE"]}


PROTOCOL_GAUGES = (
    "vllm:num_requests_waiting",  # TotalQueuedRequests
    "vllm:num_requests_running",  # TotalRunningRequests
    "vllm:kv_cache_usage_perc",  # KVCacheUtilization
    "vllm:cache_config_info",  # [Optional] BlockSize, NumGPUBlocks
    "vllm:lora_requests_info",  # LoRA adapter serving
)


def test_the_model_server_protocol_series_are_gauges(worker: Worker) -> None:
    types = metric_types(worker)
    assert {name: types.get(name) for name in PROTOCOL_GAUGES} == dict.fromkeys(PROTOCOL_GAUGES, "gauge")
    ((labels, one),) = scrape(worker)["vllm:cache_config_info"]
    assert one == 1.0 and labels["engine"] == "0"
    assert int(labels["block_size"]) > 0 and int(labels["num_gpu_blocks"]) > 0


def test_idle_worker_reports_vllm_series(worker: Worker) -> None:
    m = scrape(worker)
    labels = {"model_name": "tiny-gw", "engine": "0"}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert value(m, name, **labels) == 0.0
    assert value(m, "vllm:gpu_cache_usage_perc", **labels) == 0.0
    info = m["vllm:lora_requests_info"]
    assert len(info) == 1
    assert info[0][0] == {"max_lora": "1", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert abs(info[0][1] - time.time()) < 3600  # a wall-clock timestamp, as vLLM's


def test_mixed_adapter_load(worker: Worker) -> None:
    first, *others = ADAPTERS
    seen: list[dict[str, Any]] = []

    def running() -> float:
        return value(scrape(worker), "vllm:num_requests_running")

    def split_is_visible() -> bool:
        m = scrape(worker)
        running = value(m, "vllm:num_requests_running")
        waiting = value(m, "vllm:num_requests_waiting")
        ((labels, _),) = m["vllm:lora_requests_info"]
        running_adapters = [a for a in labels["running_lora_adapters"].split(",") if a]
        waiting_adapters = [a for a in labels["waiting_lora_adapters"].split(",") if a]
        if running + waiting < len(ADAPTERS) * PER_ADAPTER or not running:
            return False
        seen.append(
            {
                "running": running,
                "waiting": waiting,
                "running_adapters": running_adapters,
                "waiting_adapters": waiting_adapters,
                "kv": value(m, "vllm:kv_cache_usage_perc"),
                "gpu_kv": value(m, "vllm:gpu_cache_usage_perc"),
            }
        )
        return True

    async def load() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=300) as client:

            def post(i: int, name: str, max_tokens: int) -> asyncio.Future[httpx.Response]:
                body = {"model": name, "prompt": f"story {i}", "max_tokens": max_tokens, "ignore_eos": True}
                return asyncio.ensure_future(client.post(f"{worker.url}/v1/completions", json=body))

            tasks = [post(i, first, FIRST_TOKENS) for i in range(PER_ADAPTER)]
            await asyncio.to_thread(wait_until, lambda: running() == PER_ADAPTER, 120, f"{first}'s requests running")
            tasks += [
                post(PER_ADAPTER + i, name, MAX_TOKENS)
                for i, name in enumerate(n for n in others for _ in range(PER_ADAPTER))
            ]
            await asyncio.to_thread(wait_until, split_is_visible, 120, "all requests in the engine")
            responses = await asyncio.gather(*tasks)
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        return [r.json() for r in responses]

    bodies = asyncio.run(load())
    requests = len(bodies)

    # during the load: one slot, so the first adapter's requests run and the other two adapters' wait
    during = seen[-1]
    assert during["running"] == PER_ADAPTER and during["waiting"] == requests - PER_ADAPTER
    assert during["running_adapters"] == [first]
    assert sorted(during["waiting_adapters"]) == sorted(others)
    assert 0 < during["kv"] <= 1 and during["gpu_kv"] == during["kv"]

    # after the load: idle again, and the counters add up to the responses
    def idle() -> bool:
        m = scrape(worker)
        return value(m, "vllm:num_requests_running") == 0 and value(m, "vllm:num_requests_waiting") == 0

    wait_until(idle, 30, "the worker to be idle")
    m = scrape(worker)
    labels = {"model_name": "tiny-gw", "engine": "0"}
    assert value(m, "vllm:kv_cache_usage_perc", **labels) == 0.0
    ((info_labels, _),) = m["vllm:lora_requests_info"]
    assert info_labels["running_lora_adapters"] == info_labels["waiting_lora_adapters"] == ""
    prompt = sum(b["usage"]["prompt_tokens"] for b in bodies)
    generated = sum(b["usage"]["completion_tokens"] for b in bodies)
    assert generated == PER_ADAPTER * FIRST_TOKENS + (requests - PER_ADAPTER) * MAX_TOKENS
    assert value(m, "vllm:prompt_tokens_total", **labels) == prompt  # no preemption: each prompt once
    assert value(m, "vllm:generation_tokens_total", **labels) == generated
    assert value(m, "vllm:request_success_total", finished_reason="length", **labels) == requests
    assert value(m, "vllm:time_to_first_token_seconds_count", **labels) == requests
    assert value(m, "vllm:e2e_request_latency_seconds_count", **labels) == requests
    itl = value(m, "vllm:inter_token_latency_seconds_count", **labels)
    assert itl == generated - requests  # every token after the first
    assert value(m, "vllm:time_per_output_token_seconds_count", **labels) == itl
    # a waiting request's first token came after the running adapter's: TTFT spread over several buckets
    ttft_sum = value(m, "vllm:time_to_first_token_seconds_sum", **labels)
    e2e_sum = value(m, "vllm:e2e_request_latency_seconds_sum", **labels)
    assert 0 < ttft_sum < e2e_sum
