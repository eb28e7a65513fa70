"""Every error class of SPEC §3 answers with its status and a clear message, and the worker keeps serving."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.worker.conftest import ADMIN_TOKEN, Worker, load_error


@pytest.fixture(autouse=True)
def still_serving(shared_worker: Worker) -> Iterator[None]:
    """After each error, the worker still answers inference and management calls."""
    yield
    assert shared_worker.proc.poll() is None, shared_worker.log_tail()
    out = shared_worker.complete("tiny-llama", "Hello", max_tokens=2)
    assert out["usage"]["completion_tokens"] >= 1
    shared_worker.loras()


@pytest.fixture(scope="module")
def good_adapter(tiny_models: Any, tiny_adapter_factory: Any) -> Path:
    path: Path = tiny_adapter_factory(tiny_models["llama"], rank=8, seed=31)
    return path


def _variant(worker: Worker, src: Path, name: str) -> Path:
    """A fresh copy of `src` under the worker's allowed root, to be damaged by the test."""
    dst = worker.file_root / name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


def _openai_error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    message: str = err["message"]
    return message


# --- inference API ------------------------------------------------------------------------------------


def test_malformed_json_is_400(shared_worker: Worker) -> None:
    r = httpx.post(
        f"{shared_worker.url}/v1/completions",
        content=b'{"model": "tiny-llama", "prompt": ',
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert "JSON" in _openai_error(r, 400)
    r = httpx.post(
        f"{shared_worker.system_url}/v1/loras",
        content=b"{not json",
        headers={**shared_worker.admin_headers(), "content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["status"] == "error" and "JSON" in r.json()["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x"}, "model"),
        ({"model": "tiny-llama", "prompt": "x", "temperature": -1}, "temperature"),
        ({"model": "tiny-llama", "prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"model": "tiny-llama", "prompt": "x", "n": 0}, "n"),
        ({"model": "tiny-llama", "prompt": ["x"] * 20, "n": 10}, "n"),
        ({"model": "tiny-llama", "prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"model": "tiny-llama", "prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"model": "tiny-llama", "prompt": "x", "logit_bias": {"10000000": 1}}, "logit_bias"),
        ({"model": "tiny-llama", "prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
        ({"model": "tiny-llama", "prompt": "x", "min_p": 2}, "min_p"),
        ({"model": "tiny-llama", "prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"model": "tiny-llama", "prompt": "x", "presence_penalty": 3}, "presence_penalty"),
        ({"model": "tiny-llama", "prompt": "x", "suffix": "y"}, "suffix"),
        ({"model": "tiny-llama", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"model": "tiny-llama", "prompt": "x", "logprobs": 50}, "logprobs"),
        ({"model": "tiny-llama", "prompt": [10**9]}, "prompt"),
        ({"model": "tiny-llama", "prompt": "x", "max_tokens": 10**7}, "max_tokens"),
    ],
)
def test_bad_fields_are_400(shared_worker: Worker, body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{shared_worker.url}/v1/completions", json=body, timeout=30)
    assert param in _openai_error(r, 400)


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_model_is_404_in_openai_shape(shared_worker: Worker, stream: bool) -> None:
    for path, extra in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        body = {"model": "ghost", "stream": stream, **extra}
        r = httpx.post(f"{shared_worker.url}{path}", json=body, timeout=30)
        assert "ghost" in _openai_error(r, 404)
        assert r.json()["error"]["code"] == "model_not_found"


def test_unknown_route_and_method(shared_worker: Worker) -> None:
    assert _openai_error(httpx.get(f"{shared_worker.url}/v1/nothing-here"), 404)
    assert _openai_error(httpx.get(f"{shared_worker.url}/v1/completions"), 405)
    r = httpx.get(f"{shared_worker.system_url}/v1/nothing-here")
    assert r.status_code == 404 and r.json()["status"] == "error"


# --- adapter validation (400) -------------------------------------------------------------------------


def test_corrupt_safetensors(shared_worker: Worker, good_adapter: Path) -> None:
    bad = _variant(shared_worker, good_adapter, "err-corrupt")
    (bad / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a safetensors file")
    assert "corrupt" in load_error(shared_worker, "err-corrupt", f"file://{bad}", 400)


def test_shape_mismatch(shared_worker: Worker, good_adapter: Path) -> None:
    bad = _variant(shared_worker, good_adapter, "err-shape")
    weights = load_file(bad / "adapter_model.safetensors")
    key = next(k for k in sorted(weights) if "q_proj.lora_A" in k)
    weights[key] = torch.cat([weights[key], weights[key][:, :8]], dim=1)  # in_dim + 8
    save_file(weights, bad / "adapter_model.safetensors")
    assert "shape mismatch" in load_error(shared_worker, "err-shape", f"file://{bad}", 400)


def test_dora(shared_worker: Worker, tiny_models: Any, tiny_adapter_factory: Any) -> None:
    src = tiny_adapter_factory(tiny_models["llama"], rank=4, seed=32, use_dora=True)
    bad = _variant(shared_worker, src, "err-dora")
    assert "DoRA" in load_error(shared_worker, "err-dora", f"file://{bad}", 400)


def test_modules_to_save(shared_worker: Worker, tiny_models: Any, tiny_adapter_factory: Any) -> None:
    src = tiny_adapter_factory(tiny_models["llama"], rank=4, seed=33, modules_to_save=["lm_head"])
    bad = _variant(shared_worker, src, "err-mts")
    assert "modules_to_save" in load_error(shared_worker, "err-mts", f"file://{bad}", 400)


def test_rank_above_max(shared_worker: Worker, tiny_models: Any, tiny_adapter_factory: Any) -> None:
    src = tiny_adapter_factory(tiny_models["llama"], rank=96, seed=34, targets=["q_proj"])
    bad = _variant(shared_worker, src, "err-rank")
    assert "maximum LoRA rank 64" in load_error(shared_worker, "err-rank", f"file://{bad}", 400)


def test_missing_adapter_config(shared_worker: Worker, good_adapter: Path) -> None:
    bad = _variant(shared_worker, good_adapter, "err-noconfig")
    (bad / "adapter_config.json").unlink()
    assert "adapter_config.json" in load_error(shared_worker, "err-noconfig", f"file://{bad}", 400)


def test_unsupported_target_module(shared_worker: Worker, good_adapter: Path) -> None:
    bad = _variant(shared_worker, good_adapter, "err-target")
    config = json.loads((bad / "adapter_config.json").read_text())
    config["target_modules"] = ["embed_tokens"]
    (bad / "adapter_config.json").write_text(json.dumps(config))
    assert "embed" in load_error(shared_worker, "err-target", f"file://{bad}", 400)


# --- sources, names, auth --------------------------------------------------------------------------------


def test_path_outside_allowed_roots(shared_worker: Worker, good_adapter: Path) -> None:
    assert not good_adapter.is_relative_to(shared_worker.file_root)
    message = load_error(shared_worker, "err-outside", f"file://{good_adapter}", 400)
    assert "outside the allowed roots" in message
    traversal = f"file://{shared_worker.file_root}/../../etc"
    load_error(shared_worker, "err-traversal", traversal, 400)
    r = httpx.post(
        f"{shared_worker.url}/v1/load_lora_adapter",
        json={"lora_name": "err-outside", "lora_path": str(good_adapter)},
        headers=shared_worker.admin_headers(),
        timeout=30,
    )
    assert "outside the allowed roots" in _openai_error(r, 400)


def test_bad_uri_and_missing_directory(shared_worker: Worker) -> None:
    load_error(shared_worker, "err-scheme", "ftp://example.com/adapter", 400)
    load_error(shared_worker, "err-missing", f"file://{shared_worker.file_root}/does-not-exist", 400)


@pytest.mark.parametrize("name", ["", "a" * 129, "bad..name", "spaces are bad", "semi;colon"])
def test_invalid_lora_name(shared_worker: Worker, good_adapter: Path, name: str) -> None:
    r = httpx.post(
        f"{shared_worker.system_url}/v1/loras",
        json={"lora_name": name, "source": {"uri": f"file://{good_adapter}"}},
        headers=shared_worker.admin_headers(),
        timeout=30,
    )
    assert r.status_code == 400 and "lora_name" in r.json()["message"]


def test_unload_unknown_is_404(shared_worker: Worker) -> None:
    r = httpx.delete(f"{shared_worker.system_url}/v1/loras/org/ghost", headers=shared_worker.admin_headers())
    assert r.status_code == 404 and r.json() == {"status": "error", "message": r.json()["message"]}
    assert "org/ghost" in r.json()["message"]


def test_admin_token(shared_worker: Worker, good_adapter: Path) -> None:
    uri = f"file://{good_adapter}"
    assert "admin token" in load_error(shared_worker, "err-auth", uri, 401, headers={})
    wrong = shared_worker.admin_headers("wrong-token-xyz123")
    assert "admin token" in load_error(shared_worker, "err-auth", uri, 403, headers=wrong)
    url = shared_worker.system_url
    assert httpx.get(f"{url}/v1/loras").status_code == 401
    assert httpx.get(f"{url}/v1/loras", headers={"Authorization": "Bearer nope"}).status_code == 403
    assert httpx.delete(f"{url}/v1/loras/x", headers={"Authorization": "Basic abc"}).status_code == 401
    r = httpx.post(f"{shared_worker.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"})
    assert _openai_error(r, 401)
    r = httpx.post(
        f"{shared_worker.url}/v1/unload_lora_adapter",
        json={"lora_name": "x"},
        headers=shared_worker.admin_headers("no"),
    )
    assert _openai_error(r, 403)
    # probes and inference stay open
    assert httpx.get(f"{url}/metrics").status_code == 200
    log = shared_worker.log_path.read_text()
    assert "wrong-token-xyz123" not in log and ADMIN_TOKEN not in log  # tokens never reach the logs


async def test_lora_disabled_refuses_loads(tmp_path: Path) -> None:
    """DYN_LORA_ENABLED=false: loads are refused with a clear 400 (checked in-process, no engine needed)."""
    from lorafleet_worker.api.protocol import APIError
    from lorafleet_worker.service import WorkerService, WorkerSettings

    service = WorkerService(WorkerSettings(model_dir=tmp_path, served_model_name="m", lora_enabled=False))
    with pytest.raises(APIError) as info:
        await service.load_adapter("a", "file:///x")
    assert info.value.status == 400 and "DYN_LORA_ENABLED" in info.value.message


def test_failed_hot_swap_keeps_the_old_adapter(shared_worker: Worker, good_adapter: Path) -> None:
    """Bad input loses nothing: a swap to a broken adapter leaves the loaded one serving."""
    good = _variant(shared_worker, good_adapter, "swap-good")
    bad = _variant(shared_worker, good_adapter, "swap-bad")
    (bad / "adapter_config.json").unlink()
    shared_worker.load("err-swap", good)
    before = shared_worker.complete("err-swap", "Hello", max_tokens=4, ignore_eos=True)["choices"][0]["text"]
    r = httpx.post(
        f"{shared_worker.system_url}/v1/loras",
        json={"lora_name": "err-swap", "source": {"uri": f"file://{bad}"}},
        headers=shared_worker.admin_headers(),
        timeout=60,
    )
    assert r.status_code == 400 and "adapter_config.json" in r.json()["message"]
    assert "err-swap" in shared_worker.loras()
    models = {m["id"]: m["root"] for m in httpx.get(f"{shared_worker.url}/v1/models").json()["data"]}
    assert models["err-swap"] == f"file://{good}"
    after = shared_worker.complete("err-swap", "Hello", max_tokens=4, ignore_eos=True)["choices"][0]["text"]
    assert after == before
    shared_worker.unload("err-swap")


# --- management bodies: every field has its effect ------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"lora_name": "err-extra", "source": {"uri": "file:///x"}, "priority": 1}, "priority"),
        ({"lora_name": "err-extra", "source": {"uri": "file:///x", "revision": "main"}}, "source.revision"),
    ],
)
def test_unknown_management_field_is_refused_naming_it(shared_worker: Worker, body: dict[str, Any], field: str) -> None:
    r = httpx.post(f"{shared_worker.system_url}/v1/loras", json=body, headers=shared_worker.admin_headers())
    assert r.status_code == 400 and r.json()["status"] == "error"
    assert f"{field}: unsupported field" in r.json()["message"]
    r = httpx.post(
        f"{shared_worker.url}/v1/load_lora_adapter",
        json={"lora_name": "err-extra", "lora_path": "/x", "base_model_name": "tiny-llama"},
        headers=shared_worker.admin_headers(),
    )
    assert "base_model_name: unsupported field" in _openai_error(r, 400)
    assert "err-extra" not in shared_worker.loras()


def test_vllm_load_inplace_decides_whether_a_loaded_name_is_replaced(
    shared_worker: Worker, good_adapter: Path, tiny_models: Any, tiny_adapter_factory: Any
) -> None:
    first = _variant(shared_worker, good_adapter, "inplace-a")
    second = _variant(shared_worker, tiny_adapter_factory(tiny_models["llama"], rank=8, seed=32), "inplace-b")

    def load(path: Path, **extra: Any) -> httpx.Response:
        body = {"lora_name": "inplace", "lora_path": str(path), **extra}
        return httpx.post(
            f"{shared_worker.url}/v1/load_lora_adapter", json=body, headers=shared_worker.admin_headers(), timeout=120
        )

    assert load(first).status_code == 200
    before = shared_worker.complete("inplace", "Hello", max_tokens=4)["choices"][0]["text"]
    assert load(first).status_code == 200  # the same path again: a no-op
    message = _openai_error(load(second), 400)
    assert "already loaded" in message and "load_inplace" in message
    assert shared_worker.complete("inplace", "Hello", max_tokens=4)["choices"][0]["text"] == before
    r = load(second, load_inplace=True)
    assert r.status_code == 200 and "swapped" in r.json()["message"]
    swapped = {"lora_name": "inplace", "source": {"uri": f"file://{second}"}}
    assert (
        httpx.post(
            f"{shared_worker.system_url}/v1/loras", json=swapped, headers=shared_worker.admin_headers(), timeout=120
        )
        .json()["message"]
        .endswith("already loaded")
    )
    shared_worker.unload("inplace")


def test_metrics_carry_no_created_samples(shared_worker: Worker) -> None:
    shared_worker.complete("tiny-llama", "Hello", max_tokens=2)
    samples = shared_worker.metrics()
    assert any(key.startswith("vllm:prompt_tokens_total") for key in samples)
    assert not [key for key in samples if key.split("{")[0].endswith("_created")]
