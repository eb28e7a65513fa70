"""The drift pass: one ``GET /v1/loras`` per worker pod, compared with what that pod should hold.

Per pod, against the DynamoModels that own their names (``ModelIndex.owners``):
- a name placed on the pod (``status.placement``) but missing (worker restart, lost adapter):
  that model is re-queued, and only that one;
- a name some model wants but not on this pod (a leaver not unloaded yet): that model is re-queued;
- a name no DynamoModel wants that the ledger says the operator placed (a renamed modelName, a
  DynamoModel deleted while the operator was down): unloaded here;
- any other name (loaded by hand, by another tool) is left alone.
Adapters a worker loaded on demand (unpinned) are not placement: they are never re-queued for,
only unloaded as orphans when no DynamoModel wants them.
A name in the ledger that no listed pod holds any more is crossed out. Steady state costs one
listing per pod and no model reconcile.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from lorafleet_operator.inventory import WorkerInventory
from lorafleet_operator.ledger import Ledger
from lorafleet_operator.resources import Model, Pod

log = logging.getLogger(__name__)

Key = tuple[str, str]
Group = tuple[str, str]  # (namespace, base-model hash)


@dataclass
class DriftReport:
    listed: int = 0
    requeued: set[Key] = field(default_factory=set)
    unloaded: list[tuple[str, str]] = field(default_factory=list)  # (pod, name) orphans unloaded
    released: list[str] = field(default_factory=list)


async def drift_pass(
    inventory: WorkerInventory,
    ledger: Ledger,
    owners: Iterable[tuple[Key, Model]],
    requeue: Callable[[Key], None],
    wanted_now: Callable[[str, str, str], bool],
) -> DriftReport:
    """Compare every Ready pod of the inventory with the owners' placements; repair what differs.

    ``owners``: the live LoRA DynamoModels that own their served name. ``wanted_now(namespace,
    base_hash, name)`` re-checks, just before an orphan is unloaded, that no model claims it."""
    report = DriftReport()
    groups: defaultdict[Group, list[Pod]] = defaultdict(list)
    for pod in inventory.pods():
        if pod.ready and pod.ip and pod.base_hash:
            groups[(pod.namespace, pod.base_hash)].append(pod)
    wanted: defaultdict[Group, dict[str, tuple[Key, Model]]] = defaultdict(dict)
    for key, model in owners:
        wanted[(model.namespace, model.base_hash)][model.model_name] = (key, model)

    def flag(key: Key) -> None:
        report.requeued.add(key)
        requeue(key)

    for (namespace, base_hash), members in groups.items():
        want = wanted.get((namespace, base_hash), {})
        placed_on: defaultdict[str, list[tuple[Key, str]]] = defaultdict(list)
        for name, (key, model) in want.items():
            for pod_name in model.status.get("placement") or []:
                placed_on[pod_name].append((key, name))
        ours = await ledger.names(namespace, base_hash)
        listings = await asyncio.gather(*(inventory.fresh_listing(p) for p in members))
        complete, held = True, set()
        for pod, names in zip(members, listings, strict=True):
            if names is None:
                complete = False
                continue
            report.listed += 1
            on_demand = inventory.on_demand(pod)
            held |= names | on_demand
            for key, name in placed_on.get(pod.name, ()):
                if name not in names:
                    flag(key)
            for name in sorted(names | on_demand):
                if name in want:
                    key, model = want[name]
                    if name in names and pod.name not in (model.status.get("placement") or []):
                        flag(key)  # an on-demand copy is not the placement's: left to the worker
                elif (
                    name in ours
                    and not wanted_now(namespace, base_hash, name)
                    and await inventory.unload_orphan(pod, name)
                ):
                    report.unloaded.append((pod.name, name))
                    log.info("unloaded %s from pod %s: no DynamoModel wants it any more", name, pod.name)
        if complete:
            for name in sorted(ours - set(want) - held):
                if not wanted_now(namespace, base_hash, name):
                    await ledger.release(namespace, base_hash, name)
                    report.released.append(name)
    return report
