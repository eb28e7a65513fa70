"""ConfigMapLedger: write-ahead claims, group-committed, in bulk."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from lorafleet_operator.kube import KubeClient, KubeError
from lorafleet_operator.ledger import ConfigMapLedger


class FakeKube:
    """The ConfigMap's merge patches, held until ``gate`` opens; ``fail`` makes the next one fail."""

    def __init__(self) -> None:
        self.patches: list[dict[str, str]] = []
        self.gate = asyncio.Event()
        self.fail = False

    async def get(self, path: str) -> dict[str, Any] | None:
        return {"data": {}}

    async def merge_patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        await self.gate.wait()
        if self.fail:
            self.fail = False
            raise KubeError(500, "etcd unavailable")
        self.patches.append(dict(body["data"]))
        return body


def ledger_with(kube: FakeKube) -> ConfigMapLedger:
    fake: Any = kube
    client: KubeClient = fake
    return ConfigMapLedger(client)


async def test_claim_many_writes_thousands_of_names_at_once() -> None:
    kube = FakeKube()
    kube.gate.set()
    ledger = ledger_with(kube)
    names = [f"org/lora-{i:04d}" for i in range(2000)]
    await ledger.claim_many("ns", "h1", names)
    assert ledger.writes == 1 and len(kube.patches) == 1
    assert kube.patches[0]["h1"].splitlines() == sorted(names)
    await ledger.claim("ns", "h1", names[5])  # written already: no write
    assert ledger.writes == 1


async def test_a_claim_returns_only_once_the_write_holding_its_name_succeeded() -> None:
    kube = FakeKube()
    ledger = ledger_with(kube)
    bulk = asyncio.ensure_future(ledger.claim_many("ns", "h1", ["a", "b"]))
    await asyncio.sleep(0)
    single = asyncio.ensure_future(ledger.claim("ns", "h1", "a"))  # known, but its write is in flight
    for _ in range(5):
        await asyncio.sleep(0)
    assert not bulk.done() and not single.done(), "returned before the name was written"
    kube.gate.set()
    await asyncio.gather(bulk, single)
    assert all("a\n" in p["h1"] for p in kube.patches)


async def test_a_failed_write_is_retried_by_the_next_claim_of_its_names() -> None:
    kube = FakeKube()
    kube.gate.set()
    kube.fail = True
    ledger = ledger_with(kube)
    with pytest.raises(KubeError):
        await ledger.claim_many("ns", "h1", ["a", "b"])
    assert kube.patches == []
    await ledger.claim("ns", "h1", "b")  # still unwritten: this claim writes (and waits)
    assert kube.patches == [{"h1": "a\nb\n"}]
    await ledger.claim("ns", "h1", "a")
    assert len(kube.patches) == 1
