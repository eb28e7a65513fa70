"""The worker's HTTP APIs end to end: management (Dynamo / vLLM bodies), OpenAI completions and chat, probes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from lorafleet_sync.ids import lora_id

from tests.worker.conftest import Worker

PROMPT = "Once upon a time there was a little robot"


def _sse_events(response: httpx.Response) -> list[Any]:
    """Parse an SSE body: JSON payloads, and the literal "[DONE]"."""
    events: list[Any] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _stream(worker: Worker, path: str, body: dict[str, Any]) -> list[Any]:
    with httpx.stream("POST", f"{worker.url}{path}", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return _sse_events(r)


@pytest.fixture(scope="module")
def adapter_a(shared_worker: Worker, tiny_models: Any, tiny_adapter_factory: Any, place_adapter: Any) -> Path:
    path: Path = place_adapter(tiny_adapter_factory(tiny_models["llama"], rank=8, seed=11), "api-a")
    return path


@pytest.fixture(scope="module")
def adapter_b(shared_worker: Worker, tiny_models: Any, tiny_adapter_factory: Any, place_adapter: Any) -> Path:
    path: Path = place_adapter(tiny_adapter_factory(tiny_models["llama"], rank=16, seed=12), "api-b")
    return path


def test_probes_on_both_ports(shared_worker: Worker) -> None:
    for base in (shared_worker.url, shared_worker.system_url):
        assert httpx.get(f"{base}/health").json() == {"status": "healthy"}
        r = httpx.get(f"{base}/ready")
        assert r.status_code == 200 and r.json()["status"] == "ready"
    text = httpx.get(f"{shared_worker.system_url}/metrics").text
    for name in (
        "lorafleet_requests_total",
        "lorafleet_generation_tokens_total",
        "lorafleet_time_to_first_token_seconds_bucket",
        "lorafleet_inter_token_latency_seconds_bucket",
        "lorafleet_lora_load_seconds_bucket",
        "lorafleet_max_adapters_in_step",
        "lorafleet_queue_length",
        "lorafleet_lora_gpu_slots_used",
        "lorafleet_lora_cpu_resident",
        "lorafleet_max_loras 4.0",
    ):
        assert name in text, name


def test_load_list_unload_roundtrip(shared_worker: Worker, adapter_a: Path) -> None:
    name = "org/api-roundtrip"  # names may contain '/'
    base_text = shared_worker.complete("tiny-llama", PROMPT, max_tokens=8, ignore_eos=True)["choices"][0]["text"]

    body = shared_worker.load(name, adapter_a)
    assert body == {
        "status": "success",
        "message": body["message"],
        "lora_name": name,
        "lora_id": lora_id(name),
    }
    assert shared_worker.load(name, adapter_a)["lora_id"] == lora_id(name)  # idempotent
    assert shared_worker.loras()[name] == lora_id(name)
    listing = httpx.get(f"{shared_worker.system_url}/v1/loras", headers=shared_worker.admin_headers()).json()
    assert listing["status"] == "success" and listing["count"] == len(listing["loras"])
    assert listing["capacity"] is None  # no --max-loaded-loras: unlimited

    models = {m["id"]: m for m in httpx.get(f"{shared_worker.url}/v1/models").json()["data"]}
    assert models["tiny-llama"]["parent"] is None
    assert models[name]["parent"] == "tiny-llama" and models[name]["root"] == f"file://{adapter_a}"

    lora_text = shared_worker.complete(name, PROMPT, max_tokens=8, ignore_eos=True)["choices"][0]["text"]
    assert lora_text != base_text, "the adapter does not change the output"

    assert shared_worker.unload(name)["lora_id"] == lora_id(name)
    assert name not in shared_worker.loras()
    r = httpx.post(f"{shared_worker.url}/v1/completions", json={"model": name, "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and name in r.json()["error"]["message"]
    shared_worker.unload(name, expect=404)


def test_lora_id_matches_dynamo(shared_worker: Worker, adapter_a: Path) -> None:
    assert shared_worker.load("test_lora", adapter_a)["lora_id"] == 1983627077
    shared_worker.unload("test_lora")


def test_completion_length_usage_and_logprobs(shared_worker: Worker) -> None:
    out = shared_worker.complete(
        "tiny-llama", PROMPT, max_tokens=6, ignore_eos=True, logprobs=3, return_tokens_as_token_ids=True
    )
    choice = out["choices"][0]
    assert out["object"] == "text_completion" and out["model"] == "tiny-llama"
    assert choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 6
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + 6
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 6
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert token.startswith("token_id:") and logprob <= 0
        assert top[token] == pytest.approx(logprob, abs=1e-6)
        assert logprob == pytest.approx(max(top.values()), abs=1e-6)  # greedy picks the most likely token
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])

    # the text is the detokenized ids (checked against transformers' tokenizer)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(shared_worker.model_dir)
    ids = [int(t.split(":")[1]) for t in lp["tokens"]]
    assert choice["text"] == tok.decode(ids, skip_special_tokens=True)


def test_text_and_token_prompts_agree_with_transformers_tokenizer(shared_worker: Worker) -> None:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(shared_worker.model_dir).encode(PROMPT)
    by_text = shared_worker.complete("tiny-llama", PROMPT, max_tokens=5, ignore_eos=True)
    by_ids = shared_worker.complete("tiny-llama", ids, max_tokens=5, ignore_eos=True)
    assert by_text["usage"]["prompt_tokens"] == len(ids)
    assert by_text["choices"][0]["text"] == by_ids["choices"][0]["text"]


def test_stream_matches_non_stream_and_reports_usage(shared_worker: Worker, adapter_b: Path) -> None:
    shared_worker.load("api-stream", adapter_b)
    body: dict[str, Any] = {
        "model": "api-stream",
        "prompt": PROMPT,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
    }
    full = shared_worker.complete(**body)
    events = _stream(shared_worker, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    usage_chunk, chunks = events[-2], events[:-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == full["usage"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    shared_worker.unload("api-stream")


def test_stop_strings_cut_the_text(shared_worker: Worker) -> None:
    body: dict[str, Any] = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 24, "ignore_eos": True}
    text = shared_worker.complete(**body)["choices"][0]["text"]
    assert len(text) > 8, text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    expected = text[: text.find(stop)]

    out = shared_worker.complete(**body, stop=[stop, "\x00never"])["choices"][0]
    assert out["text"] == expected and out["finish_reason"] == "stop"
    events = _stream(shared_worker, "/v1/completions", {**body, "temperature": 0, "stop": stop})
    chunks = [e for e in events if e != "[DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_seeded_sampling_is_reproducible(shared_worker: Worker) -> None:
    body = {"max_tokens": 10, "temperature": 1.0, "top_p": 0.9, "top_k": 50, "ignore_eos": True}
    a = shared_worker.complete("tiny-llama", PROMPT, **body, seed=1234)["choices"][0]["text"]
    b = shared_worker.complete("tiny-llama", PROMPT, **body, seed=1234)["choices"][0]["text"]
    assert a == b


def test_chat_uses_the_chat_template(shared_worker: Worker) -> None:
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello, world!"}]
    tokenizer: Any = AutoTokenizer.from_pretrained(shared_worker.model_dir)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    expected = shared_worker.complete("tiny-llama", list(ids), max_tokens=8, ignore_eos=True)["choices"][0]["text"]

    body = {"model": "tiny-llama", "messages": messages, "max_completion_tokens": 8, "temperature": 0}
    r = httpx.post(f"{shared_worker.url}/v1/chat/completions", json={**body, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"] == {"role": "assistant", "content": expected}
    assert out["usage"]["prompt_tokens"] == len(ids)

    events = _stream(shared_worker, "/v1/chat/completions", {**body, "ignore_eos": True})
    chunks = [e for e in events if e != "[DONE]"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_logprobs(shared_worker: Worker) -> None:
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "ignore_eos": True,
    }
    out = httpx.post(f"{shared_worker.url}/v1/chat/completions", json=body, timeout=60).json()
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) >= 2
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"], abs=1e-6)


def test_vllm_compatible_load_and_unload(shared_worker: Worker, adapter_a: Path) -> None:
    headers = shared_worker.admin_headers()
    r = httpx.post(
        f"{shared_worker.url}/v1/load_lora_adapter",
        json={"lora_name": "vllm-style", "lora_path": str(adapter_a)},
        headers=headers,
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["lora_id"] == lora_id("vllm-style")
    assert "vllm-style" in shared_worker.loras()
    shared_worker.complete("vllm-style", PROMPT, max_tokens=2)
    r = httpx.post(
        f"{shared_worker.url}/v1/unload_lora_adapter", json={"lora_name": "vllm-style"}, headers=headers, timeout=60
    )
    assert r.status_code == 200, r.text
    r = httpx.post(
        f"{shared_worker.url}/v1/unload_lora_adapter", json={"lora_name": "vllm-style"}, headers=headers, timeout=60
    )
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_metrics_count_requests_and_tokens_per_adapter(shared_worker: Worker, adapter_a: Path) -> None:
    shared_worker.load("api-metrics", adapter_a)
    before = shared_worker.metrics()
    key_req = 'lorafleet_requests_total{model="api-metrics",outcome="success"}'
    key_tok = 'lorafleet_generation_tokens_total{model="api-metrics"}'
    for _ in range(2):
        shared_worker.complete("api-metrics", PROMPT, max_tokens=3, ignore_eos=True)
    after = shared_worker.metrics()
    assert after[key_req] - before.get(key_req, 0) == 2
    assert after[key_tok] - before.get(key_tok, 0) == 6
    assert after['lorafleet_lora_loads_total{outcome="success"}'] >= 1
    shared_worker.unload("api-metrics")


def test_help_lists_every_serve_flag() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "lorafleet_worker", "serve", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for flag in (
        "--model",
        "--served-model-name",
        "--host",
        "--port",
        "--system-port",
        "--device",
        "--dtype",
        "--max-loras",
        "--max-cpu-loras",
        "--max-lora-rank",
        "--max-num-seqs",
        "--max-model-len",
        "--lora-backend",
        "--lora-cache-dir",
        "--admin-token-file",
        "DYN_SYSTEM_PORT",
        "DYN_LORA_PATH",
    ):
        assert flag in out, flag
