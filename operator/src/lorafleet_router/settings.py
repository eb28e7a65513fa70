"""The router's settings (``lorafleet-router --help``): one frozen dataclass, read from the
environment (``LORAFLEET_*``) and flags; each field declares its variable and help once (see
``lorafleet_operator.envflags``).
"""

from __future__ import annotations

from dataclasses import dataclass

from lorafleet_operator.envflags import WatchScope
from lorafleet_operator.envflags import setting as _opt


@dataclass(frozen=True, repr=False)  # EnvSettings.__repr__ hides secrets
class RouterSettings(WatchScope):
    """Everything the router can be told; see ``lorafleet-router --help``."""

    inference_port: int = _opt(8000, "LORAFLEET_INFERENCE_PORT", "workers' OpenAI inference port (router)")
    router_port: int = _opt(8000, "LORAFLEET_ROUTER_PORT", "router listen port")
    router_timeout: float = _opt(600.0, "LORAFLEET_ROUTER_TIMEOUT", "router: seconds per proxied request")
    bind_host: str = _opt("0.0.0.0", "LORAFLEET_BIND_HOST", "address the router listens on")
    router_unavailable_wait: float = _opt(
        30.0, "LORAFLEET_ROUTER_UNAVAILABLE_WAIT", "router: seconds a request waits for a holder when none is ready"
    )
    router_policy: str = _opt(
        "cache-aware",
        "LORAFLEET_ROUTER_POLICY",
        "router: cache-aware (prefix affinity within a load bound) or fewest-in-flight",
    )
    router_balance: float = _opt(
        1.25, "LORAFLEET_ROUTER_BALANCE", "router (cache-aware): most in-flight requests of a pod, times the mean"
    )
    router_min_match: float = _opt(
        0.5, "LORAFLEET_ROUTER_MIN_MATCH", "router (cache-aware): least fraction of a prompt seen on a pod to prefer it"
    )
    router_drain_delay: float = _opt(
        5.0,
        "LORAFLEET_ROUTER_DRAIN_DELAY",
        "router: seconds it keeps serving after SIGTERM with /ready failing, so Services stop sending to it",
    )
    router_drain_timeout: float = _opt(
        20.0, "LORAFLEET_ROUTER_DRAIN_TIMEOUT", "router: then, seconds requests in flight get to finish before it exits"
    )
    api_key: str = _opt(
        "",
        "LORAFLEET_API_KEY",
        "key clients must send as 'Authorization: Bearer KEY' on /v1/* (vLLM's --api-key; VLLM_API_KEY is read "
        "when LORAFLEET_API_KEY is unset; empty = no key needed)",
        secret=True,
        fallback_env=("VLLM_API_KEY",),
    )
    worker_api_key: str = _opt(
        "",
        "LORAFLEET_WORKER_API_KEY",
        "key the router sends to the workers on /v1/* in place of the client's (empty = --api-key; both empty: "
        "the client's Authorization header passes through)",
        secret=True,
    )
    demand_window: float = _opt(
        30.0, "LORAFLEET_DEMAND_WINDOW", "router: seconds over which per-adapter demand (GET /demand) is averaged"
    )

    def validate(self) -> None:
        if self.demand_window <= 0:
            raise ValueError("the demand window must be > 0")

    def upstream_key(self) -> str | None:
        """The key sent to the workers (None: the client's Authorization header passes through)."""
        return self.worker_api_key or self.api_key or None
