"""Structured outputs: the constraint a request puts on its text (vLLM's `StructuredOutputsParams`).

One of: ``json`` (a JSON schema), ``json_object`` (any JSON object), ``regex``, ``choice`` (one
of a list of strings) or ``grammar`` (Lark, or llama.cpp's GBNF). The engine is llguidance:
`llguidance_grammar` turns the spec into its grammar text, the one translation the gateway (to
reject a grammar that cannot compile with a 400, `compile_error`) and the executor (to build
the token matchers, `executor.grammar`) share.

JSON is compact: no whitespace between tokens (llguidance's ``whitespace_flexible: false``), so a
weak model cannot spend its token budget on runs of spaces and newlines inside a JSON value. A
JSON schema is closed where it says nothing (`common.strict_json_schema`, as vLLM's default backend
compiles it) unless ``disable_additional_properties`` is false.
"""

from __future__ import annotations

import json as jsonlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from common.strict_json_schema import close_schema

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Bounds on what one request may carry (the spec crosses Redis with every new request, and the
# gateway validates it on a worker thread).
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_CHOICES = 1024

# llguidance's fuel for analysing a grammar's regexes when its lexer is built (default 1,000,000).
# The executor computes a new request's first token mask inside a step that every other request
# waits on: a pathological regex (a{1000}{1000}{1000}) must fail fast there rather than stall the
# whole batch for seconds under the default fuel; it still fails the same way (an error state after
# one token). Grammars of ordinary size get the same masks with either fuel.
INITIAL_LEXER_FUEL = 100_000

# llguidance compiles a grammar recursively, native stack a level of nesting: on a default 8 MiB
# stack about 1,000 nested rules or $refs (a 70 KB request) overflow it and kill the process.
# With this much stack the deepest grammars MAX_GRAMMAR_CHARS admits compile; only the depth a
# grammar reaches is touched.
GRAMMAR_STACK_BYTES = 256 << 20
# `threading.stack_size` is the process's setting for new threads: set and restored under a lock.
_STACK_SIZE_LOCK = threading.Lock()

# llguidance's JSON compiler options: compact separators, no free whitespace.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(slots=True)
class StructuredOutputsParams:
    """Exactly one constraint on the generated text (vLLM's field names).

    ``json``: a JSON schema (an object, or its JSON text); ``regex``: a regular expression the
    whole output matches; ``choice``: the output is one of these strings; ``grammar``: a Lark (or
    GBNF) grammar; ``json_object``: any JSON object. The output ends (EOS is forced) once the
    constraint allows nothing more.

    ``disable_additional_properties`` (vLLM's option): a ``json`` schema admits no object
    properties or array items beyond those it lists, where it says nothing (xgrammar's strict
    mode, vLLM's default); false compiles it as JSON Schema reads it (open objects).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_additional_properties: bool = True

    def _set(self, kind: str) -> bool:
        value = getattr(self, kind)  # identity: 0 == False, and a 0 given for a schema is a wrong value, not none
        return value is not None and value is not False

    def kind(self) -> str:
        """The one constraint set (after `validate`): json, regex, choice, grammar or json_object."""
        return next(k for k in _KINDS if self._set(k))

    def validate(self) -> None:
        """Raise ``ValueError`` (message starting ``structured_outputs``) unless exactly one
        constraint is set, of the right type and size. Whether it compiles: `compile_error`."""
        given = [k for k in _KINDS if self._set(k)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(_KINDS)}, got {', '.join(given) or 'none'}")
        if not isinstance(self.disable_additional_properties, bool):
            raise ValueError("structured_outputs.disable_additional_properties must be a boolean")
        kind = given[0]
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                if len(schema) > MAX_GRAMMAR_CHARS:
                    raise ValueError(f"structured_outputs.json may be at most {MAX_GRAMMAR_CHARS} characters")
                try:
                    schema = jsonlib.loads(schema)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
                except RecursionError:  # "[" * 200000 (a gateway's parser caps nesting; a stream may not)
                    raise ValueError("structured_outputs.json nests too deeply") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got {type(schema).__name__}")
        elif kind == "choice":
            choice = self.choice
            if not isinstance(choice, list) or not 1 <= len(choice) <= MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice must be a list of 1 to {MAX_CHOICES} strings")
            if not all(isinstance(c, str) and c for c in choice):
                raise ValueError("structured_outputs.choice must hold non-empty strings")
            if sum(map(len, choice)) > MAX_GRAMMAR_CHARS:
                raise ValueError(f"structured_outputs.choice may hold at most {MAX_GRAMMAR_CHARS} characters in all")
        elif kind == "json_object":
            if self.json_object is not True:
                raise ValueError("structured_outputs.json_object must be true or absent")
        else:
            text = getattr(self, kind)
            if not isinstance(text, str) or not text:
                raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
            if len(text) > MAX_GRAMMAR_CHARS:
                raise ValueError(f"structured_outputs.{kind} may be at most {MAX_GRAMMAR_CHARS} characters")

    def key(self) -> str:
        """A canonical text of the spec: equal specs compile to the same grammar (a cache key)."""
        return jsonlib.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def to_dict(self) -> dict[str, Any]:
        """The wire form: only the set field (and an option away from its default); a schema as
        JSON text (any JSON nests safely)."""
        kind = self.kind()
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, str):
            value = jsonlib.dumps(value, separators=(",", ":"))
        out: dict[str, Any] = {kind: value}
        if not self.disable_additional_properties:
            out["disable_additional_properties"] = False
        return out

    def json_schema(self) -> Any:
        """The ``json`` schema (validated) as it compiles: parsed, and closed unless opened."""
        try:
            schema = jsonlib.loads(self.json) if isinstance(self.json, str) else self.json
            return close_schema(schema) if self.disable_additional_properties else schema
        except RecursionError:  # (a schema sent as text nests as deep as it likes)
            raise ValueError("structured_outputs.json nests too deeply") from None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StructuredOutputsParams:
        """Undo `to_dict` (``TypeError`` for unknown fields; not validated)."""
        return cls(**data)

    def llguidance_grammar(self) -> str:
        """The llguidance grammar text of this (validated) spec; ``ValueError`` if malformed."""
        from llguidance import LLMatcher, grammar_from  # imported on first use: only structured requests need it

        kind = self.kind()
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=cast("Any", JSON_OPTIONS))
        if kind == "json":
            return LLMatcher.grammar_from_json_schema(jsonlib.dumps(self.json_schema()), defaults=cast("Any", JSON_OPTIONS))
        if kind == "regex":
            return LLMatcher.grammar_from_regex(str(self.regex))
        if kind == "choice":
            return grammar_from("choice", jsonlib.dumps(self.choice))
        return grammar_from("grammar", str(self.grammar))

    def compile_error(self, tokenizer: Any = None) -> str | None:
        """Why this spec's grammar cannot compile, or None when it can. With ``tokenizer`` (an
        llguidance tokenizer: `grammar_tokenizer`) what needs the vocabulary is checked too, such
        as token ranges (``<[99999]>``) and special tokens (``<|name|>``)."""
        from llguidance import LLMatcher

        try:
            self.validate()
            grammar = self.llguidance_grammar()
            error = on_grammar_stack(lambda: LLMatcher.validate_grammar(grammar, tokenizer, limits=grammar_limits()))
        except (ValueError, TypeError) as exc:
            return str(exc)
        return error or None


def on_grammar_stack(fn: Callable[[], T]) -> T:
    """``fn()`` on a thread of its own with `GRAMMAR_STACK_BYTES` of stack (for llguidance's
    compiler); its result, or its exception raised here."""
    out: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            out.append((True, fn()))
        except BaseException as exc:  # handed to the caller
            out.append((False, exc))

    with _STACK_SIZE_LOCK:
        default = threading.stack_size(GRAMMAR_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="conveyor-grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(default)
    thread.join()
    ok, value = out[0]
    if not ok:
        raise value
    return cast(T, value)


def grammar_limits() -> Any:
    """The `llguidance.LLParserLimits` every matcher and validation uses (see `INITIAL_LEXER_FUEL`)."""
    from llguidance import LLParserLimits

    return LLParserLimits(initial_lexer_fuel=INITIAL_LEXER_FUEL)


def grammar_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of a Hugging Face ``tokenizer`` with the model's ``vocab_size``, or None
    (logged once) where llguidance cannot use it (a slow tokenizer): grammars are then checked
    without the vocabulary. Built on first use and kept on the tokenizer itself, so it lives as long
    as the tokenizer; a caller that shares the tokenizer between threads holds its lock here."""
    cached = getattr(tokenizer, "_conveyor_grammar_tokenizer", None)
    if cached is None or cached[0] != vocab_size:
        from llguidance.hf import from_tokenizer

        try:
            built = from_tokenizer(tokenizer, n_vocab=vocab_size)
        except Exception as exc:  # not one llguidance reads: validate without the vocabulary
            logger.warning("grammars are checked without the vocabulary: llguidance cannot read this tokenizer (%s)", exc)
            built = None
        cached = (vocab_size, built)
        tokenizer._conveyor_grammar_tokenizer = cached
    return cached[1]
