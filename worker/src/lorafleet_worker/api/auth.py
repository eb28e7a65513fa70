"""Inference authentication as vLLM's `--api-key`: requests to `/v1/*` must carry `Authorization: Bearer <key>`.

Everything else on the inference port stays open (`/health`, `/ready`, `/metrics`, `/version`, `/tokenize`),
as do CORS preflights (OPTIONS), exactly as vLLM's `AuthenticationMiddleware` decides. A refused request gets
OpenAI's 401 body (`{"error": {"message", "type", "param", "code"}}`), which the `openai` client raises as
`AuthenticationError`. The key is compared by its SHA-256 digest in constant time and is never logged.
The management port has its own admin token (`WorkerService.check_admin`); this module does not touch it.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger(__name__)

PROTECTED_PREFIX = "/v1"


def unauthorized_body(provided: bool) -> dict[str, Any]:
    """OpenAI's 401 error body: no key, or a wrong one (never echoed)."""
    if provided:
        message, code = "Incorrect API key provided.", "invalid_api_key"
    else:
        message, code = "You didn't provide an API key: send it as 'Authorization: Bearer <key>'.", None
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (scheme case-insensitive), else None."""
    scheme, _, token = (authorization or "").partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


class APIKeyMiddleware:
    """An ASGI wrapper that answers 401 to `/v1/*` requests without the key."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()

    def __repr__(self) -> str:  # the key stays out of any repr
        return f"{type(self).__name__}(app={self.app!r})"

    def allows(self, authorization: str | None) -> bool:
        token = bearer_token(authorization)
        return token is not None and secrets.compare_digest(hashlib.sha256(token.encode()).digest(), self._digest)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if not path.startswith(PROTECTED_PREFIX):
            await self.app(scope, receive, send)
            return
        authorization = Headers(scope=scope).get("authorization")
        if self.allows(authorization):
            await self.app(scope, receive, send)
            return
        log.info("%s %s -> 401: missing or wrong API key", scope.get("method"), path)
        body = unauthorized_body(provided=bearer_token(authorization) is not None)
        await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)


def with_api_key(app: ASGIApp, key: str | None) -> ASGIApp:
    """`app` behind the API-key check when a key is configured, else `app` itself."""
    return APIKeyMiddleware(app, key) if key else app
