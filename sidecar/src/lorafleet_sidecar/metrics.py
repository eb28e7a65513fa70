"""The sidecar's Prometheus metrics on the system port's ``/metrics`` (vLLM's own are on its port)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["CONTENT_TYPE", "SidecarMetrics"]


class SidecarMetrics:
    """One registry per sidecar: adapter loads and unloads by outcome, load latency, adapters held, vLLM up."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.loads = Counter(
            "lorafleet_sidecar_lora_loads", "adapter loads into vLLM (hot swaps included)", ["outcome"],
            registry=self.registry,
        )  # fmt: skip
        self.unloads = Counter("lorafleet_sidecar_lora_unloads", "adapter unloads from vLLM", ["outcome"],
                               registry=self.registry)  # fmt: skip
        self.load_seconds = Histogram(
            "lorafleet_sidecar_lora_load_seconds", "fetch and vLLM load of one adapter", registry=self.registry,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )  # fmt: skip
        self.loras_held = Gauge("lorafleet_sidecar_loras", "adapters vLLM serves (last listing)",
                                registry=self.registry)  # fmt: skip
        self.vllm_up = Gauge("lorafleet_sidecar_vllm_up", "1 when vLLM's /health answered the last probe",
                             registry=self.registry)  # fmt: skip

    def render(self) -> bytes:
        return generate_latest(self.registry)
