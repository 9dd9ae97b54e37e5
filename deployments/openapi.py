"""The ingress's published schema (``GET /openapi.json``) describing what the handlers take.

The generation handlers read their raw ``Request`` and validate it themselves (so that every
refusal is an OpenAI-style body naming the field, not FastAPI's 422), so FastAPI alone would
publish no request body for them. ``ServedAPI.json_body(Model)`` declares the body through
``openapi_extra`` as a reference, and ``ServedAPI.openapi`` puts the models' JSON schemas
(pydantic's, with their ``$defs``) into ``components.schemas``. ``error_responses`` declares a
route's error statuses with the one error body (``ErrorResponse``). With API keys on, the
protected operations carry a bearer ``security`` requirement.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from app.openai_protocol import ErrorResponse
from deployments.auth import is_protected

REF_TEMPLATE = "#/components/schemas/{model}"
ERROR_DESCRIPTIONS = {
    400: "invalid request: the message and param name the field",
    401: "missing or wrong API key (when the server has keys)",
    404: "no such model",
    413: "request body over limits.max_body_bytes",
    429: "this API key has limits.max_concurrent_per_key requests in flight; retry after Retry-After",
    503: "busy or a replica unavailable; retry after Retry-After",
    504: "no output for limits.stream_idle_timeout_s",
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route: each status with the OpenAI error body."""
    return {code: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[code]} for code in codes}


class ServedAPI(FastAPI):
    """FastAPI with request bodies declared from pydantic models it does not parse itself.
    ``auth_on()`` (set by the ingress) says whether to publish the bearer requirement."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.body_models: dict[str, type[BaseModel]] = {}
        self.auth_on: Callable[[], bool] = lambda: False
        self._completed: dict[str, Any] | None = None

    def json_body(self, *models: type[BaseModel]) -> dict[str, Any]:
        """``openapi_extra`` of a route whose raw body is a JSON object of one of ``models``."""
        refs = [{"$ref": REF_TEMPLATE.format(model=model.__name__)} for model in models]
        self.body_models.update((model.__name__, model) for model in models)
        schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
        return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}

    def openapi(self) -> dict[str, Any]:
        schema = super().openapi()
        if schema is not self._completed:  # FastAPI built it anew (first call, or routes changed)
            self._complete(schema)
            self._completed = schema
        return schema

    def _complete(self, schema: dict[str, Any]) -> None:
        models = [(model, "validation") for model in self.body_models.values()]
        _, defs = models_json_schema(models, ref_template=REF_TEMPLATE)
        components = schema.setdefault("components", {})
        components.setdefault("schemas", {}).update(defs.get("$defs", {}))
        if not self.auth_on():
            return
        components["securitySchemes"] = {
            "apiKey": {"type": "http", "scheme": "bearer", "description": "one of the server's auth.api_keys"}
        }
        for path, operations in schema.get("paths", {}).items():
            if is_protected(path):
                for operation in operations.values():
                    operation["security"] = [{"apiKey": []}]
