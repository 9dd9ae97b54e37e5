"""The client's errors: ``HTTPError`` (status, OpenAI-style body, headers), and what a
replica call raises mapped to one by type (``replica_call``), never a stack trace: a dead
replica or a failed KV transfer is a ``ReplicaFailure`` (retried before any output left),
a replica that just changed role refused the request (``RoleRefused``: another path).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from fastapi.responses import JSONResponse
from ray.serve.exceptions import RequestCancelledError

from app.openai_protocol import error_body
from deployments import logs
from engine.params import FieldError, RankLostError, RoleError
from kv_transport.base import KVCapacityError, KVTransferError

logger = logs.install()


class HTTPError(Exception):
    def __init__(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
        super().__init__(body["error"]["message"])
        self.status, self.body, self.headers = status, body, headers or {}

    @classmethod
    def bad_request(cls, exc: FieldError) -> HTTPError:
        return cls(400, error_body(exc.message, exc.param))

    @classmethod
    def busy(cls, message: str) -> HTTPError:
        return cls(503, error_body(message, None, "server_error"), {"Retry-After": "1"})

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


class ReplicaFailure(HTTPError):
    """A replica died, or the KV transfer failed, on one ``side`` of a request (``prefill``:
    the prefill call or the transfer; ``decode``: the replica that streams the tokens). Before
    any token reached the client the request is retried once (``ServedRequest.recover``);
    after, the client gets this error."""

    def __init__(self, side: str, reason: str, body: dict) -> None:
        super().__init__(503, body, {"Retry-After": "1"})
        self.side, self.reason = side, reason


class RoleRefused(Exception):
    """The replica the router chose had just changed role and refused the admission (nothing
    was admitted there): the request takes another path."""


def _replica_died(exc: BaseException) -> bool:
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

    return isinstance(exc, RayActorError | ReplicaUnavailableError | DeploymentUnavailableError)


def http_error(exc: BaseException, side: str = "decode") -> HTTPError:
    """What a replica call raised (``RayTaskError.cause`` when the replica raised it), as the
    client's error: by type. A dead replica and a failed transfer are ``ReplicaFailure``s
    (expected events: one log line, no traceback, by ``ServedRequest.recover``)."""
    cause = getattr(exc, "cause", None) or exc
    if isinstance(cause, KVCapacityError):
        return HTTPError.busy("no KV capacity on the decode pool, retry later")
    if isinstance(cause, FieldError):  # the engine refused the request's input
        return HTTPError.bad_request(cause)
    if isinstance(cause, ValueError):  # e.g. a request id already on that engine
        return HTTPError(400, error_body(str(cause), None))
    name = type(cause).__name__
    if isinstance(cause, KVTransferError):
        message = f"KV transfer failed ({name}): {cause.message}"
        return ReplicaFailure("prefill", message, error_body(message, None, "server_error", "kv_transfer_failed"))
    if _replica_died(exc) or _replica_died(cause) or isinstance(cause, RankLostError):
        message = f"the {side} replica serving this request is gone ({name})"
        return ReplicaFailure(side, message, error_body(message, None, "server_error", "replica_unavailable"))
    logger.error("request failed", exc_info=cause)
    return HTTPError(500, error_body(f"internal error ({name})", None, "server_error"))


async def replica_call(awaitable: Awaitable, side: str = "decode") -> Any:
    """Await a replica call on ``side`` (prefill or decode); what it raises as an HTTP error."""
    try:
        return await awaitable
    except (StopAsyncIteration, asyncio.CancelledError):
        raise
    except RequestCancelledError:  # this ingress cancelled the call (client gone, request ended)
        raise asyncio.CancelledError() from None
    except Exception as exc:
        cause = getattr(exc, "cause", exc)
        if isinstance(cause, RoleError):
            raise RoleRefused(str(cause)) from None
        raise http_error(exc, side) from None
