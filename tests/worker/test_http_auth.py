"""A worker started with `--api-key` (vLLM's flag): `/v1/*` on the inference port needs `Authorization: Bearer
<key>` and answers OpenAI's 401 shape without it; `/health`, `/ready`, `/metrics` and `/version` stay open; the
management port keeps its own admin token; the `openai` client with the key works. The key comes from
`--api-key`, `$LORAFLEET_API_KEY` or vLLM's `$VLLM_API_KEY`, and never shows in the settings' repr or the log."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from lorafleet_worker.cli import build_parser
from lorafleet_worker.settings import WorkerSettings

from tests.worker.conftest import ADMIN_TOKEN, Worker, start_worker, stop_worker

KEY = "sk-test-inference-key-0123456789"
MODEL = "tiny-auth"


@pytest.fixture(scope="module")
def worker(tiny_models: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    w = start_worker(
        tiny_models["llama"], tmp_path_factory.mktemp("auth_worker"), name=MODEL, admin_token=ADMIN_TOKEN,
        args=["--api-key", KEY],
    )  # fmt: skip
    yield w
    stop_worker(w)


def _completion(worker: Worker, headers: dict[str, str]) -> httpx.Response:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "ignore_eos": True}
    return httpx.post(f"{worker.url}/v1/completions", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize(
    ("headers", "code"),
    [({}, None), ({"Authorization": "Bearer wrong-key"}, "invalid_api_key"), ({"Authorization": KEY}, None)],
    ids=["none", "wrong", "no-bearer-scheme"],
)
def test_v1_without_the_key_is_a_401_in_openais_shape(worker: Worker, headers: dict[str, str], code: Any) -> None:
    r = _completion(worker, headers)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == code
    assert "wrong-key" not in error["message"]
    assert httpx.get(f"{worker.url}/v1/models", timeout=10).status_code == 401


def test_the_key_opens_v1(worker: Worker) -> None:
    r = _completion(worker, {"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_probes_metrics_and_version_stay_open(worker: Worker) -> None:
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{worker.url}{path}", timeout=10).status_code == 200, path
    assert httpx.get(f"{worker.url}/version", timeout=10).status_code != 401  # outside /v1, as in vLLM
    assert httpx.get(f"{worker.system_url}/ready", timeout=10).status_code == 200


def test_the_management_api_keeps_its_admin_token(worker: Worker) -> None:
    as_key = httpx.get(f"{worker.system_url}/v1/loras", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert as_key.status_code in (401, 403)
    assert httpx.get(f"{worker.system_url}/v1/loras", headers=worker.admin_headers(), timeout=10).status_code == 200


def test_the_openai_client_with_the_key(worker: Worker) -> None:
    with openai.OpenAI(base_url=f"{worker.url}/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        assert MODEL in {m.id for m in client.models.list()}
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_body={"ignore_eos": True}
        )
        assert out.usage is not None and out.usage.completion_tokens == 2
    wrong = openai.OpenAI(base_url=f"{worker.url}/v1", api_key="wrong", max_retries=0, timeout=60)
    with wrong, pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt="Hi", max_tokens=2)


def test_the_key_is_not_in_the_log(worker: Worker) -> None:
    _completion(worker, {"Authorization": "Bearer wrong-key"})
    text = worker.log_path.read_text(errors="replace")
    assert KEY not in text and "wrong-key" not in text


def _settings(argv: list[str], model: Path) -> WorkerSettings:
    return WorkerSettings.from_args(build_parser().parse_args(["serve", "--model", str(model), *argv]))


def test_the_key_comes_from_the_flag_or_the_variables(tiny_models: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_models["llama"]
    monkeypatch.delenv("LORAFLEET_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert _settings([], model).api_key is None
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert _settings([], model).api_key == "from-vllm"
    monkeypatch.setenv("LORAFLEET_API_KEY", "from-lorafleet")
    assert _settings([], model).api_key == "from-lorafleet"
    settings = _settings(["--api-key", "from-flag"], model)
    assert settings.api_key == "from-flag" and "from-flag" not in repr(settings)
