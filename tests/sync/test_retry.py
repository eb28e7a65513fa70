"""The one retry helper (issue 13, outcome 8): the same loop for blocking and asyncio callers."""

from __future__ import annotations

import math

import pytest
from lorafleet_sync.errors import SourceError
from lorafleet_sync.retry import FetchPolicy, retry_async, retry_call


class Flaky:
    """Fails with ``errors`` in turn, then answers "ok"; counts calls."""

    def __init__(self, *errors: Exception) -> None:
        self.errors, self.calls = list(errors), 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"

    async def acall(self) -> str:
        return self()


NO_WAIT = FetchPolicy(deadline_s=math.inf, initial_backoff_s=0.0, attempts=3)


def test_blocking_and_async_share_attempts_and_predicate() -> None:
    import asyncio

    for run in (lambda f: retry_call(f, NO_WAIT, ""), lambda f: asyncio.run(retry_async(f.acall, NO_WAIT))):
        flaky = Flaky(SourceError(503, "busy"), SourceError(502, "busy"))
        assert run(flaky) == "ok" and flaky.calls == 3
        flaky = Flaky(*(SourceError(503, "busy") for _ in range(3)))
        with pytest.raises(SourceError, match="busy"):
            run(flaky)
        assert flaky.calls == 3  # attempts used up
        flaky = Flaky(SourceError(404, "no such repo"))
        with pytest.raises(SourceError, match="no such repo"):
            run(flaky)
        assert flaky.calls == 1  # permanent: at once


async def test_custom_predicate_and_deadline_message() -> None:
    retried: list[int] = []
    flaky = Flaky(ValueError("transient"))
    out = await retry_async(flaky.acall, NO_WAIT, retryable=lambda e: isinstance(e, ValueError),
                            on_retry=lambda: retried.append(1))  # fmt: skip
    assert out == "ok" and retried == [1]
    with pytest.raises(KeyError):
        await retry_async(Flaky(KeyError("x")).acall, NO_WAIT, retryable=lambda e: isinstance(e, ValueError))
    short = FetchPolicy(deadline_s=0.0, initial_backoff_s=1.0)
    with pytest.raises(SourceError, match=r"gave up after 1 attempts \(0s deadline\)"):
        retry_call(Flaky(SourceError(503, "busy")), short, "")
