"""Inference API (port 8000, OpenAI-compatible) plus vLLM's load/unload endpoints."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Header, Request
from fastapi.responses import StreamingResponse

from lorafleet_worker.generation import ClientDisconnected, Delta, Generation, TokenInfo, new_request_id
from lorafleet_worker.protocol import (
    MAX_CHOICES,
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


def _prompt_ids(service: WorkerService, prompt: str | list[int]) -> list[int]:
    """One completion prompt (text or token ids) as token ids."""
    if isinstance(prompt, str):
        ids = service.tokenizer.encode(prompt)
    else:
        ids = list(prompt)
        vocab = service.engine.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    return ids


def _sampling_params(
    service: WorkerService,
    body: _SamplingBody,
    prompt_len: int,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
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
    max_tokens = max_tokens if max_tokens is not None else min(room, body.default_max_tokens or room)
    if body.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({body.min_tokens}) exceeds max_tokens ({max_tokens})", param="min_tokens")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k if body.top_k and body.top_k > 0 else 0,
        min_p=body.min_p,
        seed=body.seed,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        logit_bias=body.token_bias(service.engine.config.vocab_size),
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
    )


@dataclass
class Choice:
    """One choice of a response: its generation and, for echo, the prompt shown before the completion."""

    index: int
    gen: Generation
    echo_text: str = ""
    echo_tokens: list[TokenInfo] = field(default_factory=list)


async def _start_choices(
    service: WorkerService,
    request: Request,
    body: _SamplingBody,
    prompts: list[list[int]],
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> list[Choice]:
    """`n` generations per prompt (choice index = prompt x n + j; seed + j as vLLM), all submitted at once."""
    body.check_supported()
    if len(prompts) * body.n > MAX_CHOICES:
        raise APIError(400, f"at most {MAX_CHOICES} choices (prompts x n) per request", param="n")
    adapter = service.resolve_model(body.model)
    gens = []
    for ids in prompts:
        params = _sampling_params(service, body, len(ids), max_tokens, logprobs, prompt_logprobs)
        for j in range(body.n):
            choice_params = dataclasses.replace(params, seed=None if body.seed is None else body.seed + j)
            gens.append(
                Generation(
                    service,
                    model=body.model,
                    adapter=adapter,
                    prompt_ids=ids,
                    params=choice_params,
                    stop=body.stop_strings(),
                    disconnected=lambda: wait_for_disconnect(request),
                )
            )
    results = await asyncio.gather(*(g.start() for g in gens), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for g in gens:
            await g.close()
        raise errors[0]
    return [Choice(i, g) for i, g in enumerate(gens)]


def _add_echo(service: WorkerService, choices: list[Choice], prompts: list[str] | list[list[int]], n: int) -> None:
    """Put each prompt (text, and its tokens with logprobs when scored) before its choices' completions."""
    tok = service.tokenizer
    for c in choices:
        prompt = prompts[c.index // n]
        c.echo_text = prompt if isinstance(prompt, str) else tok.decode(prompt)
        scores = c.gen.prompt_logprobs
        if scores is None:
            continue
        ids = c.gen.prompt_ids
        offset = 0
        for i, token_id in enumerate(ids):
            lp, top = (None, None) if i == 0 else scores[i - 1]
            c.echo_tokens.append(TokenInfo(token_id, lp, top, offset))
            offset += len(tok.token_text(token_id))


# --- response shapes --------------------------------------------------------------------------------


class _Shaper:
    """Builds OpenAI response objects for one request (completions or chat) and its choices."""

    def __init__(
        self,
        service: WorkerService,
        body: _SamplingBody,
        choices: list[Choice],
        *,
        chat: bool,
        want_logprobs: bool,
        token_ids_as_text: bool = False,
    ) -> None:
        self.chat = chat
        self.choices = choices
        self.model = body.model
        self.n = body.n
        self.want_logprobs = want_logprobs
        opts = body.stream_options
        self.include_usage = bool(opts and opts.include_usage)
        self.continuous_usage = bool(opts and opts.include_usage and opts.continuous_usage_stats)
        self.id = new_request_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self._tokenizer = service.tokenizer
        self._token_ids_as_text = token_ids_as_text

    def token_str(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self._token_ids_as_text else self._tokenizer.token_text(token_id)

    def logprobs(self, tokens: list[TokenInfo], offset: int = 0) -> dict[str, Any]:
        if self.chat:
            return {"content": [self._chat_logprob(t) for t in tokens]}
        return {
            "tokens": [self.token_str(t.token_id) for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [
                None if t.top_logprobs is None else {self.token_str(i): lp for i, lp in t.top_logprobs.items()}
                for t in tokens
            ],
            "text_offset": [t.text_offset + offset for t in tokens],
        }

    def _chat_logprob(self, t: TokenInfo) -> dict[str, Any]:
        def entry(token_id: int, logprob: float | None) -> dict[str, Any]:
            text = self.token_str(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        top = sorted((t.top_logprobs or {}).items(), key=lambda kv: -kv[1])
        return {**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in top]}

    def usage(self) -> dict[str, int]:
        """Prompt tokens once per prompt (not per choice), completion tokens of every choice."""
        p = sum(c.gen.prompt_tokens for c in self.choices if c.index % self.n == 0)
        g = sum(c.gen.completion_tokens for c in self.choices)
        return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}

    def _envelope(self, choices: list[dict[str, Any]], *, chunk: bool) -> Chunk:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _choice(self, c: Choice, d: Delta, *, first: bool) -> dict[str, Any]:
        """The choice object of one delta; a completion's first delta carries the echoed prompt."""
        text, tokens = d.text, d.tokens
        logprobs = self.logprobs(tokens, len(c.echo_text)) if self.want_logprobs else None
        if first and c.echo_text:
            text = c.echo_text + text
            if logprobs is not None:
                echo = self.logprobs(c.echo_tokens)
                logprobs = {k: echo[k] + logprobs[k] for k in echo}
        choice: dict[str, Any] = {"index": c.index}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = d.finish_reason
        return choice

    def response(self, results: list[Delta]) -> Chunk:
        choices = [self._choice(c, d, first=True) for c, d in zip(self.choices, results, strict=True)]
        return {**self._envelope(choices, chunk=False), "usage": self.usage()}

    def chunk(self, c: Choice, d: Delta, *, first: bool) -> Chunk:
        choice = self._choice(c, d, first=first)
        if not (d.tokens or (first and c.echo_tokens)):
            choice["logprobs"] = None
        if self.chat:
            content = choice.pop("message")["content"]
            choice = {"index": c.index, "delta": {"content": content} if content else {}, **choice}
        out = self._envelope([choice], chunk=True)
        if self.continuous_usage:
            out["usage"] = self.usage()
        return out

    def role_chunk(self, c: Choice) -> Chunk:
        choice = {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
        return self._envelope([{**choice, "finish_reason": None}], chunk=True)

    def usage_chunk(self) -> Chunk:
        return {**self._envelope([], chunk=True), "usage": self.usage()}


def _sse(data: Chunk | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def _merged_deltas(choices: list[Choice]) -> AsyncIterator[tuple[Choice, Delta]]:
    """The deltas of every choice as they come (one task per choice; the first error is raised)."""
    if len(choices) == 1:
        async for d in choices[0].gen.deltas():
            yield choices[0], d
        return
    queue: asyncio.Queue[tuple[Choice, Delta] | Exception | None] = asyncio.Queue()

    async def pump(c: Choice) -> None:
        try:
            async for d in c.gen.deltas():
                await queue.put((c, d))
            await queue.put(None)
        except Exception as e:  # handed to the consumer
            await queue.put(e)

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _stream(shaper: _Shaper) -> AsyncIterator[str]:
    """Server-sent events: one chunk per delta, the usage chunk if asked, then `[DONE]`."""
    try:
        started: set[int] = set()
        if shaper.chat:
            for c in shaper.choices:
                yield _sse(shaper.role_chunk(c))
        async for c, d in _merged_deltas(shaper.choices):
            first = c.index not in started
            started.add(c.index)
            yield _sse(shaper.chunk(c, d, first=first))
        if shaper.include_usage:
            yield _sse(shaper.usage_chunk())
        yield _sse("[DONE]")
    except ClientDisconnected:
        log.info("stream %s: client disconnected, request aborted", shaper.id)
    except Exception as e:  # the status line is already sent; report in-band like vLLM
        log.exception("stream %s failed", shaper.id)
        yield _sse(openai_error_body(APIError(500, f"internal error: {type(e).__name__}")))
        yield _sse("[DONE]")


async def _respond(shaper: _Shaper, stream: bool) -> Any:
    if stream:
        return StreamingResponse(_stream(shaper), media_type="text/event-stream")
    tasks = [asyncio.ensure_future(c.gen.collect()) for c in shaper.choices]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:  # one choice failed or the client left: end the others (each closes its request)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return shaper.response(list(results))


# --- app --------------------------------------------------------------------------------------------


def build_inference_app(service: WorkerService) -> FastAPI:
    app = FastAPI(title="lorafleet worker (OpenAI-compatible API)", docs_url=None, redoc_url=None)
    install_error_handlers(app, openai_error_body)
    add_probe_routes(app, service)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        prompts = body.prompts()
        ids = [_prompt_ids(service, p) for p in prompts]
        scored = body.echo and body.logprobs is not None  # echo with logprobs scores the prompt (vLLM)
        choices = await _start_choices(
            service, request, body, ids, body.max_tokens, body.logprobs, body.logprobs if scored else None
        )
        if body.echo:
            _add_echo(service, choices, prompts, body.n)
        shaper = _Shaper(
            service,
            body,
            choices,
            chat=False,
            want_logprobs=body.logprobs is not None,
            token_ids_as_text=body.return_tokens_as_token_ids,
        )
        return await _respond(shaper, body.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            prompt_ids = service.tokenizer.encode_chat(
                messages, add_generation_prompt=body.add_generation_prompt, template_kwargs=body.chat_template_kwargs
            )
        except TokenizerError as e:
            raise APIError(400, str(e), param="messages") from e
        top = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens
        choices = await _start_choices(service, request, body, [prompt_ids], max_tokens, top)
        return await _respond(_Shaper(service, body, choices, chat=True, want_logprobs=body.logprobs), body.stream)

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
        uri = path_to_uri(body.lora_path)
        return success_body(await service.load_adapter(body.lora_name, uri, replace=body.load_inplace))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(
        body: VllmUnloadLoraRequest, authorization: str | None = Header(default=None)
    ) -> dict[str, Any]:
        service.check_admin(authorization)
        return success_body(await service.unload_adapter(body.lora_name))

    return app
