"""Errors of the LoRA layer; each maps to one HTTP status of the management API."""

from __future__ import annotations


class LoRAError(Exception):
    """Base class; `status` is the HTTP status the management API answers with."""

    status = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class AdapterError(LoRAError):
    """The adapter is invalid or unsupported for this base model (HTTP 400)."""

    status = 400


class AdapterNotFoundError(LoRAError):
    """No adapter of that name is registered, or it is being removed (HTTP 404)."""

    status = 404


class CapacityError(LoRAError):
    """No room to hold another adapter (HTTP 507)."""

    status = 507
