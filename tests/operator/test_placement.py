"""Property tests of HRW placement (lorafleet_operator.placement)."""

from __future__ import annotations

import math
from collections import Counter

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lorafleet_operator.placement import hrw_score, place, rank

names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-./_", min_size=1, max_size=40)
pod_sets = st.lists(st.from_regex(r"worker-[a-z0-9]{1,10}", fullmatch=True), min_size=1, max_size=12, unique=True)


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper critical value of chi-square (Wilson-Hilferty); z=3.09 is p=0.001."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_score_definition_is_blake3_with_nul_separator() -> None:
    expected = int.from_bytes(blake3.blake3(b"my-lora\x00worker-0").digest()[:8], "big")
    assert hrw_score("my-lora", "worker-0") == expected
    # the separator keeps ("ab", "c") and ("a", "bc") apart
    assert hrw_score("ab", "c") != hrw_score("a", "bc")


@given(model=names, pods=pod_sets, replicas=st.integers(1, 15))
def test_deterministic_and_order_independent(model: str, pods: list[str], replicas: int) -> None:
    first = place(model, pods, replicas)
    assert first == place(model, list(reversed(pods)), replicas)
    assert len(first) == min(replicas, len(pods))
    assert len(set(first)) == len(first)
    assert first == rank(model, pods)[: len(first)]


@given(model=names, pods=pod_sets, replicas=st.integers(1, 5))
def test_more_replicas_extend_fewer(model: str, pods: list[str], replicas: int) -> None:
    """Scaling an adapter's replicas up only adds pods (placements are prefixes of one ranking)."""
    assert place(model, pods, replicas + 1)[:replicas] == place(model, pods, replicas)


@given(model=names, pods=pod_sets, new_pod=st.from_regex(r"node-[a-z0-9]{1,10}", fullmatch=True), r=st.integers(1, 4))
def test_adding_a_pod_moves_at_most_one_slot(model: str, pods: list[str], new_pod: str, r: int) -> None:
    before = place(model, pods, r)
    after = place(model, [*pods, new_pod], r)
    if new_pod in after:
        assert set(after) - set(before) == {new_pod}
        assert len(set(before) - set(after)) == (1 if len(pods) >= r else 0)
    else:
        assert after == before


@given(model=names, pods=pod_sets, r=st.integers(1, 4), data=st.data())
def test_removing_a_pod_moves_only_its_placements(model: str, pods: list[str], r: int, data: st.DataObject) -> None:
    gone = data.draw(st.sampled_from(pods))
    before = place(model, pods, r)
    after = place(model, [p for p in pods if p != gone], r)
    if gone in before:
        assert set(before) - set(after) == {gone}
        assert set(after) >= set(before) - {gone}
    else:
        assert after == before


def test_balanced_chi_square_over_10000_adapters() -> None:
    pods = [f"worker-{i}" for i in range(7)]
    adapters = [f"org/adapter-{i}" for i in range(10_000)]
    counts = Counter(place(a, pods, 1)[0] for a in adapters)
    expected = len(adapters) / len(pods)
    chi2 = sum((counts[p] - expected) ** 2 / expected for p in pods)
    assert chi2 < chi2_critical(len(pods) - 1), (chi2, counts)
    # with replicas 2 every pod holds close to 2/7 of the adapters
    held = Counter(p for a in adapters for p in place(a, pods, 2))
    for pod in pods:
        assert abs(held[pod] / len(adapters) - 2 / 7) < 0.02, held


def test_adding_a_pod_moves_about_r_over_n_plus_1() -> None:
    adapters = [f"lora-{i}" for i in range(10_000)]
    for n, r in [(4, 2), (5, 3), (9, 1)]:
        pods = [f"worker-{i}" for i in range(n)]
        grown = [*pods, "worker-new"]
        changed = sum(set(place(a, pods, r)) != set(place(a, grown, r)) for a in adapters)
        assert abs(changed / len(adapters) - r / (n + 1)) < 0.02, (n, r, changed)


def test_removing_a_pod_moves_exactly_its_share() -> None:
    adapters = [f"lora-{i}" for i in range(5_000)]
    pods = [f"worker-{i}" for i in range(5)]
    shrunk = pods[1:]
    for a in adapters:
        before, after = place(a, pods, 2), place(a, shrunk, 2)
        if "worker-0" in before:
            assert [p for p in before if p != "worker-0"] == after[:1]
        else:
            assert before == after


def test_invalid_replicas_rejected() -> None:
    with pytest.raises(ValueError, match="replicas"):
        place("m", ["a"], 0)


@settings(max_examples=50)
@given(model=names, pods=pod_sets)
def test_more_replicas_than_pods_means_all(model: str, pods: list[str]) -> None:
    assert sorted(place(model, pods, len(pods) + 3)) == sorted(pods)
