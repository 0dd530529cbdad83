"""JSON schemas closed where they say nothing: xgrammar's strict mode, vLLM's default.

vLLM's default structured-output backend compiles a JSON schema with xgrammar's ``strict_mode``:
an object schema without ``additionalProperties`` admits no properties beyond those it lists, and
an array schema with ``prefixItems`` but no ``items`` no items beyond them. llguidance, the
engine here, follows JSON Schema instead (unlisted keys allowed), so a client that sends a
non-strict schema (instructor's modes, LangChain's ``function_calling``) got unlisted keys from a
weak model, often until the length limit. `close_schema` writes the strict reading out as
explicit keywords before the schema is compiled; an explicit ``additionalProperties`` (true or a
schema) or ``items`` is kept as given.

Not closed: the members of an ``allOf`` (closed one by one, each would refuse the others'
properties, where strict mode judges the merged object), an object that requires a property it
does not list (closed, it would admit nothing), and what sits under ``not``, ``if`` or
``contains`` (closing there would widen or flip what the schema means). Data keywords (``const``,
``enum``, ``default``, ``examples``) are values, copied as they are.
"""

from __future__ import annotations

from typing import Any

# Keywords whose value is one subschema, a list of them, or a map of name -> subschema.
_ONE = ("additionalProperties", "items", "additionalItems", "unevaluatedProperties", "unevaluatedItems", "propertyNames")
_LIST = ("prefixItems", "anyOf", "oneOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def close_schema(schema: Any) -> Any:
    """A copy of ``schema`` (a JSON schema) closed as xgrammar's strict mode reads it; the input is
    left as it is. Anything that is not a schema object (a boolean schema) comes back unchanged."""
    return _close(schema, closable=True)


def _is_object(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    if kind == "object" or (isinstance(kind, list) and "object" in kind):
        return True
    return kind is None and "properties" in schema


def _lists_required(schema: dict[str, Any]) -> bool:
    """Whether every required property is listed (closed, one that is not could never be given)."""
    required, properties = schema.get("required", []), schema.get("properties", {})
    if not isinstance(required, list) or not isinstance(properties, dict):
        return False
    return all(name in properties for name in required)


def _is_array(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    return kind == "array" or (isinstance(kind, list) and "array" in kind) or "prefixItems" in schema


def _close(schema: Any, closable: bool) -> Any:
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _ONE:
            out[key] = (
                _close(value, True)
                if isinstance(value, dict)
                else [_close(v, True) for v in value]
                if isinstance(value, list)
                else value
            )
        elif key in _LIST and isinstance(value, list):
            out[key] = [_close(v, True) for v in value]
        elif key == "allOf" and isinstance(value, list):
            out[key] = [_close(v, False) for v in value]
        elif key in _MAP and isinstance(value, dict):
            out[key] = {name: _close(v, True) for name, v in value.items()}
        else:
            out[key] = value
    if not closable or "allOf" in schema or "$ref" in schema:  # (judged with the schemas it merges with)
        return out
    if (
        _is_object(schema)
        and "additionalProperties" not in schema
        and "unevaluatedProperties" not in schema
        and _lists_required(schema)
    ):
        out["additionalProperties"] = False
    if _is_array(schema):
        if "prefixItems" in schema and "items" not in schema and "unevaluatedItems" not in schema:
            out["items"] = False
        elif isinstance(schema.get("items"), list) and "additionalItems" not in schema:  # (draft 4-2019 tuples)
            out["additionalItems"] = False
    return out
