"""Prometheus metrics of the router, defined once (served on its own ``/metrics``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

ROUTER_REQUESTS = Counter("lorafleet_router_requests_total", "Requests through the router", ["kind", "code"])
ROUTER_RETRIES = Counter("lorafleet_router_retries_total", "Requests retried on another endpoint")
ROUTER_INFLIGHT = Gauge("lorafleet_router_inflight", "Requests in flight through the router")
ROUTER_ADAPTER_INFLIGHT = Gauge(
    "lorafleet_router_adapter_inflight", "Requests in flight to workers through this router, per adapter", ["adapter"]
)
ROUTER_ADAPTER_QUEUED = Gauge(
    "lorafleet_router_adapter_queued", "Requests waiting in this router for a ready endpoint, per adapter", ["adapter"]
)
ROUTER_ADAPTER_REQUESTS = Counter(
    "lorafleet_router_adapter_requests_total", "Requests for each adapter through this router", ["adapter"]
)
