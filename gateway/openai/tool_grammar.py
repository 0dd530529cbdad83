"""The JSON schema of ``tool_choice: "required"``: an array of calls, one of the tools each.

Every call is ``{"name": <a tool's name>, "parameters": <its parameters>}`` (vLLM's form), so each
tool's parameter schema sits inside the wrapper, at ``#/items/anyOf/<i>/properties/parameters``.
Its references were written against its own root: ``#/$defs/X`` (Pydantic's, for any enum or
nested model) and ``#/definitions/X`` (older generators') would point at the wrapper's root. So
every tool's ``$defs`` and ``definitions`` move to the wrapper's root, under the same keyword and
name (their references stay valid as written); one name given two different schemas by two tools
is an error, as in vLLM. Any other local reference (``#``, ``#/properties/...``) is rewritten to
the place its tool's parameters now have.
"""

from __future__ import annotations

from typing import Any

# Keywords holding definitions that ``$ref`` reaches by name.
DEFINITION_KEYWORDS = ("$defs", "definitions")
# Keywords whose value is data, never a schema: a "$ref" key inside one is no reference.
_DATA_KEYWORDS = frozenset(("const", "enum", "default", "examples"))


class ToolSchemaError(ValueError):
    """A tool's parameters cannot join the wrapper (a definition name given two schemas)."""


def required_calls_schema(schemas: dict[str, dict[str, Any]], at_most_one: bool) -> dict[str, Any]:
    """The schema of a non-empty array of calls of the tools ``schemas`` (name -> parameters), at
    most one with ``at_most_one`` (``parallel_tool_calls: false``). `ToolSchemaError` when two
    tools define one name differently."""
    lifted: dict[str, dict[str, Any]] = {}
    owners: dict[tuple[str, str], str] = {}
    calls = []
    for i, (name, params) in enumerate(schemas.items()):
        params = dict(params)
        for keyword in DEFINITION_KEYWORDS:
            defs = params.pop(keyword, None)
            if not isinstance(defs, dict):
                continue
            into = lifted.setdefault(keyword, {})
            for def_name, def_schema in defs.items():
                if def_name in into and into[def_name] != def_schema:
                    raise ToolSchemaError(
                        f"tools {owners[keyword, def_name]!r} and {name!r} both define {keyword}/{def_name}, "
                        "with different schemas: give one of them another name"
                    )
                into[def_name] = def_schema
                owners.setdefault((keyword, def_name), name)
        at = f"#/items/anyOf/{i}/properties/parameters"
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": _rebase(params, at)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if at_most_one:
        schema["maxItems"] = 1
    schema.update(lifted)  # (a definition that refers to its tool's root, not a definition, stays as written)
    return schema


def _is_definition_ref(ref: str) -> bool:
    return any(ref.startswith(f"#/{keyword}/") for keyword in DEFINITION_KEYWORDS)


def _rebase(schema: Any, at: str) -> Any:
    """``schema`` with its local references other than to definitions pointing under ``at``."""
    if isinstance(schema, list):
        return [_rebase(v, at) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if (
            key == "$ref"
            and isinstance(value, str)
            and (value == "#" or value.startswith("#/"))
            and not _is_definition_ref(value)
        ):
            out[key] = at + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _rebase(value, at)
    return out
