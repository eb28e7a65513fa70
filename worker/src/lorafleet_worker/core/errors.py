"""Errors of the engine that the HTTP layer maps to a status (no torch import: the servers import it)."""

from __future__ import annotations


class EngineUnavailableError(RuntimeError):
    """The engine's step loop is not running (it died, or was stopped): HTTP 503, so that the router
    retries the request on another holder and the kubelet restarts this worker (its /health fails)."""
