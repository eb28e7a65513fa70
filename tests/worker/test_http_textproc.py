"""The text side of the HTTP layer: tokenizer and chat template vs transformers, incremental detokenization, stops."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from lorafleet_worker.api.protocol import APIError, check_lora_name
from lorafleet_worker.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer

TEXTS = ["Hello, world! How are you?", "  two  spaces, tabs\tand\nnewlines", "é ü 漢字 🙂 mixed", "x"]


@pytest.fixture(scope="module")
def tokenizers(tiny_models: Any) -> tuple[Tokenizer, Any]:
    from transformers import AutoTokenizer

    return Tokenizer.from_dir(tiny_models["llama"]), AutoTokenizer.from_pretrained(tiny_models["llama"])


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tokenizers: tuple[Tokenizer, Any], text: str) -> None:
    ours, hf = tokenizers
    assert ours.encode(text) == hf.encode(text)
    assert ours.decode(ours.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True)


def test_chat_template_matches_transformers(tokenizers: tuple[Tokenizer, Any]) -> None:
    ours, hf = tokenizers
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    hf_messages = [{**m, "content": m["content"] if isinstance(m["content"], str) else "Hi there"} for m in messages]
    expected = hf.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert ours.encode_chat(messages) == list(expected["input_ids"])


def test_incremental_detokenization_equals_full_decode(tokenizers: tuple[Tokenizer, Any]) -> None:
    ours, _ = tokenizers
    prompt = ours.encode("Start:")
    ids = ours.encode(" " + " ".join(TEXTS))
    detok = IncrementalDetokenizer(ours, prompt)
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) + detok.flush() == ours.decode(ids)
    assert all("\ufffd" not in p for p in pieces), "a multi-byte character was split"


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abc xy", max_size=40),
    stops=st.lists(st.text(alphabet="abcxy", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=8),
)
@example(text="baa", stops=["a", "baa"], cuts=[])  # "a" completes first although "baa" starts first
@example(text="ba", stops=["a", "ba"], cuts=[])  # both complete together: the longer one wins
def test_stop_strings_in_any_chunking(text: str, stops: list[str], cuts: list[int]) -> None:
    """Whatever the chunking, the output is the text before the stop string that completes first,
    as if it had been generated one character at a time (the stop string is never included)."""
    expected, hit = text, False
    for n in range(1, len(text) + 1):  # the reference: check after every character
        starts = [n - len(s) for s in stops if text[:n].endswith(s)]
        if starts:
            expected, hit = text[: min(starts)], True
            break
    matcher = StopStringMatcher(stops)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    out = "".join(matcher.feed(text[a:b]) for a, b in itertools.pairwise(bounds))
    out += matcher.flush()
    assert out == expected
    assert matcher.stopped == hit


@pytest.mark.parametrize("name", ["a", "org/repo", "my_adapter-v1.2", "x" * 128])
def test_valid_lora_names(name: str) -> None:
    assert check_lora_name(name) == name


@pytest.mark.parametrize("name", ["", "x" * 129, "a..b", "../etc", "sp ace", "semi;colon", "ünï"])
def test_invalid_lora_names(name: str) -> None:
    with pytest.raises(APIError) as info:
        check_lora_name(name)
    assert info.value.status == 400
