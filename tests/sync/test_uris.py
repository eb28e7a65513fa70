"""Adapter URI parsing, validation and cache keys (SPEC §5)."""

from __future__ import annotations

import re

import blake3
import pytest
from hypothesis import given
from hypothesis import strategies as st
from lorafleet_sync.uris import (
    S3URI,
    FileURI,
    HfURI,
    URIError,
    cache_key,
    parse_uri,
    synced_uri,
    validate_relative_key,
)

SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("hf://org/repo", HfURI("org", "repo")),
        ("hf://Org-1/my.repo_2@main", HfURI("Org-1", "my.repo_2", "main")),
        ("hf://org/repo@refs/pr/3", HfURI("org", "repo", "refs/pr/3")),
        (f"hf://org/repo@{SHA}", HfURI("org", "repo", SHA)),
        ("s3://bucket", S3URI("bucket")),
        ("s3://bucket/", S3URI("bucket")),
        ("s3://my-bucket/a/b/c/", S3URI("my-bucket", "a/b/c")),
        ("file:///srv/adapters/x", FileURI("/srv/adapters/x")),
        ("file://localhost/srv/a%20b", FileURI("/srv/a b")),
    ],
)
def test_parse_valid(uri: str, expected: object) -> None:
    assert parse_uri(uri) == expected


@pytest.mark.parametrize(
    "uri",
    [
        "",
        "org/repo",
        "http://example.com/x",
        "hf://repo",
        "hf://org/repo/extra",
        "hf://org/../repo",
        "hf://org/re..po",
        "hf://org/repo@",
        "hf://org/repo@../main",
        "hf://org/repo@/abs",
        "hf://org/repo@a b",
        "s3://",
        "s3://Bucket/x",
        "s3://b/x",
        "s3://bucket//abs/key",
        "s3://bucket/a/../b",
        "s3://bucket/a/./b",
        "s3://bucket/a//b",
        "s3://bucket/a\\b",
        "file://host/x",
        "file:relative",
        "file:///srv/../etc",
        "file:///srv/%2e%2e/etc",
        "file:///srv/a%00b",
        " hf://org/repo",
    ],
)
def test_parse_invalid(uri: str) -> None:
    with pytest.raises(URIError):
        parse_uri(uri)


def test_canonical_form_round_trips() -> None:
    for uri in ["hf://org/repo@v1", "s3://bucket/a/b", "file:///srv/a%20b", "s3://bucket"]:
        assert str(parse_uri(uri)) == uri
        assert parse_uri(str(parse_uri(uri))) == parse_uri(uri)


def test_cache_key_is_scheme_and_32_hex_of_blake3() -> None:
    key = cache_key("s3://bucket/prefix/")  # canonicalised: trailing slash dropped
    assert key == "s3_" + blake3.blake3(b"s3://bucket/prefix").hexdigest()[:32]
    assert re.fullmatch(r"hf_[0-9a-f]{32}", cache_key("hf://org/repo"))
    assert cache_key("hf://org/repo@main") != cache_key("hf://org/repo@v2")


def test_synced_uri_composes_prefix_org_repo_sha() -> None:
    source = parse_uri("hf://org/repo@main")
    assert isinstance(source, HfURI)
    assert str(synced_uri(source, S3URI("adapters"), SHA)) == f"s3://adapters/org/repo/{SHA}"
    assert str(synced_uri(source, S3URI("adapters", "hf/mirror"), SHA)) == f"s3://adapters/hf/mirror/org/repo/{SHA}"
    with pytest.raises(URIError):
        synced_uri(source, S3URI("adapters"), "main")


@pytest.mark.parametrize("key", ["../x", "a/../../x", "/etc/passwd", "a//b", "./a", "a/.", "a\\..\\b", "a\x00"])
def test_relative_key_refuses_traversal(key: str) -> None:
    with pytest.raises(URIError):
        validate_relative_key(key)


@given(st.lists(st.sampled_from(["a", "b", ".", "..", "", "c.d", "..e"]), min_size=1, max_size=6))
def test_accepted_keys_never_escape(segments: list[str]) -> None:
    key = "/".join(segments)
    try:
        validate_relative_key(key)
    except URIError:
        return
    depth = 0
    for seg in key.split("/"):
        depth += -1 if seg == ".." else 1
        assert depth > 0 and seg not in ("", ".", "..")
