"""The worker pods' readiness gate: a pod is Ready only once it holds the adapters placed on it.

The chart lists the condition ``lorafleet.dev/adapters-loaded`` in every worker pod's
``readinessGates``; the kubelet then reports the pod Ready only when its containers are ready
*and* this condition is True, and only the operator sets it. A rollout (``maxSurge: 0``) stops the
next old worker, and a drain under the PodDisruptionBudget evicts the next one, only once the new
worker serves what the placement gave it: make-before-break across pod replacements, whatever the
time an adapter takes to load (the AWS Load Balancer Controller gates pods on its targets the
same way).

Rules (``PodGates``), for pods whose spec lists the gate:
- a pod whose containers turn ready (``Pod.ready``: the operator places on ``ContainersReady``, as
  ``Ready`` waits for this gate) is *waiting*: the LoRA models its arrival queued must each finish a
  reconcile pass, then every live LoRA model whose ``status.placement`` names the pod must list it
  as a ready endpoint; then the condition is set True (a pod with nothing placed opens at once);
- a pod whose containers stop being ready while its gate is open (a restarted worker comes back
  empty) gets the condition False, so it is Ready again only once it holds its adapters again;
- an open gate is never closed otherwise (a model added later does not make a serving pod unready).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence

from lorafleet_operator.kube import KubeClient, KubeError
from lorafleet_operator.resources import ADAPTERS_GATE, Model, Pod
from lorafleet_operator.status import now_iso

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, DynamoModel name)


def holds_its_placement(pod: Pod, models: Iterable[Model]) -> list[str]:
    """The modelNames placed on ``pod`` that it does not serve yet (empty: the gate may open)."""
    missing = []
    for model in models:
        if pod.name not in (model.status.get("placement") or []):
            continue
        endpoints = model.status.get("endpoints") or []
        if not any(e.get("podName") == pod.name and e.get("ready") for e in endpoints):
            missing.append(model.model_name)
    return sorted(missing)


class PodGates:
    """Which gated pods wait for their adapters, and the task that writes their condition."""

    def __init__(self, kube: KubeClient, models: Callable[[str, str | None], Sequence[Model]]) -> None:
        self.kube = kube
        self._models = models  # (namespace, base hash) -> live LoRA models: ModelIndex.loras_of
        self._waiting: dict[str, tuple[Pod, set[Key]]] = {}  # pod uid -> (pod, models still to pass)
        self._closing: dict[str, Pod] = {}  # pod uid -> pod whose open gate must close
        self._wakeup = asyncio.Event()

    # ---- inputs -------------------------------------------------------------------------
    def on_pod(self, pod: Pod, joined: set[Key] | None) -> None:
        """A pod event; ``joined``: the LoRA models queued because the pod's containers turned ready
        (None: it did not join now)."""
        if not pod.gated:
            return
        if not pod.ready:
            self._waiting.pop(pod.uid, None)
            if pod.gate_open and pod.ip and not pod.terminating:
                self._closing[pod.uid] = pod
                self._wakeup.set()
            return
        self._closing.pop(pod.uid, None)
        if pod.gate_open:
            self._waiting.pop(pod.uid, None)
        elif joined is not None:
            self._waiting[pod.uid] = (pod, set(joined))
            self._wakeup.set()
        elif pod.uid in self._waiting:
            self._waiting[pod.uid] = (pod, self._waiting[pod.uid][1])

    def after_pass(self, key: Key) -> None:
        """A reconcile pass of ``key`` published its status: waiting pods may open."""
        for _pod, pending in self._waiting.values():
            pending.discard(key)
        if self._waiting:
            self._wakeup.set()

    # ---- the writer task ------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            await self.write_due()

    async def write_due(self) -> None:
        """Close the gates of restarted pods; open those of waiting pods that hold their placement."""
        for uid, pod in list(self._closing.items()):
            restarted = "its containers are not ready: a restarted worker loads its adapters again"
            if self._closing.get(uid) is pod and await self._write(pod, False, "ContainersNotReady", restarted):
                self._closing.pop(uid, None)
        for uid, (pod, pending) in list(self._waiting.items()):
            if pending:
                continue
            missing = holds_its_placement(pod, self._models(pod.namespace, pod.base_hash))
            if missing:
                log.debug("pod %s: waiting for %s before it is Ready", pod.name, ", ".join(missing))
                continue
            if self._waiting.get(uid, (None,))[0] is pod and await self._write(
                pod, True, "AdaptersLoaded", "holds every adapter placed on it"
            ):
                self._waiting.pop(uid, None)

    async def _write(self, pod: Pod, open_: bool, reason: str, message: str) -> bool:
        condition = {"type": ADAPTERS_GATE, "status": "True" if open_ else "False", "reason": reason,
                     "message": message, "lastTransitionTime": now_iso()}  # fmt: skip
        path = f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}/status"
        try:
            await self.kube.strategic_patch(path, {"status": {"conditions": [condition]}})
        except Exception as e:
            if isinstance(e, KubeError) and e.status == 404:
                return True  # gone: nothing to gate
            log.warning("setting %s=%s on pod %s failed: %s (retrying)", ADAPTERS_GATE, open_, pod.name, e)
            asyncio.get_running_loop().call_later(1.0, self._wakeup.set)
            return False
        log.info("pod %s: %s=%s (%s)", pod.name, ADAPTERS_GATE, open_, message)
        return True
