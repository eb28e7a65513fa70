"""One inference request through the engine: detokenization, stop strings, logprobs, metrics, disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lorafleet_worker.api.protocol import APIError
from lorafleet_worker.core.errors import EngineUnavailableError
from lorafleet_worker.sample.params import PromptLogprob
from lorafleet_worker.service import WorkerService
from lorafleet_worker.tokenizer import IncrementalDetokenizer, StopStringMatcher

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from lorafleet_worker.sample.params import SamplingParams, TokenOutput
    from lorafleet_worker.structured.grammar import CompiledGrammar


class ClientDisconnected(Exception):
    """The HTTP client went away; the engine request has been aborted."""


@dataclass
class TokenInfo:
    """A generated token with its logprobs and the offset of its text in the completion."""

    token_id: int
    logprob: float | None  # None for an echoed prompt's first token (nothing predicts it)
    top_logprobs: dict[int, float] | None
    text_offset: int


@dataclass
class Delta:
    """New completion text and the tokens generated since the previous delta."""

    text: str
    tokens: list[TokenInfo] = field(default_factory=list)
    finish_reason: str | None = None


def _unavailable(e: EngineUnavailableError) -> APIError:
    """A dead engine is a 503: the router retries the request on another holder (before any byte)."""
    return APIError(503, f"this worker cannot serve: {e}", code="engine_unavailable")


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Generation:
    """Runs one request: `await start()` (raises 404 if the adapter is gone), then `async for d in deltas()`.

    `disconnected` resolves when the client goes away; the engine request is then aborted.
    """

    def __init__(
        self,
        service: WorkerService,
        *,
        model: str,
        adapter: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        stop: list[str],
        disconnected: Callable[[], Awaitable[Any]] | None = None,
        grammar: CompiledGrammar | None = None,
    ) -> None:
        """`grammar`: the compiled structured-output constraint this generation follows (its own state)."""
        self.request_id = new_request_id("req")
        self.model = model
        self.prompt_ids = prompt_ids
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        self._service = service
        self._metrics = service.metrics
        self._detok = IncrementalDetokenizer(service.tokenizer, prompt_ids)
        self._stops = StopStringMatcher(stop)
        self._min_tokens = params.min_tokens  # stop strings are not looked for in these tokens' text (as vLLM)
        self.prompt_logprobs: list[PromptLogprob] | None = None
        self._silent_ids = set(params.stop_token_ids) | set(service.eos_token_ids)
        self._text_len = 0
        self._t0 = time.monotonic()
        self._last_token_at: float | None = None
        self._submit = (prompt_ids, params, adapter)
        self._grammar = grammar
        self._it: AsyncIterator[TokenOutput] | None = None
        self._first: TokenOutput | None = None
        self._disconnected = disconnected
        self._watcher: asyncio.Future[Any] | None = None
        self._outcome = "error"
        self._finish_reason: str | None = None
        self._vllm_labels = (service.model_name, "0")  # vLLM labels by the served (base) model name

    async def start(self) -> None:
        """Submit to the engine and wait for the first token; a vanished adapter is a 404, bad input a 400."""
        from lorafleet_worker.lora.errors import AdapterNotFoundError

        prompt_ids, params, adapter = self._submit
        try:
            self._it = self._service.generate(self.request_id, prompt_ids, params, adapter, self._grammar)
        except AdapterNotFoundError as e:
            raise APIError(
                404, f"The model `{self.model}` does not exist.", param="model", code="model_not_found"
            ) from e
        except EngineUnavailableError as e:
            raise _unavailable(e) from e
        except ValueError as e:
            raise APIError(400, str(e)) from e
        self._metrics.requests_in_flight.inc()
        if self._disconnected is not None:
            self._watcher = asyncio.ensure_future(self._disconnected())
            self._watcher.add_done_callback(self._on_disconnect)
        try:
            self._first = await self._next()
        except BaseException:
            await self.close()
            raise
        if self._first is not None:
            self.prompt_logprobs = self._first.prompt_logprobs

    async def deltas(self) -> AsyncIterator[Delta]:
        """Deltas until the finish reason; closes the engine request on exit."""
        try:
            out = self._first
            while out is not None:
                delta = self._consume(out)
                if delta.finish_reason:
                    self._outcome = "abort" if delta.finish_reason == "abort" else "success"
                    self._finish_reason = delta.finish_reason
                if delta.text or delta.tokens or delta.finish_reason:
                    yield delta
                if delta.finish_reason:
                    return
                out = await self._next()
        except (GeneratorExit, asyncio.CancelledError):
            self._outcome = "abort"  # the consumer went away (client disconnect)
            raise
        finally:
            await self.close()

    async def collect(self) -> Delta:
        """The whole completion as one delta."""
        result = Delta("")
        async for d in self.deltas():
            result.text += d.text
            result.tokens.extend(d.tokens)
            result.finish_reason = d.finish_reason
        return result

    async def close(self) -> None:
        """Abort the engine request if it still runs and record the request's metrics (once)."""
        if self._watcher is not None:
            self._watcher.cancel()
        it, self._it = self._it, None
        if it is None:
            return
        with contextlib.suppress(Exception):
            await it.aclose()  # type: ignore[attr-defined]
        m = self._metrics
        m.requests_in_flight.dec()
        m.requests.labels(model=self.model, outcome=self._outcome).inc()
        m.prompt_tokens.labels(model=self.model).inc(self.prompt_tokens)
        m.generation_tokens.labels(model=self.model).inc(self.completion_tokens)
        elapsed = time.monotonic() - self._t0
        m.request_latency.observe(elapsed)
        m.vllm_e2e_latency.labels(*self._vllm_labels).observe(elapsed)
        if self._finish_reason is not None:
            m.vllm_request_success.labels(*self._vllm_labels, self._finish_reason).inc()
        log.info(
            "request %s model=%s outcome=%s prompt_tokens=%d generated=%d in %.3fs",
            self.request_id,
            self.model,
            self._outcome,
            self.prompt_tokens,
            self.completion_tokens,
            elapsed,
        )

    def _on_disconnect(self, watcher: asyncio.Future[Any]) -> None:
        """The client went away: the token stream raises ClientDisconnected at its next read (`Engine.interrupt`),
        so that `_next` awaits the stream alone (no task and no `asyncio.wait` per token)."""
        if not watcher.cancelled() and self._it is not None:
            self._service.interrupt(self.request_id, ClientDisconnected(self.request_id))

    async def _next(self) -> TokenOutput | None:
        """The next engine output (None at the end); raises ClientDisconnected if the client left first."""
        assert self._it is not None
        try:
            out = await anext(self._it)
        except StopAsyncIteration:
            return None
        except EngineUnavailableError as e:
            raise _unavailable(e) from e
        except ClientDisconnected:
            self._outcome = "abort"
            raise
        self._observe_latency()
        return out

    def _observe_latency(self) -> None:
        now = time.monotonic()
        m = self._metrics
        if self._last_token_at is None:
            m.time_to_first_token.observe(now - self._t0)
            m.vllm_time_to_first_token.labels(*self._vllm_labels).observe(now - self._t0)
        else:
            m.inter_token_latency.observe(now - self._last_token_at)
            m.vllm_inter_token_latency.labels(*self._vllm_labels).observe(now - self._last_token_at)
            m.vllm_time_per_output_token.labels(*self._vllm_labels).observe(now - self._last_token_at)
        self._last_token_at = now

    def _consume(self, out: TokenOutput) -> Delta:
        if out.token_id < 0:  # the engine ended the request without a token (abort / shutdown)
            text = self._stops.feed(self._detok.flush())
            return Delta(text + self._stops.flush(), [], out.finish_reason or "abort")
        self.completion_tokens += 1
        silent = out.finish_reason == "stop" and out.token_id in self._silent_ids
        token = TokenInfo(out.token_id, out.logprob, out.top_logprobs, self._text_len)
        text = "" if silent else self._detok.add(out.token_id)
        if out.finish_reason:
            text += self._detok.flush()
        self._text_len += len(text)
        emitted = self._stops.skip(text) if self.completion_tokens <= self._min_tokens else self._stops.feed(text)
        if self._stops.stopped:
            return Delta(emitted, [token], "stop")
        if out.finish_reason:
            return Delta(emitted + self._stops.flush(), [token], out.finish_reason)
        return Delta(emitted, [token])
