"""The Kubernetes objects the operator and the router share, as plain frozen dataclasses.

``Pod`` is a worker pod (label ``nvidia.com/dynamo-base-model-hash``); ``Model`` is a
DynamoModel (either API version: both serve the same schema). Both are parsed from the API
server's JSON bodies; nothing here talks to Kubernetes or to workers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from lorafleet_sync.ids import BASE_MODEL_HASH_LABEL, base_model_hash

# The engine a worker pod runs (the chart's label); "vllm" pods (vLLM worker groups) hold only what the
# operator placed on them: they load nothing on demand.
ENGINE_LABEL = "lorafleet.dev/engine"
# The readiness gate the operator opens once a worker pod holds its adapters (gates.py).
ADAPTERS_GATE = "lorafleet.dev/adapters-loaded"


@dataclass(frozen=True, order=True)
class Pod:
    """A worker pod as the operator and router see it.

    ``ready``: its containers are ready (``ContainersReady``) and it is not terminating (eligible for
    placement and routing; the pod's ``Ready`` also waits for the operator's readiness gate, which
    opens only after placement: see gates.py). ``serving``: containers ready, terminating included: a
    pod being deleted keeps answering through its grace period, so it stays a holder until the
    adapter is ready elsewhere (Kubernetes' serving-terminating endpoints). ``gated``: its spec lists
    the gate ``ADAPTERS_GATE``; ``gate_open``: that condition is True."""

    namespace: str
    name: str
    uid: str = ""
    ip: str | None = None
    ready: bool = False
    base_hash: str | None = None
    serving: bool = False
    loads_on_demand: bool = True  # not a vLLM worker group's pod (ENGINE_LABEL)
    gated: bool = False
    gate_open: bool = False
    terminating: bool = False

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Pod:
        meta, status = body.get("metadata") or {}, body.get("status") or {}
        conditions = {c.get("type"): c.get("status") == "True" for c in status.get("conditions") or []}
        labels = meta.get("labels") or {}
        serving = bool(status.get("phase") == "Running" and status.get("podIP") and conditions.get("ContainersReady"))
        gates = {g.get("conditionType") for g in (body.get("spec") or {}).get("readinessGates") or []}
        return cls(
            namespace=meta.get("namespace", ""),
            name=meta.get("name", ""),
            uid=meta.get("uid", ""),
            ip=status.get("podIP") or None,
            ready=serving and not meta.get("deletionTimestamp"),
            base_hash=labels.get(BASE_MODEL_HASH_LABEL),
            serving=serving,
            loads_on_demand=labels.get(ENGINE_LABEL) != "vllm",
            gated=ADAPTERS_GATE in gates,
            gate_open=bool(conditions.get(ADAPTERS_GATE)),
            terminating=bool(meta.get("deletionTimestamp")),
        )

    def address(self, port: int) -> str:
        return f"http://{self.ip}:{port}"


@dataclass(frozen=True)
class Model:
    """The parts of a DynamoModel the operator and router read."""

    namespace: str
    name: str
    uid: str
    generation: int
    model_name: str
    base_model_name: str
    model_type: str = "base"
    uri: str | None = None
    replicas: int | None = None
    autoscaling: Mapping[str, Any] | None = None  # spec.autoscaling (lorafleet extension)
    credentials_secret: str | None = None  # spec.source.credentialsSecretRef.name (lorafleet extension)
    status: Mapping[str, Any] = field(default_factory=dict)
    deleting: bool = False
    created: str = ""  # metadata.creationTimestamp (RFC 3339, sorts chronologically)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Model:
        meta, spec = body.get("metadata") or {}, body.get("spec") or {}
        return cls(
            namespace=meta.get("namespace", ""),
            name=meta.get("name", ""),
            uid=meta.get("uid", ""),
            generation=int(meta.get("generation") or 0),
            model_name=str(spec.get("modelName", "")),
            base_model_name=str(spec.get("baseModelName", "")),
            model_type=str(spec.get("modelType") or "base").lower(),
            uri=(spec.get("source") or {}).get("uri"),
            replicas=spec.get("replicas"),
            autoscaling=spec.get("autoscaling") or None,
            credentials_secret=((spec.get("source") or {}).get("credentialsSecretRef") or {}).get("name") or None,
            status=dict(body.get("status") or {}),
            deleting=bool(meta.get("deletionTimestamp")),
            created=str(meta.get("creationTimestamp") or ""),
        )

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    @cached_property
    def base_hash(self) -> str:
        """The base model's label value (a sha256, computed once per parsed object: it is read per pod)."""
        return base_model_hash(self.base_model_name)

    @property
    def is_lora(self) -> bool:
        return self.model_type == "lora"

    @property
    def catalog_uri(self) -> str | None:
        """The URI a worker may load this adapter from on demand (its catalogue entry): the version
        the operator last loaded on its whole placement (``status.servedUri``); None while nothing
        has served, for other model types and while it is being deleted. Only the owner of a name
        is catalogued (``seniority``)."""
        if not self.is_lora or self.deleting:
            return None
        return str(self.status.get("servedUri") or "") or None

    @property
    def seniority(self) -> tuple[str, str, str]:
        """Sort key of name ownership: the oldest (creationTimestamp, then namespace/name) first."""
        return (self.created, self.namespace, self.name)

    @property
    def served_name(self) -> tuple[str, str]:
        """What one owner may serve: (base-model hash, modelName)."""
        return (self.base_hash, self.model_name)
