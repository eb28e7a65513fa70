"""Prometheus metrics of the operator and the router, defined once."""

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

ROUTER_REQUESTS = Counter("lorafleet_router_requests_total", "Requests through the router", ["kind", "code"])
ROUTER_RETRIES = Counter("lorafleet_router_retries_total", "Requests retried on another endpoint")
ROUTER_INFLIGHT = Gauge("lorafleet_router_inflight", "Requests in flight through the router")


def serve(port: int, host: str = "0.0.0.0") -> None:
    """Expose /metrics on ``port`` (0 = don't)."""
    if port:
        start_http_server(port, addr=host)


ROUTER_ADAPTER_INFLIGHT = Gauge(
    "lorafleet_router_adapter_inflight", "Requests in flight to workers through this router, per adapter", ["adapter"]
)
ROUTER_ADAPTER_QUEUED = Gauge(
    "lorafleet_router_adapter_queued", "Requests waiting in this router for a ready endpoint, per adapter", ["adapter"]
)
ROUTER_ADAPTER_REQUESTS = Counter(
    "lorafleet_router_adapter_requests_total", "Requests for each adapter through this router", ["adapter"]
)
