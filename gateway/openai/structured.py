"""Structured-output request fields: ``response_format``, vLLM's ``structured_outputs`` (and its
older ``guided_*`` names), and chat ``tools`` with ``tool_choice``.

They all become one `StructuredOutputsParams` on the request's `SamplingParams`; the executor
enforces it token by token (`executor.grammar`). `check_grammar` compiles it (llguidance, against
the model's vocabulary) on a worker thread before the request is submitted: a grammar that cannot
compile is a 400 naming the field it came from.

A JSON schema compiles closed where it says nothing (no unlisted properties or items: vLLM's
default backend's strict mode, `common.strict_json_schema`); vLLM's option
``structured_outputs: {"disable_additional_properties": false}`` opens it, alone or beside the
constraint (``response_format``, ``guided_json``, a tool's parameters).

Tools: ``tool_choice`` ``"required"`` constrains the output to a JSON array of calls
``[{"name": ..., "parameters": {...}}]`` (vLLM's form), one of the tools' names with that tool's
parameter schema each, their ``$defs`` lifted to the root (`gateway.openai.tool_grammar`); a named
function constrains it to that tool's parameters (the arguments object). Either overrides another
constraint (``response_format``: the OpenAI Agents SDK sends both), as in vLLM. The response
carries them as OpenAI ``tool_calls`` (`gateway.output.tool_calls`).
``"auto"`` (the default with tools) needs a gateway started with vLLM's ``--enable-auto-tool-choice
--tool-call-parser NAME``: the output is free-form, and the parser finds the calls in it
(`gateway.output.tool_parsers`); without one it is a 400, as from vLLM. ``"none"`` generates plain text.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Any

from common.sampling_params import SamplingParams
from common.structured_outputs import StructuredOutputsParams, grammar_tokenizer
from gateway.http.errors import ApiError, bad
from gateway.openai.json_input import preview, typename
from gateway.openai.tool_grammar import ToolSchemaError, required_calls_schema
from gateway.output.tool_parsers import TOOL_CALL_PARSERS

MAX_TOOLS = 128
# OpenAI's rule for function names.
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# vLLM's older request fields, still sent by many clients.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_SPEC_FIELDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM options of `structured_outputs` accepted and ignored: JSON is always compact here, and
# there is one backend (no fallback to choose).
_IGNORED_OPTIONS = ("disable_fallback", "disable_any_whitespace", "backend")
# vLLM's option that closes (true, the default here) or opens (false) a JSON schema's objects.
_STRICT_OPTION = "disable_additional_properties"


@dataclass(slots=True)
class ToolCallMode:
    """How a chat request's output becomes tool calls: ``kind`` "required" (a JSON array of
    ``{"name", "parameters"}``), "named" (the arguments of the function ``name``) or "parsed"
    (free-form text, read by the tool-call parser ``parser``)."""

    kind: str
    name: str | None = None
    parser: str | None = None
    single: bool = False  # "parsed" under ``parallel_tool_calls: false``: the first call only
    id_length: int = 0  # call ids of this many hex digits (the gateway's parser's: mistral's 9), else OpenAI's shape


@dataclass(slots=True)
class StructuredRequest:
    """Where a request's structured output came from (``param``, for a 400 about it), its tool-call
    mode (None: plain content) and its ``tools`` (given to the chat template)."""

    param: str
    tool_call: ToolCallMode | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)


def parse_structured(body: dict[str, Any]) -> tuple[StructuredOutputsParams | None, str | None]:
    """The constraint of ``response_format`` / ``structured_outputs`` / ``guided_*`` (at most one
    of them) and the field it came from; a 400 for a malformed one."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        spec = _response_format(fmt)
        if spec is not None:
            found.append((spec, "response_format"))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad(f"'structured_outputs' must be an object, got {typename(so)}", "structured_outputs")
        unknown = [k for k in so if k not in _SPEC_FIELDS and k not in _IGNORED_OPTIONS and k != _STRICT_OPTION]
        if unknown:
            raise bad(
                f"'structured_outputs' has unsupported field {preview(unknown[0])} (supported: {', '.join(_SPEC_FIELDS)})",
                "structured_outputs",
            )
        if any(k in _SPEC_FIELDS for k in so):  # (options alone shape another field's constraint)
            found.append((StructuredOutputsParams(**{k: v for k, v in so.items() if k in _SPEC_FIELDS}), "structured_outputs"))
    for name, kind in _GUIDED.items():
        if body.get(name) is not None:
            found.append((StructuredOutputsParams(**{kind: body[name]}), name))
    if not found:
        return None, None
    if len(found) > 1:
        raise bad(f"give one of {', '.join(p for _, p in found)}, not several", found[1][1])
    spec, param = found[0]
    spec.disable_additional_properties = closed_objects(body)
    try:
        spec.validate()
    except ValueError as exc:
        raise bad(str(exc).replace("structured_outputs", param, 1), param) from None
    return spec, param


