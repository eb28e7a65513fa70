"""Prometheus metrics of the operator, defined once (the router's are ``lorafleet_router.metrics``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

RECONCILES = Counter("lorafleet_operator_reconciles_total", "DynamoModel reconciles", ["result"])
RECONCILE_SECONDS = Histogram("lorafleet_operator_reconcile_seconds", "Duration of one DynamoModel reconcile")
WORKER_CALLS = Counter("lorafleet_operator_worker_calls_total", "Calls to workers' management API", ["op", "outcome"])
WORKER_CALL_SECONDS = Histogram(
    "lorafleet_operator_worker_call_seconds",
    "Latency of calls to workers' management API",
    ["op"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
SYNC_JOBS = Counter("lorafleet_operator_sync_jobs_total", "Sync Job outcomes seen", ["outcome"])
PLACEMENT_CHURN = Counter(
    "lorafleet_operator_placement_changes_total", "Pods added to or removed from adapter placements", ["change"]
)
MODELS = Gauge("lorafleet_operator_models", "DynamoModels known to the operator, by phase", ["phase"])


def serve(port: int, host: str = "0.0.0.0") -> None:
    """Expose /metrics on ``port`` (0 = don't)."""
    if port:
        start_http_server(port, addr=host)
