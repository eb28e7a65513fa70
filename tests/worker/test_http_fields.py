"""Every OpenAI request field the worker accepts has its effect; every other field is refused with 400.

One fp32 worker on a copy of the tiny llama without a chat template, started with `--chat-template`
(a Qwen3-style template that reads `enable_thinking`), with one LoRA adapter. Greedy outputs with
penalties and logit_bias are compared with transformers' `generate`; prompt logprobs (echo, logprobs,
max_tokens=0, as evaluation harnesses score log-likelihoods) with transformers + PEFT.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.worker.conftest import Worker, start_worker, stop_worker, wait_until

ADAPTER = "fields/r8"
PROMPT = "Once upon a time there was a little"
TOLERANCE = 1e-3
# Qwen3's chat template in miniature: ChatML, and an empty think block when enable_thinking is false
QWEN3_STYLE_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


@pytest.fixture(scope="module")
def untemplated_model(tiny_models: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama without a chat template."""
    model = tmp_path_factory.mktemp("untemplated") / "llama"
    shutil.copytree(tiny_models["llama"], model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    return model


@pytest.fixture(scope="module")
def adapter_dir(tiny_models: Any, tiny_adapter_factory: Any) -> Path:
    path: Path = tiny_adapter_factory(tiny_models["llama"], rank=8, seed=21)
    return path


@pytest.fixture(scope="module")
def worker(untemplated_model: Path, adapter_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    workdir = tmp_path_factory.mktemp("fields_worker")
    template = workdir / "template.jinja"
    template.write_text(QWEN3_STYLE_TEMPLATE)
    w = start_worker(
        untemplated_model,
        workdir,
        name="tiny-fields",
        file_root=adapter_dir.parent,
        args=["--dtype", "float32", "--max-loras", "2", "--chat-template", str(template)],
    )
    try:
        w.load(ADAPTER, adapter_dir)
        yield w
    finally:
        stop_worker(w)


@pytest.fixture(scope="module")
def hf_tokenizer(untemplated_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(untemplated_model)


def _post(worker: Worker, path: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    r = httpx.post(f"{worker.url}{path}", json=body, timeout=120)
    assert r.status_code == status, f"{r.status_code} {r.text}"
    out: dict[str, Any] = r.json()
    return out


def _complete(worker: Worker, **body: Any) -> dict[str, Any]:
    return _post(worker, "/v1/completions", {"model": worker.model_name, "prompt": PROMPT, "temperature": 0, **body})


def _stream_events(worker: Worker, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    with httpx.stream("POST", f"{worker.url}{path}", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    return events


def _token_ids(choice: dict[str, Any]) -> list[int]:
    """Token ids of a completion choice asked with logprobs and return_tokens_as_token_ids."""
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


# --- refused fields ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "extra", "field"),
    [
        ("/v1/completions", {"prompt": "x", "guided_json": {"uniqueItems": True}}, "guided_json"),
        ("/v1/completions", {"prompt": "x", "include_stop_str_in_output": True}, "include_stop_str_in_output"),
        # tool_choice "auto" (the default with tools) needs --enable-auto-tool-choice and --tool-call-parser
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
        ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
        ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
        ("/v1/chat/completions", {"stream_options": {"include_usage": True, "x": 1}, "stream": True}, "x"),
    ],
)
def test_unsupported_fields_are_refused_naming_them(
    worker: Worker, path: str, extra: dict[str, Any], field: str
) -> None:
    body = {"model": worker.model_name, **extra}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hi"}]
    r = httpx.post(f"{worker.url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


def test_response_format_text_is_the_default(worker: Worker) -> None:
    body = {"model": worker.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    plain = _post(worker, "/v1/chat/completions", {**body, "temperature": 0})
    text = _post(worker, "/v1/chat/completions", {**body, "temperature": 0, "response_format": {"type": "text"}})
    assert plain["choices"][0]["message"] == text["choices"][0]["message"]


# --- prompts x n ------------------------------------------------------------------------------------


def test_prompt_lists_and_n_give_one_choice_each(worker: Worker) -> None:
    prompts = [PROMPT, "def add(a, b):"]
    common = {"max_tokens": 6, "temperature": 0.9, "ignore_eos": True, "seed": 3}
    out = _complete(worker, prompt=prompts, n=2, **common)
    choices = out["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    # choice prompt x n + j is the prompt sampled with seed + j (as vLLM)
    for c in choices:
        prompt, j = prompts[c["index"] // 2], c["index"] % 2
        alone = _complete(worker, prompt=prompt, **{**common, "seed": 3 + j})
        assert c["text"] == alone["choices"][0]["text"]
    assert choices[0]["text"] != choices[1]["text"]
    single = [_complete(worker, prompt=p, max_tokens=1)["usage"]["prompt_tokens"] for p in prompts]
    assert out["usage"]["prompt_tokens"] == sum(single)  # once per prompt, not per choice
    assert out["usage"]["completion_tokens"] == 4 * 6

    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for e in _stream_events(
        worker, "/v1/completions", {"model": worker.model_name, "prompt": prompts, "n": 2, **common}
    ):
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"]:
                finishes.setdefault(c["index"], []).append(c["finish_reason"])
    assert texts == {c["index"]: c["text"] for c in choices}
    assert finishes == {i: ["length"] for i in range(4)}


def test_chat_n_streams_every_choice(worker: Worker) -> None:
    body = {
        "model": ADAPTER,
        "messages": [{"role": "user", "content": "hello"}],
        "n": 3,
        "max_tokens": 4,
        "ignore_eos": True,
        "seed": 1,
        "stream_options": {"include_usage": True},
    }
    events = _stream_events(worker, "/v1/chat/completions", body)
    roles = [c["index"] for e in events for c in e["choices"] if c["delta"].get("role") == "assistant"]
    assert sorted(roles) == [0, 1, 2]
    done = [c["index"] for e in events for c in e["choices"] if c["finish_reason"] == "length"]
    assert sorted(done) == [0, 1, 2]
    assert events[-1]["usage"]["completion_tokens"] == 12


# --- echo and prompt logprobs -------------------------------------------------------------------------


def test_echo_returns_the_prompt_with_its_logprobs(worker: Worker, hf_tokenizer: Any) -> None:
    ids = hf_tokenizer.encode(PROMPT)
    scored = _complete(worker, echo=True, max_tokens=0, logprobs=2, return_tokens_as_token_ids=True)
    c = scored["choices"][0]
    assert c["text"] == PROMPT and c["finish_reason"] == "length"
    assert _token_ids(c) == ids
    lps = c["logprobs"]["token_logprobs"]
    assert lps[0] is None and c["logprobs"]["top_logprobs"][0] is None
    assert all(lp <= 0 for lp in lps[1:]) and all(len(t) == 2 for t in c["logprobs"]["top_logprobs"][1:])
    assert scored["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}

    # echo with generation: the prompt, then the completion; the generated token's logprob is the same score
    gen = _complete(worker, echo=True, max_tokens=3, logprobs=0, ignore_eos=True, return_tokens_as_token_ids=True)
    g = gen["choices"][0]
    assert g["text"].startswith(PROMPT) and len(g["text"]) > len(PROMPT)
    assert _token_ids(g)[: len(ids)] == ids and len(_token_ids(g)) == len(ids) + 3
    assert g["logprobs"]["token_logprobs"][: len(ids)] == pytest.approx(lps, abs=TOLERANCE)
    offsets = g["logprobs"]["text_offset"]
    assert offsets == sorted(offsets) and offsets[len(ids)] == len(PROMPT)
    extended = _complete(worker, prompt=_token_ids(g)[: len(ids) + 1], echo=True, max_tokens=0, logprobs=0)
    assert extended["choices"][0]["logprobs"]["token_logprobs"][-1] == pytest.approx(
        g["logprobs"]["token_logprobs"][len(ids)], abs=TOLERANCE
    )

    events = _stream_events(
        worker, "/v1/completions", {"model": worker.model_name, "prompt": PROMPT, "echo": True, "max_tokens": 2}
    )
    assert events[0]["choices"][0]["text"].startswith(PROMPT)


def test_echo_logprobs_equal_transformers_and_peft(worker: Worker, untemplated_model: Path, adapter_dir: Path) -> None:
    """Log-likelihood scoring as evaluation harnesses do it: echo, logprobs, max_tokens=0, base and adapter."""
    import openai
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    client = openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0)
    prompts = [PROMPT + " girl who lived in the woods", "def add(a, b): return a + b"]
    ours = {
        model: client.completions.create(
            model=model,
            prompt=prompts,
            echo=True,
            max_tokens=0,
            logprobs=1,
            temperature=0,
            extra_body={"return_tokens_as_token_ids": True},
        ).model_dump()["choices"]
        for model in (worker.model_name, ADAPTER)
    }

    base = AutoModelForCausalLM.from_pretrained(untemplated_model, dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(base, adapter_dir).eval()
    for model, choices in ours.items():
        for choice in choices:
            ids = _token_ids(choice)
            with torch.no_grad():
                if model == ADAPTER:
                    logits = peft_model(torch.tensor([ids])).logits[0]
                else:
                    with peft_model.disable_adapter():
                        logits = peft_model(torch.tensor([ids])).logits[0]
            expected = torch.log_softmax(logits.float(), -1)[torch.arange(len(ids) - 1), ids[1:]].tolist()
            got = choice["logprobs"]["token_logprobs"]
            assert got[0] is None
            assert got[1:] == pytest.approx(expected, abs=TOLERANCE), model


# --- sampling fields ----------------------------------------------------------------------------------


def test_min_tokens_and_logit_bias(worker: Worker) -> None:
    from lorafleet_worker.config import ModelConfig

    eos = ModelConfig.from_dir(worker.model_dir).eos_token_ids[0]
    forced_eos = {"logit_bias": {str(eos): 100}, "max_tokens": 10}
    out = _complete(worker, **forced_eos)
    assert out["usage"]["completion_tokens"] == 1 and out["choices"][0]["finish_reason"] == "stop"
    out = _complete(worker, **forced_eos, min_tokens=5)
    assert out["usage"]["completion_tokens"] == 6 and out["choices"][0]["finish_reason"] == "stop"
    # stop_token_ids are held back by min_tokens too
    free = _complete(worker, max_tokens=6, ignore_eos=True, logprobs=0, return_tokens_as_token_ids=True)
    first = _token_ids(free["choices"][0])[0]
    stopped = _complete(worker, max_tokens=6, ignore_eos=True, stop_token_ids=[first])
    assert stopped["usage"]["completion_tokens"] == 1 and stopped["choices"][0]["finish_reason"] == "stop"
    held = _complete(worker, max_tokens=6, ignore_eos=True, stop_token_ids=[first], min_tokens=6)
    assert held["usage"]["completion_tokens"] == 6 and held["choices"][0]["finish_reason"] == "length"


def test_min_p_one_is_greedy(worker: Worker) -> None:
    greedy = _complete(worker, max_tokens=8, ignore_eos=True)["choices"][0]["text"]
    sampled = _complete(worker, max_tokens=8, ignore_eos=True, temperature=1.5, min_p=1.0, seed=5)
    assert sampled["choices"][0]["text"] == greedy


class _OpenAIPenalties:
    """A transformers logits processor applying OpenAI's presence / frequency penalties to new tokens."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = input_ids[0, self.prompt_len :]
        counts = torch.bincount(out, minlength=scores.shape[-1]).to(scores.dtype)
        return scores - (counts * self.frequency + (counts > 0).to(scores.dtype) * self.presence)[None]


@pytest.mark.parametrize(
    "fields",
    [
        {"repetition_penalty": 1.8},
        {"presence_penalty": 1.5, "frequency_penalty": 0.8},
        {"logit_bias": {"40": 6.0, "41": -100.0}, "repetition_penalty": 0.7},
    ],
)
def test_penalties_and_bias_match_transformers_generate(
    worker: Worker, untemplated_model: Path, hf_tokenizer: Any, fields: dict[str, Any]
) -> None:
    from transformers import (
        AutoModelForCausalLM,
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    max_tokens = 12
    ids = hf_tokenizer.encode(PROMPT)
    out = _complete(
        worker, max_tokens=max_tokens, ignore_eos=True, logprobs=0, return_tokens_as_token_ids=True, **fields
    )
    processors: list[Any] = []
    if "logit_bias" in fields:
        processors.append(SequenceBiasLogitsProcessor([[[int(t)], b] for t, b in fields["logit_bias"].items()]))
    if "repetition_penalty" in fields:
        processors.append(RepetitionPenaltyLogitsProcessor(fields["repetition_penalty"]))
    if "presence_penalty" in fields:
        processors.append(_OpenAIPenalties(len(ids), fields["presence_penalty"], fields["frequency_penalty"]))
    model = AutoModelForCausalLM.from_pretrained(untemplated_model, dtype=torch.float32).eval()
    tokens = torch.tensor([ids])
    with torch.no_grad():  # greedy decoding as generate() does it, without stopping at EOS (ignore_eos)
        for _ in range(max_tokens):
            scores = LogitsProcessorList(processors)(tokens, model(tokens).logits[:, -1].float())
            tokens = torch.cat([tokens, scores.argmax(-1, keepdim=True)], dim=1)
    expected = tokens[0, len(ids) :].tolist()
    plain = _complete(worker, max_tokens=max_tokens, ignore_eos=True, logprobs=0, return_tokens_as_token_ids=True)
    assert _token_ids(out["choices"][0]) == expected
    assert _token_ids(plain["choices"][0]) != expected  # the fields changed the output


# --- chat templates -----------------------------------------------------------------------------------


def test_chat_template_kwargs_reach_the_template(worker: Worker, hf_tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    for kwargs in ({}, {"enable_thinking": False}):
        expected = hf_tokenizer.apply_chat_template(
            messages,
            chat_template=QWEN3_STYLE_TEMPLATE,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **kwargs,
        )["input_ids"]
        body: dict[str, Any] = {"model": worker.model_name, "messages": messages, "max_tokens": 1}
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        out = _post(worker, "/v1/chat/completions", body)
        assert out["usage"]["prompt_tokens"] == len(expected), kwargs
    thinking_off = hf_tokenizer.apply_chat_template(
        messages, chat_template=QWEN3_STYLE_TEMPLATE, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert thinking_off.endswith("<think>\n\n</think>\n\n")


def test_chat_without_a_template_is_400(untemplated_model: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    w = start_worker(untemplated_model, tmp_path_factory.mktemp("no_template"), name="no-template")
    try:
        body = {"model": "no-template", "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(f"{w.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        assert "--chat-template" in r.json()["error"]["message"]
        assert _post(w, "/v1/completions", {"model": "no-template", "prompt": "hi", "max_tokens": 2})["choices"]
    finally:
        stop_worker(w)


@pytest.mark.parametrize("stream", [False, True])
def test_client_that_leaves_aborts_every_choice(worker: Worker, stream: bool) -> None:
    def aborted() -> float:
        return worker.metrics()["lorafleet_engine_requests_aborted"]

    before = aborted()
    body = {"model": worker.model_name, "prompt": [PROMPT, "def"], "n": 2, "max_tokens": 1500, "ignore_eos": True}
    if stream:
        with httpx.stream("POST", f"{worker.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            assert next(r.iter_lines()).startswith("data: ")
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{worker.url}/v1/completions", json=body, timeout=0.5)
    wait_until(lambda: aborted() >= before + 4, 60, "the engine never aborted all four choices")
    wait_until(lambda: worker.metrics()["lorafleet_engine_num_running"] == 0, 60, "choices still running")
