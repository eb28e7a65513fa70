"""Inference API (port 8000, OpenAI-compatible) plus vLLM's load/unload endpoints."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Header, Request
from fastapi.responses import StreamingResponse

from lorafleet_worker.generation import ClientDisconnected, Delta, Generation, TokenInfo, new_request_id
from lorafleet_worker.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    VllmLoadLoraRequest,
    VllmUnloadLoraRequest,
    _SamplingBody,
    openai_error_body,
)
from lorafleet_worker.server_common import add_probe_routes, install_error_handlers, wait_for_disconnect
from lorafleet_worker.server_management import success_body
from lorafleet_worker.service import WorkerService, path_to_uri
from lorafleet_worker.tokenizer import TokenizerError

log = logging.getLogger(__name__)

Chunk = dict[str, Any]


# --- request -> engine ------------------------------------------------------------------------------


def _prompt_ids(service: WorkerService, prompt: str | list[str] | list[int] | list[list[int]]) -> list[int]:
    """A completion prompt (text or token ids; one prompt per request) as token ids."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise APIError(400, "batched prompts are not supported; send one prompt per request", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = service.tokenizer.encode(prompt)
    else:
        ids = list(prompt)  # type: ignore[arg-type]
        vocab = service.engine.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    return ids


def _sampling_params(
    service: WorkerService, body: _SamplingBody, prompt_len: int, max_tokens: int | None, logprobs: int | None
) -> Any:
    from lorafleet_worker.sampling import SamplingParams

    limit = service.max_model_len
    room = limit - prompt_len
    if room <= 0:
        raise APIError(400, f"the prompt has {prompt_len} tokens; this model's context is {limit}", param="prompt")
    if max_tokens is not None and max_tokens > room:
        raise APIError(
            400,
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context length {limit}",
            param="max_tokens",
        )
    top_k = body.top_k if body.top_k and body.top_k > 0 else 0
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else min(room, body.default_max_tokens or room),
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=top_k,
        seed=body.seed,
        logprobs=logprobs,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
    )


async def _generation(
    service: WorkerService,
    request: Request,
    body: _SamplingBody,
    prompt_ids: list[int],
    max_tokens: int | None,
    logprobs: int | None,
) -> Generation:
    body.check_supported()
    adapter = service.resolve_model(body.model)
    params = _sampling_params(service, body, len(prompt_ids), max_tokens, logprobs)
    gen = Generation(
        service,
        model=body.model,
        adapter=adapter,
        prompt_ids=prompt_ids,
        params=params,
        stop=body.stop_strings(),
        disconnected=lambda: wait_for_disconnect(request),
    )
    await gen.start()
    return gen


# --- response shapes --------------------------------------------------------------------------------


