"""Token sampling: greedy, temperature, top-k, top-p, seeds and logprobs."""

from __future__ import annotations

import pytest
import torch
from lorafleet_worker.ops import cpu_attention
from lorafleet_worker.sample.params import SampledToken, SamplingParams
from lorafleet_worker.sample.sampler import SamplingState, make_generator
from lorafleet_worker.sample.sampler import sample as sample_states

CPU = torch.device("cpu")


def sample(
    logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]
) -> list[SampledToken]:
    return sample_states(logits, [SamplingState(p, g) for p, g in zip(params, gens, strict=True)])


def _logits(rows: int = 3, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_picks_argmax_with_raw_logprobs_and_top_k() -> None:
    logits = _logits()
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0), SamplingParams(temperature=0)]
    out = sample(logits, params, [None] * 3)
    ref = torch.log_softmax(logits, -1)
    for r, tok in enumerate(out):
        assert tok.token_id == int(logits[r].argmax())
        assert tok.logprob == pytest.approx(float(ref[r, tok.token_id]), abs=1e-6)
    top = out[0].top_logprobs
    assert top is not None and len(top) == 3
    vals, idx = ref[0].topk(3)
    assert list(top) == idx.tolist() and list(top.values()) == pytest.approx(vals.tolist())
    assert out[1].top_logprobs is None


def test_logprobs_zero_gives_chosen_token_only() -> None:
    out = sample(_logits(1), [SamplingParams(temperature=0, logprobs=0)], [None])
    assert out[0].top_logprobs == {}


def test_logprob_is_temperature_free() -> None:
    logits = _logits(1)
    out = sample(logits, [SamplingParams(temperature=5.0, seed=1)], [make_generator(1, CPU)])
    assert out[0].logprob == pytest.approx(float(torch.log_softmax(logits, -1)[0, out[0].token_id]), abs=1e-6)


def test_seeded_sampling_is_deterministic_and_independent_of_batch() -> None:
    logits = _logits(4)
    p = SamplingParams(temperature=1.0, seed=1234)

    def draw(rows: list[int]) -> list[list[int]]:
        gens = [make_generator(1234, CPU) for _ in rows]
        seqs: list[list[int]] = [[] for _ in rows]
        for _ in range(20):
            out = sample(logits[rows], [p] * len(rows), gens)
            for s, t in zip(seqs, out, strict=True):
                s.append(t.token_id)
        return seqs

    alone = draw([2])[0]
    batched = draw([0, 2, 3])
    assert batched[1] == alone
    assert draw([2])[0] == alone
    assert len(set(alone)) > 1  # really sampled, not greedy


def test_top_k_and_top_p_restrict_support() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    probs = logits.softmax(-1)[0]
    gen = make_generator(0, CPU)
    seen_k = {sample(logits, [SamplingParams(temperature=1.0, top_k=2)], [gen])[0].token_id for _ in range(200)}
    assert seen_k == {0, 1}
    top_p = float(probs[:2].sum()) - 1e-3  # the smallest set reaching top_p is the first two tokens
    seen_p = {sample(logits, [SamplingParams(temperature=1.0, top_p=top_p)], [gen])[0].token_id for _ in range(200)}
    assert seen_p == {0, 1}
    one = {sample(logits, [SamplingParams(temperature=1.0, top_p=0.01)], [gen])[0].token_id for _ in range(50)}
    assert one == {0}


def test_temperature_sampling_follows_the_distribution() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    gen = make_generator(7, CPU)
    n = 3000
    counts = torch.zeros(3)
    for _ in range(n):
        counts[sample(logits, [SamplingParams(temperature=1.0)], [gen])[0].token_id] += 1
    assert torch.allclose(counts / n, logits.softmax(-1)[0], atol=0.03)


def test_mixed_greedy_and_sampled_rows() -> None:
    logits = _logits(2)
    gens = [None, make_generator(3, CPU)]
    out = sample(logits, [SamplingParams(temperature=0), SamplingParams(temperature=2.0, top_k=5)], gens)
    assert out[0].token_id == int(logits[0].argmax())
    assert out[1].token_id in logits[1].topk(5).indices.tolist()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_validate_rejects_out_of_range(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs).validate()  # type: ignore[arg-type]


@pytest.mark.skipif(not cpu_attention.available(), reason="the C++ CPU ops do not build")
@pytest.mark.parametrize("vocab", [5, 8, 50, 49153])  # below one vector, one vector, a tail, the real vocab + 1
def test_plain_greedy_rows_take_the_one_pass_pick(vocab: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """All-greedy rows without processors or logprobs go through `cpu_attention.greedy_pick`: the first
    maximum (ties included) and the chosen log-probability of the general path."""
    logits = _logits(rows=4, vocab=vocab, seed=vocab)
    logits[1, vocab // 3] = logits[1, vocab - 1] = logits[1].max() + 1  # a tie: the first index wins
    logits[2] = 0.0  # every token ties
    params = [SamplingParams(temperature=0)] * 4
    calls = []
    pick = cpu_attention.greedy_pick
    monkeypatch.setattr(cpu_attention, "greedy_pick", lambda x: calls.append(1) or pick(x))
    fast = sample(logits, params, [None] * 4)
    assert calls == [1]
    ref = torch.log_softmax(logits, -1)
    assert [t.token_id for t in fast] == logits.argmax(-1).tolist() and fast[1].token_id == vocab // 3
    for r, tok in enumerate(fast):
        assert tok.logprob == pytest.approx(float(ref[r, tok.token_id]), abs=1e-5) and tok.top_logprobs is None


@pytest.mark.skipif(not cpu_attention.available(), reason="the C++ CPU ops do not build")
def test_non_finite_logits_keep_the_torch_path() -> None:
    for bad in (float("nan"), float("inf"), float("-inf")):
        logits = _logits(rows=2, vocab=40)
        logits[1, 17] = bad
        assert cpu_attention.greedy_pick(logits) is None
        out = sample(logits, [SamplingParams(temperature=0)] * 2, [None] * 2)
        assert [t.token_id for t in out] == logits.argmax(-1).tolist()  # torch's argmax: NaN and inf win
    assert cpu_attention.greedy_pick(_logits(rows=2, vocab=40)) is not None
