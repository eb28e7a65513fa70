"""Errors of adapter sources, shared by the worker side and the sync job."""

from __future__ import annotations


class SourceError(Exception):
    """A failed adapter fetch, with the HTTP status the management API should return.

    400: bad URI, missing object/repo/revision, invalid or tampered adapter files;
    502: store unreachable (connection refused/reset, 5xx) or refused our credentials;
    504: store timed out, or the fetch deadline passed; 507: disk cache full of pinned adapters.
    ``retryable`` says whether trying again later can help (network trouble, 5xx).
    """

    def __init__(self, status: int, message: str, *, retryable: bool | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retryable = status in (502, 503, 504) if retryable is None else retryable

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"SourceError({self.status}, {self.message!r})"