class _Shaper:
    """Builds OpenAI response objects for one request (completions or chat)."""

    def __init__(self, service: WorkerService, gen: Generation, *, chat: bool, token_ids_as_text: bool = False) -> None:
        self.chat = chat
        self.gen = gen
        self.id = new_request_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self._tokenizer = service.tokenizer
        self._token_ids_as_text = token_ids_as_text

    def token_str(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self._token_ids_as_text else self._tokenizer.token_text(token_id)

    def logprobs(self, tokens: list[TokenInfo]) -> dict[str, Any]:
        if self.chat:
            return {"content": [self._chat_logprob(t) for t in tokens]}
        return {
            "tokens": [self.token_str(t.token_id) for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [
                None if t.top_logprobs is None else {self.token_str(i): lp for i, lp in t.top_logprobs.items()}
                for t in tokens
            ],
            "text_offset": [t.text_offset for t in tokens],
        }

    def _chat_logprob(self, t: TokenInfo) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token_str(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        top = sorted((t.top_logprobs or {}).items(), key=lambda kv: -kv[1])
        return {**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in top]}

    def usage(self) -> dict[str, int]:
        p, c = self.gen.prompt_tokens, self.gen.completion_tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _envelope(self, choices: list[dict[str, Any]], *, chunk: bool) -> Chunk:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.gen.model, "choices": choices}

    def response(self, d: Delta, want_logprobs: bool) -> Chunk:
        choice: dict[str, Any] = {"index": 0, "finish_reason": d.finish_reason}
        choice["logprobs"] = self.logprobs(d.tokens) if want_logprobs else None
        if self.chat:
            choice["message"] = {"role": "assistant", "content": d.text}
        else:
            choice["text"] = d.text
        return {**self._envelope([choice], chunk=False), "usage": self.usage()}

    def chunk(self, d: Delta, want_logprobs: bool, delta_extra: dict[str, Any] | None = None) -> Chunk:
        choice: dict[str, Any] = {"index": 0, "finish_reason": d.finish_reason}
        choice["logprobs"] = self.logprobs(d.tokens) if want_logprobs and d.tokens else None
        if self.chat:
            choice["delta"] = {**(delta_extra or {}), **({"content": d.text} if d.text else {})}
        else:
            choice["text"] = d.text
        return self._envelope([choice], chunk=True)

    def usage_chunk(self) -> Chunk:
        return {**self._envelope([], chunk=True), "usage": self.usage()}


def _sse(data: Chunk | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def _stream(shaper: _Shaper, want_logprobs: bool, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: one chunk per delta, the usage chunk if asked, then `[DONE]`."""
    try:
        if shaper.chat:
            yield _sse(shaper.chunk(Delta(""), False, {"role": "assistant", "content": ""}))
        async for d in shaper.gen.deltas():
            yield _sse(shaper.chunk(d, want_logprobs))
        if include_usage:
            yield _sse(shaper.usage_chunk())
        yield _sse("[DONE]")
    except ClientDisconnected:
        log.info("stream %s: client disconnected, request aborted", shaper.id)
    except Exception as e:  # the status line is already sent; report in-band like vLLM
        log.exception("stream %s failed", shaper.id)
        yield _sse(openai_error_body(APIError(500, f"internal error: {type(e).__name__}")))
        yield _sse("[DONE]")


async def _respond(shaper: _Shaper, body: _SamplingBody, want_logprobs: bool) -> Any:
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(shaper, want_logprobs, include_usage), media_type="text/event-stream")
    return shaper.response(await shaper.gen.collect(), want_logprobs)


# --- app --------------------------------------------------------------------------------------------


def build_inference_app(service: WorkerService) -> FastAPI:
    app = FastAPI(title="lorafleet worker (OpenAI-compatible API)", docs_url=None, redoc_url=None)
    install_error_handlers(app, openai_error_body)
    add_probe_routes(app, service)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        prompt_ids = _prompt_ids(service, body.prompt)
        gen = await _generation(service, request, body, prompt_ids, body.max_tokens, body.logprobs)
        shaper = _Shaper(service, gen, chat=False, token_ids_as_text=body.return_tokens_as_token_ids)
        return await _respond(shaper, body, body.logprobs is not None)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            prompt_ids = service.tokenizer.encode_chat(messages, add_generation_prompt=body.add_generation_prompt)
        except TokenizerError as e:
            raise APIError(400, str(e), param="messages") from e
        top = (body.top_logprobs or 0) if body.logprobs else None
        gen = await _generation(service, request, body, prompt_ids, body.max_completion_tokens or body.max_tokens, top)
        return await _respond(_Shaper(service, gen, chat=True), body, body.logprobs)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        created = int(time.time())
        card: Callable[..., dict[str, Any]] = lambda model_id, root, parent: {  # noqa: E731
            "id": model_id,
            "object": "model",
            "created": created,
            "owned_by": "lorafleet",
            "root": root,
            "parent": parent,
        }
        base = card(service.model_name, str(service.settings.model_dir), None)
        if service.ready:
            base["max_model_len"] = service.max_model_len
        adapters = [card(name, uri, service.model_name) for name, uri in service.adapter_uris().items()]
        return {"object": "list", "data": [base, *adapters]}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(
        body: VllmLoadLoraRequest, authorization: str | None = Header(default=None)
    ) -> dict[str, Any]:
        service.check_admin(authorization)
        return success_body(await service.load_adapter(body.lora_name, path_to_uri(body.lora_path)))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(
        body: VllmUnloadLoraRequest, authorization: str | None = Header(default=None)
    ) -> dict[str, Any]:
        service.check_admin(authorization)
        return success_body(await service.unload_adapter(body.lora_name))

    return app
