"""The JSON Schemas output is generated under: numbers kept to what a JSON consumer holds, and
forced tool calls (``tool_choice`` ``required`` or a named function).

``bounded`` rewrites a client's schema for generation only (the client's own schema still
validates what comes out): an integer or number without bounds of its own stays within
±(2**53 - 1), a number without a ``multipleOf`` of its own has at most ``JSON_FRACTION_DIGITS``
decimals (llguidance turns both into its number grammar: a bounded integer part, no exponent, a
bounded fraction), and a value the schema leaves untyped (``{}``, an object's undeclared keys)
is any JSON value with such numbers. So a value cannot run on until ``max_tokens``.

``forced_schema``: a list of ``{"name", "parameters"}`` items (one unless parallel calls are
allowed), or the named function's own parameters; every object that lists its properties is
closed to others (``additionalProperties: false``: a small model otherwise invents keys until
``max_tokens``), and each function's ``$defs`` are lifted to the root under its own prefix so
its ``$ref``s still resolve inside the list.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

JSON_INT_LIMIT = 2**53 - 1  # integers a JSON consumer (a double) holds exactly
JSON_FRACTION_DIGITS = 9  # decimals of a generated number without a multipleOf of its own
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # as the engine writes
_ANY = "tandem_json_value"  # the root $defs entry of a bounded JSON value
_ANY_REF = {"$ref": f"#/$defs/{_ANY}"}
# where a schema holds other schemas: maps of them, lists of them, one of them
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")  # fmt: skip
_TYPING = {"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "not", "properties", "items", "prefixItems"}


def _each(schema: Any, change: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    """``schema`` with ``change`` applied to every subschema, innermost first (data such as
    ``const``, ``enum`` and the names in ``properties`` left as they are)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _each(value, change) for name, value in out[key].items()}
    for key in (*_LISTS, "items"):
        if isinstance(out.get(key), list):
            out[key] = [_each(value, change) for value in out[key]]
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = _each(out[key], change)
    return change(out)


def _number(types: list[str]) -> dict[str, Any]:
    bounds = {"minimum": -JSON_INT_LIMIT, "maximum": JSON_INT_LIMIT}
    return bounds | ({"multipleOf": 10.0**-JSON_FRACTION_DIGITS} if "number" in types else {})


def _bound_one(schema: dict[str, Any]) -> dict[str, Any]:
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    if not _TYPING & set(schema):  # untyped: any value
        return schema | _ANY_REF
    if "integer" in types or "number" in types:
        for key, value in _number(types).items():
            exclusive = {"minimum": "exclusiveMinimum", "maximum": "exclusiveMaximum"}.get(key)
            if key not in schema and exclusive not in schema:
                schema = schema | {key: value}
    if "object" in types and "properties" not in schema and "additionalProperties" not in schema:
        schema = schema | {"additionalProperties": _ANY_REF}
    return schema


def bounded(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with its numbers and untyped values bounded (see the module's docstring)."""
    out = _each(schema, _bound_one)
    if not _mentions(out, _ANY_REF["$ref"]):
        return out
    value = {"anyOf": [{"type": "string"}, {"type": "number", **_number(["number"])}, {"type": "boolean"},
                       {"type": "null"}, {"type": "array", "items": _ANY_REF},
                       {"type": "object", "additionalProperties": _ANY_REF}]}  # fmt: skip
    return out | {"$defs": {**out.get("$defs", {}), _ANY: value}}


def _mentions(value: Any, text: str) -> bool:
    if isinstance(value, dict):
        return any(_mentions(v, text) for v in value.values())
    if isinstance(value, list):
        return any(_mentions(v, text) for v in value)
    return value == text


def _close_one(schema: dict[str, Any]) -> dict[str, Any]:
    if "properties" in schema and not {"additionalProperties", "patternProperties", "unevaluatedProperties"} & set(
        schema
    ):
        return schema | {"additionalProperties": False}
    return schema


def closed_objects(schema: Any) -> Any:
    """``schema`` with every object that lists its properties, and says nothing of others, closed."""
    return _each(schema, _close_one)


def _lifted(schema: dict[str, Any], prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``schema`` without its ``$defs`` / ``definitions``, its refs to them renamed ``prefix`` +
    name, and those definitions (for the root of a schema that holds it)."""

    def renamed(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: renamed(v) for k, v in value.items()}
        if isinstance(value, list):
            return [renamed(v) for v in value]
        for head in ("#/$defs/", "#/definitions/"):
            if isinstance(value, str) and value.startswith(head):
                return "#/$defs/" + prefix + value.removeprefix(head)
        return value

    defs = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    body = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
    return renamed(body), {prefix + name: renamed(value) for name, value in defs.items()}


def forced_schema(functions: Sequence[dict[str, Any]], named: str | None, parallel: bool) -> dict[str, Any]:
    """The JSON Schema a forced answer is generated under (see the module's docstring)."""
    if named is not None:
        return bounded(closed_objects(next(f["parameters"] for f in functions if f["name"] == named)))
    items, defs = [], {}
    for i, f in enumerate(functions):
        parameters, own = _lifted(closed_objects(f["parameters"]), f"f{i}_")
        defs |= own
        items.append({"type": "object", "properties": {"name": {"const": f["name"]}, "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})  # fmt: skip
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
    schema |= ({} if parallel else {"maxItems": 1}) | ({"$defs": defs} if defs else {})
    return bounded(schema)
