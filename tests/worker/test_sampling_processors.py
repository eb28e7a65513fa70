"""Sampling fields that change the logits, against transformers' logits processors on the same logits.

OpenAI's presence / frequency penalties have no transformers processor; they are checked against the
formula in OpenAI's API reference (`logit -= count * frequency + (count > 0) * presence`).
"""

from __future__ import annotations

import pytest
import torch
from lorafleet_worker.sample.params import SamplingParams
from lorafleet_worker.sample.sampler import SamplingState, filter_min_p, make_generator, process_logits, sample
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
)

VOCAB = 64
EOS = 2
PROMPT = [5, 9, 9, 17, 30]
OUTPUT = [9, 41, 41, 41, 7]
CPU = torch.device("cpu")


def _logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _state(params: SamplingParams, tokens: list[int] = PROMPT + OUTPUT) -> SamplingState:
    """The sampling state of a sequence that was given PROMPT and has generated the rest of `tokens`."""
    state = SamplingState.create(params, PROMPT, eos_token_ids=[EOS])
    for token in tokens[len(PROMPT) :]:
        state.accept(token)
    return state


def _ours(
    params: SamplingParams, tokens: list[int] = PROMPT + OUTPUT, logits: torch.Tensor | None = None
) -> torch.Tensor:
    logits = _logits() if logits is None else logits
    return process_logits(logits, [_state(params, tokens)])


def _input_ids(tokens: list[int] = PROMPT + OUTPUT) -> torch.Tensor:
    return torch.tensor([tokens])


def test_logit_bias_matches_sequence_bias_processor() -> None:
    bias = {3: 4.5, 40: -100.0, 63: 0.25}
    hf = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
    expected = hf(_input_ids(), _logits())
    torch.testing.assert_close(_ours(SamplingParams(logit_bias=bias)), expected)


@pytest.mark.parametrize("generated", [0, 3, 4, 5])
def test_min_tokens_matches_min_new_tokens_processor(generated: int) -> None:
    tokens = PROMPT + OUTPUT[:generated]
    params = SamplingParams(min_tokens=4, stop_token_ids=[11])
    hf = MinNewTokensLengthLogitsProcessor(len(PROMPT), 4, [EOS, 11])
    expected = hf(_input_ids(tokens), _logits())
    torch.testing.assert_close(_ours(params, tokens), expected)
    assert bool(torch.isinf(expected[0, EOS])) == (generated < 4)


def test_min_tokens_with_ignore_eos_masks_only_the_stop_token_ids() -> None:
    out = _ours(SamplingParams(min_tokens=4, stop_token_ids=[11], ignore_eos=True), PROMPT)
    assert torch.isinf(out[0, 11]) and not torch.isinf(out[0, EOS])


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    expected = hf(_input_ids(), _logits())
    torch.testing.assert_close(_ours(SamplingParams(repetition_penalty=penalty)), expected)


@pytest.mark.parametrize(("presence", "frequency"), [(0.7, 0.0), (0.0, 0.4), (-0.5, 1.5)])
def test_presence_and_frequency_penalties_follow_openai(presence: float, frequency: float) -> None:
    expected = _logits()
    for token in set(OUTPUT):  # generated tokens only: the prompt's are not penalised
        expected[0, token] -= OUTPUT.count(token) * frequency + presence
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency)
    torch.testing.assert_close(_ours(params), expected)


@pytest.mark.parametrize(("min_p", "temperature"), [(0.05, 1.0), (0.3, 0.7), (0.9, 1.5)])
def test_min_p_matches_min_p_warper_after_temperature(min_p: float, temperature: float) -> None:
    logits = _logits(4)
    scaled = TemperatureLogitsWarper(temperature)(_input_ids(), logits.clone())
    expected = MinPLogitsWarper(min_p)(_input_ids(), scaled.clone())
    ours = filter_min_p(logits / temperature, torch.full((4,), min_p))
    torch.testing.assert_close(ours, expected)
    # and sampling only ever draws from what min_p keeps
    params = SamplingParams(temperature=temperature, min_p=min_p, seed=7)
    gens = [make_generator(7 + r, CPU) for r in range(4)]
    for _ in range(50):
        for r, tok in enumerate(sample(logits, [SamplingState(params, g) for g in gens])):
            assert not torch.isinf(expected[r, tok.token_id])


def test_rows_are_processed_independently_and_greedy_uses_the_processed_logits() -> None:
    logits = _logits(3)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logit_bias={13: 100.0}),
        SamplingParams(temperature=0, repetition_penalty=1.7),
    ]
    out = process_logits(logits, [_state(p) for p in params])
    torch.testing.assert_close(out[0], logits[0])  # no field set: untouched
    expected = RepetitionPenaltyLogitsProcessor(1.7)(_input_ids(), logits[2:3].clone())
    torch.testing.assert_close(out[2:3], expected)
    picks = sample(logits, [_state(p) for p in params])
    assert [p.token_id for p in picks] == out.argmax(-1).tolist()
    assert picks[1].token_id == 13
    # logprobs stay those of the raw logits (vLLM's default)
    assert picks[1].logprob == pytest.approx(float(torch.log_softmax(logits[1], -1)[13]), abs=1e-6)


def test_processors_follow_the_tokens_the_sequence_accepts() -> None:
    """The state advances with each accepted token: min_tokens lifts, penalties grow (no history passed)."""
    params = SamplingParams(min_tokens=2, frequency_penalty=1.0)
    state = SamplingState.create(params, PROMPT, eos_token_ids=[EOS])
    logits = _logits()
    assert torch.isinf(process_logits(logits, [state])[0, EOS])
    state.accept(41)
    state.accept(41)
    out = process_logits(logits, [state])
    assert not torch.isinf(out[0, EOS])
    assert float(out[0, 41]) == pytest.approx(float(logits[0, 41]) - 2.0)


def test_a_grammar_mask_is_applied_before_logprobs_and_wins_over_min_tokens() -> None:
    """Masked tokens are never drawn; logprobs renormalise over what the grammar allows (vLLM's order);
    when min_tokens forbids the only token the grammar allows (its EOS), the grammar wins."""
    logits = _logits(2)
    allowed = torch.zeros(2, VOCAB, dtype=torch.bool)
    allowed[0, [3, 4]] = True
    allowed[1, EOS] = True
    states = [SamplingState(SamplingParams(temperature=0)), _state(SamplingParams(temperature=0, min_tokens=9), PROMPT)]
    picks = sample(logits, states, allowed)
    assert picks[0].token_id == (3 if logits[0, 3] > logits[0, 4] else 4)
    assert picks[0].logprob == pytest.approx(float(torch.log_softmax(logits[0, [3, 4]], -1).max()), abs=1e-6)
    assert picks[1].token_id == EOS
