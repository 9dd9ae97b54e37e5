"""API keys on the ingress: ``Authorization: Bearer <key>`` on every ``/v1/*`` and ``/admin/*``
request, and on ``/tokenize`` and ``/detokenize``, when the app has keys (``auth`` in
``AppConfig``); ``/health``, ``/ready`` and ``/openapi.json`` stay open (probes, and the schema, which holds no data).

One pure ASGI middleware (``APIKeyMiddleware``) does the check for every route under those
prefixes, present and future, before FastAPI routes the request: a route cannot forget it,
and an unknown ``/v1/...`` path answers 401, not 404, to a client without a key. It is added
to the module's FastAPI app before ``serve.ingress`` freezes it, and finds the replica's keys
through ``keys_of`` at request time (the ingress's instance holds them).

Keys are kept as SHA-256 digests; a client's token is hashed and compared with every digest
by ``hmac.compare_digest`` (constant time, equal lengths, no early exit), so neither the
comparison nor the number of keys tried tells a client how close it came. Nothing here logs
or echoes a token: the 401 body says only whether one was missing or wrong.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Sequence

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from app.openai_protocol import error_body

PROTECTED_PREFIXES = ("/v1/", "/admin/")
PROTECTED_PATHS = frozenset({"/v1", "/admin", "/tokenize", "/detokenize"})
KEY_ID = "api_key_id"  # the ``request.state`` attribute: the index of the client's key, never the key


def is_protected(path: str) -> bool:
    return path.startswith(PROTECTED_PREFIXES) or path in PROTECTED_PATHS


def route_path(scope: Scope) -> str:
    """The path the app routes (under a route prefix, Serve puts it in ``root_path``)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def bearer_token(headers: Sequence[tuple[bytes, bytes]]) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header (scheme in any case), else None."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            token = token.strip()
            return token if scheme.lower() == b"bearer" and token else None
    return None


class ApiKeys:
    """The server's keys, as digests. ``match`` gives the matching key's index (its identity
    for per-key limits and nothing else), or None."""

    def __init__(self, keys: Sequence[str], on_refused: Callable[[], None] | None = None) -> None:
        if not keys:
            raise ValueError("ApiKeys needs at least one key")
        self._digests = tuple(hashlib.sha256(key.encode()).digest() for key in keys)
        self.on_refused = on_refused

    def match(self, token: bytes) -> int | None:
        given = hashlib.sha256(token).digest()
        found = None
        for index, digest in enumerate(self._digests):  # every key, whichever matches
            if hmac.compare_digest(given, digest) and found is None:
                found = index
        return found


def unauthorized(token: bytes | None) -> JSONResponse:
    """401 as OpenAI answers it: ``invalid_api_key``, and the challenge header."""
    if token is None:
        message = "Missing API key: send it as 'Authorization: Bearer <key>'."
    else:
        message = "Incorrect API key provided."
    body = error_body(message, None, "invalid_request_error", "invalid_api_key")
    return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})


class APIKeyMiddleware:
    """Refuse a protected request without a valid key (401); let the rest through, with the
    key's index in ``request.state.api_key_id``. ``keys_of()`` None: auth is off."""

    def __init__(self, app: ASGIApp, keys_of: Callable[[], ApiKeys | None]) -> None:
        self.app, self.keys_of = app, keys_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        keys = self.keys_of() if scope["type"] == "http" and is_protected(route_path(scope)) else None
        if keys is None:
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope["headers"])
        key_id = keys.match(token) if token is not None else None
        if key_id is None:
            if keys.on_refused is not None:
                keys.on_refused()
            await unauthorized(token)(scope, receive, send)
            return
        scope.setdefault("state", {})[KEY_ID] = key_id
        await self.app(scope, receive, send)
