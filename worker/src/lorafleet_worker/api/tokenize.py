"""vLLM's `POST /tokenize` and `POST /detokenize`: the tokens of a prompt or of chat messages, and back.

Bodies and answers are vLLM's (`entrypoints/serve/tokenize`): `/tokenize` takes a `prompt`
(special tokens added unless `add_special_tokens` is false) or chat `messages` (rendered with the
chat template; special tokens come from the template unless `add_special_tokens` is true) and
answers `{"count", "max_model_len", "tokens", "token_strs"}`; `/detokenize` takes `tokens` and
answers `{"prompt"}` (special tokens kept). `model`, when given, must name the base model or a
loaded adapter (adapters share the base model's tokenizer).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from lorafleet_worker.api.protocol import APIError, ChatMessage, ChatTool, _OpenAIBody
from lorafleet_worker.service import WorkerService
from lorafleet_worker.tokenizer import TokenizerError


class TokenizeRequest(_OpenAIBody):
    """vLLM's TokenizeCompletionRequest (`prompt`) and TokenizeChatRequest (`messages`) in one body."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages (vLLM's defaults)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_OpenAIBody):
    model: str | None = None
    tokens: list[int] = Field(default_factory=list)


def _check_model(service: WorkerService, model: str | None) -> None:
    if model is not None:
        service.resolve_model(model)  # 404 for an unknown model


def tokenize(service: WorkerService, body: TokenizeRequest) -> dict[str, Any]:
    _check_model(service, body.model)
    tok = service.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give either prompt or messages", param="prompt")
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = tok.encode(body.prompt, add_special_tokens=add_special)
    else:
        assert body.messages is not None
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        try:
            text = tok.render_chat(
                [m.model_dump(exclude_none=True) for m in body.messages],
                add_generation_prompt=body.add_generation_prompt,
                template_kwargs=body.chat_template_kwargs,
                tools=tools,
            )
        except TokenizerError as e:
            raise APIError(400, str(e), param="messages") from e
        ids = tok.encode(text, add_special_tokens=bool(body.add_special_tokens))
    return {
        "count": len(ids),
        "max_model_len": service.max_model_len,
        "tokens": ids,
        "token_strs": tok.token_strs(ids) if body.return_token_strs else None,
    }


def detokenize(service: WorkerService, body: DetokenizeRequest) -> dict[str, Any]:
    _check_model(service, body.model)
    tok = service.tokenizer
    bad = [t for t in body.tokens if not 0 <= t < tok.vocab_size]
    if bad:
        raise APIError(400, f"token id {bad[0]} is not in [0, {tok.vocab_size})", param="tokens")
    return {"prompt": tok.decode(body.tokens, skip_special_tokens=False)}