def closed_objects(body: dict[str, Any]) -> bool:
    """Whether the request's JSON schemas compile closed: vLLM's ``disable_additional_properties``
    (default true here, as vLLM's default backend compiles them); a 400 unless a boolean."""
    so = body.get("structured_outputs")
    value = so.get(_STRICT_OPTION, True) if isinstance(so, dict) else True
    if not isinstance(value, bool):
        raise bad(f"'structured_outputs.{_STRICT_OPTION}' must be a boolean, got {typename(value)}", "structured_outputs")
    return value


def _response_format(fmt: Any) -> StructuredOutputsParams | None:
    if not isinstance(fmt, dict):
        raise bad(f"'response_format' must be an object, got {typename(fmt)}", "response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict):
            raise bad("'response_format.json_schema' must be an object with a 'schema'", "response_format")
        schema = inner.get("schema")
        if not isinstance(schema, dict):
            raise bad(f"'response_format.json_schema.schema' must be an object, got {typename(schema)}", "response_format")
        return StructuredOutputsParams(json=schema)
    raise bad(f"'response_format.type' must be text, json_object or json_schema, got {preview(kind)}", "response_format")


def parse_tools(
    body: dict[str, Any], sampling: SamplingParams, param: str | None, tool_parser: str | None = None
) -> StructuredRequest | None:
    """Validate chat ``tools`` and ``tool_choice``; for "required" or a named function, set the
    matching constraint on ``sampling``, in place of any other (vLLM's rule). ``param``: the field of a
    constraint already parsed (`parse_structured`); ``tool_parser``: the parser "auto" reads the
    output with (None: "auto" is a 400). Returns the request's `StructuredRequest`."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise bad(f"'{legacy}' is not supported by this server; use 'tools' and 'tool_choice'", legacy)
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise bad("'tool_choice' requires 'tools'", "tool_choice")
        return StructuredRequest(param) if param else None
    schemas = _tool_schemas(tools)
    id_length = TOOL_CALL_PARSERS[tool_parser].id_length if tool_parser is not None else 0
    if choice in (None, "auto"):  # vLLM's default with tools; it too refuses it without a parser
        if tool_parser is None:
            raise bad(
                "'tool_choice' \"auto\" (the default with 'tools') needs a gateway started with "
                "--enable-auto-tool-choice and --tool-call-parser: send 'required', a named function, or 'none' "
                "(the tools go in the prompt, the answer is text)",
                "tool_choice",
            )
        # (a constraint from another field still applies: the parser reads what it lets through)
        mode = ToolCallMode("parsed", parser=tool_parser, single=body.get("parallel_tool_calls") is False, id_length=id_length)
        return StructuredRequest(param or "tools", mode, tools)
    if choice == "none":
        return StructuredRequest(param or "tools", None, tools)
    if choice == "required":
        mode = ToolCallMode("required", id_length=id_length)
        try:  # (``parallel_tool_calls: false``, OpenAI's: at most one call)
            schema = required_calls_schema(schemas, body.get("parallel_tool_calls") is False)
        except ToolSchemaError as exc:
            raise bad(str(exc), "tools") from None
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not isinstance(name, str) or name not in schemas:  # a list or an object is no name (and unhashable)
            raise bad(f"'tool_choice' names function {preview(name)}, which is not among 'tools'", "tool_choice")
        mode, schema = ToolCallMode("named", name, id_length=id_length), schemas[name]
    else:
        raise bad(
            "'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}",
            "tool_choice",
        )
    # The forced tool's grammar wins over ``response_format`` and the like (vLLM's rule).
    sampling.structured_outputs = StructuredOutputsParams(json=schema, disable_additional_properties=closed_objects(body))
    return StructuredRequest("tools", mode, tools)


def _tool_schemas(tools: Any) -> dict[str, dict[str, Any]]:
    """Each tool's name -> parameters schema; a 400 for a malformed tool list."""
    if not isinstance(tools, list):
        raise bad(f"'tools' must be an array, got {typename(tools)}", "tools")
    if len(tools) > MAX_TOOLS:
        raise bad(f"'tools' may hold at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', "tools")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise bad(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-', got {preview(name)}", "tools")
        if name in out:
            raise bad(f"tools[{i}].function.name {name!r} is given twice", "tools")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise bad(f"tools[{i}].function.description must be a string", "tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad(f"tools[{i}].function.parameters must be a JSON schema object, got {typename(params)}", "tools")
        out[name] = params
    return out


def check_grammar(
    sampling: SamplingParams, structured: StructuredRequest | None, tokenizer: Any, lock: threading.Lock, vocab_size: int
) -> None:
    """A 400 unless the request's constraint compiles against the model's vocabulary; for a worker
    thread (a large schema takes a while). ``lock``: the tokenizer's, held while llguidance reads it."""
    spec = sampling.structured_outputs
    if spec is None:
        return
    with lock:
        vocabulary = grammar_tokenizer(tokenizer, vocab_size)
    error = spec.compile_error(vocabulary)
    if error is not None:
        param = structured.param if structured is not None else "structured_outputs"
        raise ApiError(400, f"'{param}' does not compile to a grammar: {error}", param=param, code="invalid_grammar")
