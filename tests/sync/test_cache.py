"""The disk cache: atomic commit, byte cap with LRU eviction, pinned entries never evicted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from lorafleet_sync.cache import DiskCache, dir_size
from lorafleet_sync.errors import SourceError


def _key(i: int) -> str:
    return f"s3_{i:032x}"


def _add(cache: DiskCache, i: int, nbytes: int) -> Path:
    tmp = cache.new_temp(_key(i))
    (tmp / "adapter_model.safetensors").write_bytes(os.urandom(nbytes))
    return cache.commit(_key(i), tmp)


def test_commit_is_atomic_rename_and_tmp_is_cleaned(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path / "c", max_bytes=None)
    path = _add(cache, 1, 100)
    assert path == tmp_path / "c" / _key(1) and (path / "adapter_model.safetensors").stat().st_size == 100
    assert list(cache.tmp_root.iterdir()) == []
    assert cache.get(_key(1)) == path and cache.get(_key(2)) is None


def test_byte_cap_evicts_least_recently_used(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path / "c", max_bytes=2500)
    for i in range(3):
        _add(cache, i, 1000)
    assert cache.keys() == [_key(1), _key(2)]  # 0 was evicted
    cache.get(_key(1))  # 1 is now the most recently used
    _add(cache, 3, 1000)
    assert cache.keys() == [_key(1), _key(3)]
    assert not (tmp_path / "c" / _key(0)).exists() and not (tmp_path / "c" / _key(2)).exists()
    assert dir_size(tmp_path / "c") <= 2500 and cache.total_bytes <= 2500


def test_pinned_entries_are_never_evicted(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path / "c", max_bytes=2500)
    _add(cache, 0, 1000)
    cache.pin(_key(0))
    for i in range(1, 5):
        _add(cache, i, 1000)
        assert _key(0) in cache and cache.total_bytes <= 2500
    _add(cache, 5, 1000)
    cache.pin(_key(5))
    with pytest.raises(SourceError) as err:
        _add(cache, 6, 1000)
    assert err.value.status == 507
    assert list(cache.tmp_root.iterdir()) == []  # the refused download is gone
    cache.unpin(_key(0))
    _add(cache, 6, 1000)
    assert sorted(cache.keys()) == [_key(5), _key(6)]


def test_entry_larger_than_cap_is_refused(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path / "c", max_bytes=500)
    with pytest.raises(SourceError) as err:
        cache.reserve(_key(1), 1000)
    assert err.value.status == 507


def test_reservation_makes_room_before_download(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path / "c", max_bytes=2000)
    _add(cache, 0, 1000)
    _add(cache, 1, 800)
    cache.reserve(_key(2), 900)
    assert cache.keys() == [_key(1)]  # room made before any byte is written
    cache.release(_key(2))


def test_restart_keeps_entries_in_lru_order_and_drops_temp_dirs(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path / "c", max_bytes=10_000)
    for i in range(3):
        _add(cache, i, 100)
        os.utime(tmp_path / "c" / _key(i), (1000 + i, 1000 + i))
    os.utime(tmp_path / "c" / _key(0), (2000, 2000))  # 0 used last
    leftover = cache.new_temp(_key(9))
    (leftover / "partial").write_bytes(b"x")
    reopened = DiskCache(tmp_path / "c", max_bytes=10_000)
    assert reopened.keys() == [_key(1), _key(2), _key(0)]
    assert reopened.total_bytes == 300
    assert not leftover.exists()


def test_leased_entries_are_evicted_last(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path / "c", max_bytes=2500)
    _add(cache, 0, 1000)
    _add(cache, 1, 1000)
    cache.lease(_key(0), 60)  # just handed out, about to be pinned
    _add(cache, 2, 1000)
    assert cache.keys() == [_key(0), _key(2)]  # 1 went first although 0 is older
    cache.lease(_key(2), 60)
    _add(cache, 3, 1000)  # only leased entries are left: the least recently used goes rather than failing
    assert cache.keys() == [_key(2), _key(3)]
