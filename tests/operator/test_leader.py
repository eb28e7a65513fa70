"""Leadership lost: the operator's work is cancelled and awaited before the process exits (a SystemExit
raised inside the event loop would leave kopf's tasks mid-cancellation)."""

from __future__ import annotations

import asyncio
from typing import cast

from lorafleet_operator.leader import LeaderElector, run_as_leader


class FakeElector:
    """Leads at once; loses the Lease when ``lose`` is set; records the release."""

    def __init__(self) -> None:
        self.lose = asyncio.Event()
        self.released = False

    async def acquire(self) -> None:
        return None

    async def keep(self) -> None:
        await self.lose.wait()

    async def release(self) -> None:
        self.released = True


async def test_losing_leadership_stops_the_work_cleanly_and_says_so() -> None:
    elector, events = FakeElector(), []

    async def work() -> None:
        try:
            events.append("started")
            elector.lose.set()
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(0)  # cleanup that itself awaits (kopf's does)
            events.append("cleaned up")
            raise

    lead = await run_as_leader(cast(LeaderElector, elector), work)
    assert lead is False and events == ["started", "cleaned up"] and elector.released
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert not others  # nothing left running for asyncio.run's teardown to cancel


async def test_work_that_ends_by_itself_returns_true_and_releases_the_lease() -> None:
    elector = FakeElector()

    async def work() -> None:
        await asyncio.sleep(0)

    assert await run_as_leader(cast(LeaderElector, elector), work) is True and elector.released


async def test_work_that_ignores_cancellation_is_left_after_the_bound() -> None:
    elector, stuck = FakeElector(), asyncio.Event()

    async def work() -> None:
        elector.lose.set()
        while not stuck.is_set():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue  # a handler that swallows cancellation must not keep the process alive

    assert await run_as_leader(cast(LeaderElector, elector), work, stop_s=0.05) is False
    stuck.set()  # let the leftover task end (run_as_leader cancelled it once more on its way out)
    await asyncio.sleep(0)
