"""Inference API (port 8000, OpenAI-compatible: completions, chat completions, responses) plus vLLM's
load/unload, tokenize/detokenize and version endpoints."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Header, Request
from fastapi.responses import StreamingResponse

from lorafleet_worker.api.common import add_probe_routes, install_error_handlers, wait_for_disconnect
from lorafleet_worker.api.generation import ClientDisconnected, Delta, Generation, TokenInfo
from lorafleet_worker.api.management import success_body
from lorafleet_worker.api.protocol import (
    MAX_CHOICES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    VllmLoadLoraRequest,
    VllmUnloadLoraRequest,
    _SamplingBody,
    openai_error_body,
)
from lorafleet_worker.api.reasoning import ReasoningParser
from lorafleet_worker.api.responses import (
    ResponseEvents,
    ResponseObject,
    ResponsesRequest,
    ResponseStore,
    output_items,
    to_chat_request,
)
from lorafleet_worker.api.shapers import ChatShaper, Choice, CompletionShaper
from lorafleet_worker.api.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from lorafleet_worker.api.validation import prompt_ids, sampling_params, structured_output, tool_plan
from lorafleet_worker.service import WorkerService, path_to_uri
from lorafleet_worker.structured.grammar import CompiledGrammar, Constraint, GrammarError
from lorafleet_worker.tokenizer import TokenizerError

log = logging.getLogger(__name__)

Chunk = dict[str, Any]
Shaper = CompletionShaper | ChatShaper


# --- request -> engine ------------------------------------------------------------------------------


async def _compile(service: WorkerService, constraint: Constraint | None) -> CompiledGrammar | None:
    """The request's compiled constraint (off the event loop, cached); an unusable one is a 400 naming its field."""
    if constraint is None:
        return None
    try:
        return await service.compile_grammar(constraint)
    except GrammarError as e:
        raise APIError(400, str(e), param=e.param) from e


