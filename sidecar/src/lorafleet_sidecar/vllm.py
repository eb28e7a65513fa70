"""Client of a vLLM OpenAI server's adapter endpoints: ``GET /health``, ``GET /v1/models`` (what it holds),
``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``.

vLLM serves the last two only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (and ``--enable-lora``). Every
failure is a :class:`VllmError` with the HTTP status the management API should answer: vLLM's own 4xx as it
is, 503 when vLLM cannot be reached or is not serving yet, 504 when it did not answer in time.
"""

from __future__ import annotations

import json as jsonlib
from typing import Any

import aiohttp


class VllmError(Exception):
    """A failed call to vLLM: ``status`` for the management API's answer, vLLM's message (or why it failed)."""

    def __init__(self, status: int, message: str, *, vllm_status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.vllm_status = vllm_status  # vLLM's own HTTP status (None: no answer)


class VllmClient:
    """Talks to one vLLM server at ``url`` (``http://127.0.0.1:8000`` in the pod)."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 120.0) -> None:
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self._headers, timeout=self._timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def healthy(self) -> bool:
        """vLLM's ``/health`` answers 200 (its engine is up)."""
        try:
            await self._call("GET", "/health", timeout=aiohttp.ClientTimeout(total=5))
        except VllmError:
            return False
        return True

    async def adapters(self) -> dict[str, str]:
        """The adapters vLLM serves (``/v1/models`` entries with a ``parent``), name -> the path it loaded."""
        data = await self._call("GET", "/v1/models")
        models = data.get("data") if isinstance(data, dict) else None
        if not isinstance(models, list):
            raise VllmError(502, f"vLLM at {self.url}: malformed /v1/models answer")
        return {str(m["id"]): str(m.get("root") or "") for m in models if isinstance(m, dict) and m.get("parent")}

    async def load(self, name: str, path: str, *, inplace: bool) -> None:
        """``POST /v1/load_lora_adapter``; ``inplace`` replaces the weights of a name vLLM already serves (a hot
        swap under the same name, vLLM's ``load_inplace``)."""
        body = {"lora_name": name, "lora_path": path, "load_inplace": inplace}
        await self._call("POST", "/v1/load_lora_adapter", json=body)

    async def unload(self, name: str) -> None:
        """``POST /v1/unload_lora_adapter``: vLLM refuses new requests naming it (404 when it does not serve it)."""
        await self._call("POST", "/v1/unload_lora_adapter", json={"lora_name": name})

    async def _call(
        self, method: str, path: str, *, json: Any = None, timeout: aiohttp.ClientTimeout | None = None
    ) -> Any:
        url = self.url + path
        try:
            async with self._http().request(method, url, json=json, timeout=timeout or self._timeout) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    raise VllmError(_status(resp.status), _message(resp.status, text), vllm_status=resp.status)
                if resp.content_type == "application/json":
                    return await resp.json()
                return text
        except TimeoutError:
            raise VllmError(504, f"vLLM at {self.url} did not answer {method} {path} in time") from None
        except aiohttp.ClientError as e:
            raise VllmError(503, f"vLLM at {self.url} is not reachable ({type(e).__name__}: {e})") from None


def _status(vllm_status: int) -> int:
    """The management API's status for vLLM's: its 5xx while loading means the adapter could not be loaded
    (vLLM answers 500 for a rank above --max-lora-rank, unsupported modules, unreadable weights): 400, final;
    503 (not serving yet) stays 503; a 404 stays 404 (it names an adapter vLLM does not serve)."""
    if vllm_status == 503:
        return 503
    return 400 if vllm_status >= 500 or vllm_status in (400, 422) else vllm_status


def _message(status: int, text: str) -> str:
    """vLLM's error message (``{"error": {"message"}}`` or ``{"message"}``), else its body."""
    try:
        data = jsonlib.loads(text)
    except ValueError:
        return f"vLLM answered {status}: {text.strip()[:500]}"
    if isinstance(data, dict):
        inner = data.get("error") if isinstance(data.get("error"), dict) else data
        if isinstance(inner, dict) and inner.get("message"):
            return f"vLLM: {inner['message']}"
    return f"vLLM answered {status}: {text.strip()[:500]}"
