"""Request bodies and error shapes of the worker's HTTP APIs (OpenAI, Dynamo and vLLM compatible)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Literal

from lorafleet_sync.ids import lora_name_problem
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class APIError(Exception):
    """An error with its HTTP status; each API renders it in its own shape."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None, type: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type  # the OpenAI error's `type`; None: the status's usual one


def check_lora_name(name: str) -> str:
    """SPEC §2: 1–128 chars of `[A-Za-z0-9._/-]`, no `..`."""
    if problem := lora_name_problem(name):
        raise APIError(400, problem, param="lora_name")
    return name


def validation_message(error: ValidationError | Sequence[Any]) -> str:
    """A one-line summary of pydantic / FastAPI validation errors."""
    errors = error.errors() if isinstance(error, ValidationError) else error
    parts = []
    for e in errors:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        if e.get("type") == "json_invalid":
            parts.append(f"malformed JSON: {e.get('ctx', {}).get('error', e.get('msg'))}")
        elif e.get("type") == "extra_forbidden":
            parts.append(f"{loc}: unsupported field (this server does not implement it)")
        else:
            parts.append(f"{loc or 'body'}: {e.get('msg')}")
    return "; ".join(parts) or "invalid request"


_OPENAI_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    503: "service_unavailable_error",
    507: "insufficient_storage_error",
}


def openai_error_body(err: APIError) -> dict[str, Any]:
    return {
        "error": {
            "message": err.message,
            "type": err.type or _OPENAI_ERROR_TYPES.get(err.status, "server_error"),
            "param": err.param,
            "code": err.code,
        }
    }


def management_error_body(err: APIError) -> dict[str, Any]:
    return {"status": "error", "message": err.message}


# --- management bodies -----------------------------------------------------------------------------


class _Body(BaseModel):
    """Management bodies: any field not declared is refused with 400 naming it."""

    model_config = ConfigDict(extra="forbid")


class LoraSource(_Body):
    uri: str = Field(min_length=1)


class LoadLoraRequest(_Body):
    """Dynamo: `POST /v1/loras`."""

    lora_name: str
    source: LoraSource


class VllmLoadLoraRequest(_Body):
    """vLLM: `POST /v1/load_lora_adapter`."""

    lora_name: str
    lora_path: str = Field(min_length=1)
    # vLLM: replace an adapter already loaded under this name (a hot swap); without it, loading another
    # path under a loaded name is refused (the same path is a no-op, unlike vLLM's "already loaded" 400)
    load_inplace: bool = False


class VllmUnloadLoraRequest(_Body):
    """vLLM: `POST /v1/unload_lora_adapter`."""

    lora_name: str


# --- OpenAI bodies ---------------------------------------------------------------------------------
# Every field below has its effect; any other field is refused with 400 naming it (`extra="forbid"`),
# so a client never gets a silently different answer than it asked for.

MAX_CHOICES = 128  # prompts x n in one request


class _OpenAIBody(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_OpenAIBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class JsonSchemaFormat(_OpenAIBody):
    """OpenAI's `response_format.json_schema`; the schema is always enforced (`strict` or not)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None  # for the caller's records; the grammar is the schema
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_OpenAIBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_OpenAIBody):
    """vLLM's `structured_outputs` (one of the fields)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class _SamplingBody(_OpenAIBody):
    """Fields shared by completions and chat completions (plus vLLM's sampling extensions)."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id for the caller's own records; no effect on the output
    # vLLM extensions
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # structured output: OpenAI's response_format, vLLM's structured_outputs and guided_* (at most one)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    # max_tokens when the request names none (None: the rest of the context)
    default_max_tokens: ClassVar[int | None] = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def token_bias(self, vocab_size: int) -> dict[int, float]:
        """`logit_bias` with integer keys, checked against the vocabulary."""
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
            if not 0 <= token < vocab_size:
                raise APIError(400, f"logit_bias token id {token} is not in [0, {vocab_size})", param="logit_bias")
            if not -100 <= value <= 100:
                raise APIError(400, f"logit_bias values must be in [-100, 100], got {value}", param="logit_bias")
            bias[token] = value
        return bias

    def check_supported(self) -> None:
        if len(self.stop_strings()) > 16:
            raise APIError(400, "at most 16 stop strings", param="stop")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")


class CompletionRequest(_SamplingBody):
    default_max_tokens: ClassVar[int | None] = 16  # OpenAI's default for completions

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0 with echo: score the prompt only
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    # vLLM extensions: logprob tokens as "token_id:N" instead of text; each prompt token's logprob and the
    # top-k at its position (`choices[].prompt_logprobs`, not streamed; echo with logprobs implies it)
    return_tokens_as_token_ids: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.best_of not in (None, self.n):
            raise APIError(400, "best_of must equal n (no server-side ranking)", param="best_of")
        if self.stream and self.prompt_logprobs:
            raise APIError(400, "`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")

    def prompt_scores(self) -> int | None:
        """How many top logprobs to score each prompt token with (vLLM: echo with logprobs scores the prompt)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompt as a list of prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "the prompt is empty", param="prompt")
        if isinstance(p[0], int):
            return [p]
        return p


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ...: passed to the chat template
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class FunctionDefinition(_OpenAIBody):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None  # shown to the model through the chat template
    parameters: dict[str, Any] | None = None  # a JSON schema; enforced for tool_choice required / named
    strict: bool | None = None


class ChatTool(_OpenAIBody):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_OpenAIBody):
    name: str


class NamedToolChoice(_OpenAIBody):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM extensions
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables, e.g. {"enable_thinking": false}
    include_reasoning: bool = True  # with --reasoning-parser: false leaves the reasoning out of the answer

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