async def _start_choices(
    service: WorkerService,
    request: Request,
    body: _SamplingBody,
    prompts: list[list[int]],
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    grammar: CompiledGrammar | None = None,
) -> list[Choice]:
    """`n` generations per prompt (choice index = prompt x n + j; seed + j as vLLM), all submitted at once;
    each follows its own copy of `grammar`."""
    if len(prompts) * body.n > MAX_CHOICES:
        raise APIError(400, f"at most {MAX_CHOICES} choices (prompts x n) per request", param="n")
    adapter = await service.serve_model(body.model)  # loads a catalogued adapter on demand
    gens = []
    for ids in prompts:
        params = sampling_params(
            body,
            prompt_len=len(ids),
            max_model_len=service.max_model_len,
            vocab_size=service.vocab_size,
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
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
                    grammar=grammar,
                )
            )
    results = await asyncio.gather(*(g.start() for g in gens), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for g in gens:
            await g.close()
        raise errors[0]
    return [Choice(i, g) for i, g in enumerate(gens)]


def _add_echo(
    service: WorkerService, choices: list[Choice], prompts: list[str] | list[list[int]], n: int, top: int | None
) -> None:
    """Put each prompt (text, and its tokens with their logprobs and `top` top logprobs when scored) before its
    choices' completions."""
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
            lp, best = (None, None) if i == 0 else (scores[i - 1].logprob, scores[i - 1].top)
            best = None if best is None else dict(list(best.items())[: top or 0])
            c.echo_tokens.append(TokenInfo(token_id, lp, best, offset))
            offset += len(tok.token_text(token_id))


# --- responses ------------------------------------------------------------------------------------


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


async def _stream(shaper: Shaper) -> AsyncIterator[str]:
    """Server-sent events: one chunk per delta, the usage chunk if asked, then `[DONE]`."""
    try:
        started: set[int] = set()
        for start in shaper.start_chunks():
            yield _sse(start)
        async for c, d in _merged_deltas(shaper.choices):
            first = c.index not in started
            started.add(c.index)
            yield _sse(shaper.chunk(c, d, first=first))
        if shaper.include_usage:
            yield _sse(shaper.usage_chunk())
        yield _sse("[DONE]")
    except ClientDisconnected:
        log.info("stream %s: client disconnected, request aborted", shaper.id)
    except APIError as e:  # e.g. the engine died mid-stream (503): the status line is sent, report in-band
        log.warning("stream %s failed: %s", shaper.id, e.message)
        yield _sse(openai_error_body(e))
        yield _sse("[DONE]")
    except Exception as e:  # the status line is already sent; report in-band like vLLM
        log.exception("stream %s failed", shaper.id)
        yield _sse(openai_error_body(APIError(500, f"internal error: {type(e).__name__}")))
        yield _sse("[DONE]")


async def _collect(shaper: Shaper) -> list[Delta]:
    """Every choice's whole completion."""
    tasks = [asyncio.ensure_future(c.gen.collect()) for c in shaper.choices]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:  # one choice failed or the client left: end the others (each closes its request)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _respond(shaper: Shaper, stream: bool) -> Any:
    if stream:
        return StreamingResponse(_stream(shaper), media_type="text/event-stream")
    return shaper.response(await _collect(shaper))


async def _start_chat(service: WorkerService, request: Request, body: ChatCompletionRequest) -> ChatShaper:
    """Render, tokenize and submit a chat request; its shaper (tool calls and reasoning parsed as configured)."""
    body.check_supported()
    settings = service.settings
    tools = tool_plan(body, auto_tool_choice=settings.enable_auto_tool_choice, parser_name=settings.tool_call_parser)
    spec = tools.grammar or structured_output(body)
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    try:
        ids = service.tokenizer.encode_chat(
            messages,
            add_generation_prompt=body.add_generation_prompt,
            template_kwargs=body.chat_template_kwargs,
            tools=tools.tools or None,
        )
    except TokenizerError as e:
        raise APIError(400, str(e), param="messages") from e
    top = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens or body.max_tokens
    grammar = await _compile(service, spec)
    choices = await _start_choices(service, request, body, [ids], max_tokens, top, grammar=grammar)
    reasoning = ReasoningParser(settings.reasoning_parser) if settings.reasoning_parser else None
    return ChatShaper(
        service.tokenizer,
        body,
        choices,
        want_logprobs=body.logprobs,
        tool_parser=tools.parser,
        parallel_tool_calls=tools.parallel,
        reasoning=reasoning,
        thinking=reasoning is not None and reasoning.thinking(body.chat_template_kwargs),
        include_reasoning=body.include_reasoning,
    )


def _sse_event(event: Chunk) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


async def _response_stream(
    shaper: ChatShaper, events: ResponseEvents, done: Callable[[list[dict[str, Any]]], None]
) -> AsyncIterator[str]:
    """Server-sent Responses events of one streamed response; `done(output)` once it completed."""
    try:
        for e in events.start():
            yield _sse_event(e)
        reason = None
        started = False
        async for c, d in _merged_deltas(shaper.choices):
            choice = shaper.chunk(c, d, first=not started)["choices"][0]
            started = True
            reason = choice["finish_reason"] or reason
            for e in events.feed(choice["delta"]):
                yield _sse_event(e)
        for e in events.finish(reason, shaper.usage()):
            yield _sse_event(e)
        done(events.output)
    except ClientDisconnected:
        log.info("stream %s: client disconnected, request aborted", events.response.id)
    except Exception as e:  # the status line is already sent; report in-band as OpenAI's `error` event
        if isinstance(e, APIError):  # e.g. the engine died mid-stream (503)
            log.warning("stream %s failed: %s", events.response.id, e.message)
            err = e
        else:
            log.exception("stream %s failed", events.response.id)
            err = APIError(500, f"internal error: {type(e).__name__}")
        body = openai_error_body(err)["error"]
        yield _sse_event({"type": "error", "sequence_number": 0, **body})


# --- app --------------------------------------------------------------------------------------------


def build_inference_app(service: WorkerService) -> FastAPI:
    app = FastAPI(title="lorafleet worker (OpenAI-compatible API)", docs_url=None, redoc_url=None)
    install_error_handlers(app, openai_error_body)
    add_probe_routes(app, service)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        body.check_supported()
        spec = structured_output(body)
        prompts = body.prompts()
        vocab = service.vocab_size
        ids = [prompt_ids(service.tokenizer.encode, p, vocab) for p in prompts]
        scores = body.prompt_scores()
        # the engine scores the prompt once, with the larger top-k that echo's logprobs and prompt_logprobs ask for
        top = None if scores is None else max(scores, body.logprobs or 0)
        grammar = await _compile(service, spec)
        choices = await _start_choices(service, request, body, ids, body.max_tokens, body.logprobs, top, grammar)
        if body.echo:
            _add_echo(service, choices, prompts, body.n, body.logprobs)
        shaper = CompletionShaper(
            service.tokenizer,
            body,
            choices,
            want_logprobs=body.logprobs is not None,
            token_ids_as_text=body.return_tokens_as_token_ids,
            prompt_logprobs=scores,
        )
        return await _respond(shaper, body.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await _respond(await _start_chat(service, request, body), body.stream)

    stored = ResponseStore()

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Any:
        chat, conversation = to_chat_request(body, stored.history(body.previous_response_id))
        shaper = await _start_chat(service, request, chat)
        response = ResponseObject(body)

        def done(output: list[dict[str, Any]]) -> None:
            if body.store:
                stored.put(response.id, conversation, output)

        if body.stream:
            stream = _response_stream(shaper, ResponseEvents(response), done)
            return StreamingResponse(stream, media_type="text/event-stream")
        choice = shaper.response(await _collect(shaper))["choices"][0]
        output = output_items(choice["message"])
        done(output)
        return response.render(output, status="completed", finish_reason=choice["finish_reason"], usage=shaper.usage())

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> dict[str, Any]:
        return tokenize(service, body)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> dict[str, Any]:
        return detokenize(service, body)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": importlib.metadata.version("lorafleet-worker")}

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
