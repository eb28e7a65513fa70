"""Huge pages for the worker's big tensors: `cli.main` asks PyTorch for them before torch allocates."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from lorafleet_worker.host import huge_pages

# A worker entry point run in a fresh interpreter, then one 32 MB tensor: how much of the process is on huge pages.
PROBE = """
import contextlib
from lorafleet_worker import cli
from lorafleet_worker.host import huge_pages
with contextlib.suppress(SystemExit):
    cli.main(["serve", "--help"])
import torch
t = torch.ones(8 << 20)  # kept alive while it is measured
print(huge_pages.huge_bytes())
"""


def _probe(tmp_path: Path, **env: str) -> int:
    environ = {k: v for k, v in os.environ.items() if k != huge_pages.ENV} | env
    r = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "m")], capture_output=True, text=True,
                       env=environ, timeout=300, check=True)  # fmt: skip
    return int(r.stdout.split()[-1])


def test_the_entry_point_puts_big_tensors_on_huge_pages_unless_told_not_to(tmp_path: Path) -> None:
    mode = huge_pages.kernel_mode()
    assert mode in ("always", "madvise", "never")
    on = _probe(tmp_path)
    if mode == "never":
        assert on == 0
        assert "'never'" in huge_pages.describe({huge_pages.ENV: "1"}, mode, on)
        return
    assert on >= 16 << 20  # the 32 MB tensor, less its unaligned ends
    if mode == "madvise":  # under `always` every big mapping gets huge pages anyway
        assert _probe(tmp_path, **{huge_pages.ENV: "0"}) < 16 << 20


def test_request_keeps_a_value_already_set() -> None:
    env: dict[str, str] = {}
    huge_pages.request(env)
    assert env == {huge_pages.ENV: "1"}
    env = {huge_pages.ENV: "0"}
    huge_pages.request(env)
    assert env == {huge_pages.ENV: "0"}


def test_kernel_mode_is_the_bracketed_word(tmp_path: Path) -> None:
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert huge_pages.kernel_mode(f) == "madvise"
    f.write_text("[always] madvise never\n")
    assert huge_pages.kernel_mode(f) == "always"
    assert huge_pages.kernel_mode(tmp_path / "absent") is None


def test_describe_says_why_pages_are_small() -> None:
    assert "off (THP_MEM_ALLOC_ENABLE='0')" in huge_pages.describe({huge_pages.ENV: "0"}, "madvise", 0)
    assert "'never'" in huge_pages.describe({huge_pages.ENV: "1"}, "never", 0)
    on = huge_pages.describe({huge_pages.ENV: "1"}, "madvise", 780 << 20)
    assert on.startswith("huge pages: on") and "780 MiB" in on


def test_huge_bytes_reads_anon_huge_pages(tmp_path: Path) -> None:
    f = tmp_path / "smaps_rollup"
    f.write_text("Rss:  1000 kB\nAnonHugePages:    303104 kB\nShmemPmdMapped:  0 kB\n")
    assert huge_pages.huge_bytes(f) == 303104 * 1024
    assert huge_pages.huge_bytes(tmp_path / "absent") is None
