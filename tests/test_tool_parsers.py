"""Tool-call parsers for ``tool_choice: "auto"`` (`gateway.output.tool_parsers`): what they find in free-form
text, that a stream fed in any pieces agrees with the whole response, and the settings around them."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from common.protocol import JournalHeader, decode, encode
from gateway.engine.journal import journal_body, journaled_spec
from gateway.http.config import GatewayConfig
from gateway.http.errors import ApiError
from gateway.http.server import build_parser, main
from gateway.openai.schema import ChatParsers, parse_chat
from gateway.output.call_deltas import join_pieces
from gateway.output.generation import Piece
from gateway.output.responses import ResponseFormatter
from gateway.output.tool_parsers import TOOL_CALL_PARSERS, CallStream, split_calls

pytestmark = pytest.mark.unit

HERMES = TOOL_CALL_PARSERS["hermes"]
HERMES_ONLY = ChatParsers(tools="hermes")
LLAMA = TOOL_CALL_PARSERS["llama3_json"]
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
BODY: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "tools": [ADD]}

ONE = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "é"}}\n</tool_call>'
TWO = ONE + '\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'


def test_hermes_finds_the_calls_and_the_content_before_them() -> None:
    assert split_calls(HERMES, ONE, True) == ("", [("add", '{"a":1,"b":"é"}')])
    content, calls = split_calls(HERMES, "Let me add.\n" + TWO, True)
    assert content == "Let me add.\n" and calls == [("add", '{"a":1,"b":"é"}'), ("get_weather", "{}")]
    assert split_calls(HERMES, "No tools needed.", True) == ("No tools needed.", None)
    # Without arguments a call has none; an end tag the model never wrote is fine when it stopped
    # (EOS) there, not when the length limit cut it (its JSON may be a prefix that parses).
    assert split_calls(HERMES, '<tool_call>{"name": "add"}</tool_call>', True)[1] == [("add", "{}")]
    assert split_calls(HERMES, '<tool_call>{"name": "add", "arguments": {}}', True)[1] == [("add", "{}")]
    assert split_calls(HERMES, '<tool_call>{"name": "add", "arguments": {}}', False)[1] is None


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "add", "arguments": {"a": </tool_call>',  # bad JSON
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        '<tool_call>{"name": "add", "arguments": "a=1"}</tool_call>',  # arguments not an object
        '<tool_call>["add"]</tool_call>',
        ONE + "<tool_call>{oops}</tool_call>",  # one bad call: none of them
        "<tool_call>" + "[" * 100_000 + "]" * 100_000 + "</tool_call>",  # past the recursion limit
        # No UTF-8 response can hold a lone surrogate (not a 500, nor a stream cut off):
        '<tool_call>{"name": "add", "arguments": {"a": "\\ud800"}}</tool_call>',
        '<tool_call>{"name": "\\udfff", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {"a": NaN}}</tool_call>',  # no JSON a client parses
        '<tool_call>{"name": "add", "arguments": {"a": 1e999}}</tool_call>',  # (infinity)
    ],
)
def test_calls_that_do_not_all_parse_leave_the_whole_text_as_content(text: str) -> None:
    assert split_calls(HERMES, "Hi " + text, True) == ("Hi " + text, None)


def test_llama3_json_reads_a_whole_answer_of_calls() -> None:
    one = '{"name": "add", "parameters": {"a": 1}}'
    # Either parser reads the arguments under either key.
    assert split_calls(LLAMA, one.replace("parameters", "arguments"), True)[1] == [("add", '{"a":1}')]
    assert split_calls(HERMES, f"<tool_call>{one}</tool_call>", True)[1] == [("add", '{"a":1}')]
    # Arguments nested just short of the limit for the reader, past it for the writer: no call, no 500.
    for depth in range(850, 1000):
        deep = '{"name": "f", "parameters": ' + '{"a": ' * depth + "1" + "}" * depth + "}"
        calls = split_calls(LLAMA, deep, True)[1]
        assert calls is None or [name for name, _ in calls] == ["f"]
    assert split_calls(LLAMA, one, True) == ("", [("add", '{"a":1}')])
    assert split_calls(LLAMA, "<|python_tag|>" + one + " ; " + one.replace("add", "sub"), True)[1] == [
        ("add", '{"a":1}'),
        ("sub", '{"a":1}'),
    ]
    assert split_calls(LLAMA, "The answer: " + one, True)[1] is None  # calls are the whole answer
    assert split_calls(LLAMA, one + " and more", True)[1] is None
    assert split_calls(LLAMA, one, False)[1] is None  # cut by the length limit
    assert split_calls(LLAMA, '{"city": "Paris"}', True) == ('{"city": "Paris"}', None)  # JSON, but no call


TEXTS = [
    "Plain text, no calls at all.",
    "Sure. " + TWO,
    TWO + " trailing words",
    "a < b and <tool_ or <tool_call maybe",  # look like a tag's start, are not
    "text ending in <tool_c",
    ONE[:-5],  # unclosed
    "x" + ONE + "<tool_call>{bad}</tool_call>",
]


@pytest.mark.parametrize("parser", list(TOOL_CALL_PARSERS.values()), ids=lambda p: p.name)
def test_a_stream_in_any_pieces_agrees_with_the_whole_response(parser: Any) -> None:
    texts = [*TEXTS, '  {"name": "f", "parameters": {}}', '<|python_tag|>{"name": "f"}', "Hello {", "<|python_ta"]
    texts += ["Ok [TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]g[ARGS]{}", '[TOOL_CALLS] [{"name": "f"}]', "[TOOL_CALL", "[TOOL_CALLS]f{"]
    texts += ['[f(a="x"), g()]', "<|python_start|>[f()]<|python_end|>", "<|python_sta", " [f(a=1)", "Hi [f()]"]
    # Arguments streamed in pieces: whitespace, escapes, nesting, a name after the arguments.
    texts += ['<tool_call>\n{"arguments": {"x": [1, 2, {"y": "a b\\" }"}]}, "name": "late"}\n</tool_call>']
    texts += ['{"name": "f", "parameters": {"a": "\\u00e9", "b": 1.50}} ; {"name": "g", "parameters": {}}']
    rng = random.Random(0)
    for text in texts:
        for stopped in (True, False):
            want_content, want_calls = split_calls(parser, text, stopped)
            for _ in range(20):
                stream, sent, at = CallStream(parser), "", 0
                pieces = []
                while at < len(text):
                    step = rng.randint(1, 6)
                    sent += stream.feed(text[at : at + step])
                    pieces += stream.pieces()
                    at += step
                rest, calls = stream.finish(stopped)
                assert (sent + rest, calls) == (want_content, want_calls), (text, stopped)
                if calls:  # the pieces streamed and the last ones join to the response's calls
                    assert join_pieces([*pieces, *stream.last_pieces(calls)]) == calls, (text, stopped)
    texts += ["<tool_call>\n<function=f>\n<parameter=a>\nx\n</parameter>\n</function>\n</tool_call>", "<function=g>"]
    texts += ["<tool_call>\n<function=f>\n<parameter=a>\nx\n</parameter>\n</function>\n</tool_call>"[:-3]]
    # Content before a call goes out as it comes; a possible tag start waits for the next piece.
    stream = CallStream(HERMES)
    assert stream.feed("Let me check <tool") == "Let me check "
    assert stream.feed("box> first") == "<toolbox> first"
    assert stream.feed(" <tool_call>{") == " " and stream.finish(True) == ("<tool_call>{", None)


# Calls streamed in pieces, by parser: whitespace, escapes, nesting, several calls, long string
# values, what looks like a tag inside a value, and calls that finally do not parse.
STREAMED = {
    "hermes": [
        "Sure. " + TWO,
        '<tool_call>\n{"arguments": {"x": [1, 2, {"y": "a b\\" }"}]}, "name": "late"}\n</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"s": "' + "word " * 40 + '"}}</tool_call>' + TWO,
    ],
    "llama3_json": [
        '{"name": "f", "parameters": {"a": "\\u00e9", "b": 1.50}} ; {"name": "g", "parameters": {}}',
        '<|python_tag|>{"name": "f", "parameters": {"s": "' + "word " * 40 + '"}}',
    ],
    "mistral": [
        'Sure.[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1.50, "b": "x \\" y"}}, {"name": "sub", "arguments": {}}]',
        '[TOOL_CALLS]add[ARGS]{"a": 1, "s": "a [TOOL_ list [x]"}[TOOL_CALLS]sub[CALL_ID]abc123def[ARGS] {}',
        '[TOOL_CALLS] [{"arguments": {"a": [1, {"name": "n"}]}, "name": "late"}]',
        '[TOOL_CALLS]f[ARGS]{"s": "' + "word " * 40 + '"}[TOOL_CALLS]g[ARGS]{}',
        '[TOOL_CALLS]f[ARGS]{"a": "[TOOL_CALLS]"}',  # (a tag inside a value: no call)
        "[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]g",
    ],
    "pythonic": [
        '[get_weather(city="Paris, France", days=3), add(a=1.5, b=[1, (2, 3)], c=None, d=True)]',
        '<|python_start|>[f(s=\'it\\\'s (here)\', t="""tri\nple""", u=r"raw\\d", v="")]<|python_end|>',
        '[f(a="x" "y", b={"k": [1, 2]}), g(), h(s="' + "word, " * 40 + '")]',
        "[f(a=1, # a comment, (here)\n b=2)]",
        "[f(a=1,), g(b='\\n', c=-1)]",
        "[f(a=1, a=2)]",  # (a repeated keyword: no call)
        "[f(a=1), g(b=h())]",  # (not a literal: no call)
    ],
    "qwen3_coder": [
        "Editing.\n<tool_call>\n<function=edit>\n<parameter=path>\n007.txt\n</parameter>\n<parameter=line>\n12\n"
        "</parameter>\n<parameter=note>\na < b </par x\n\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=read>\n<parameter=path>\n" + "word " * 40 + "\n</parameter>\n</function>\n</tool_call>",
        "<function=edit>\n<parameter=path>\na\n<parameter=line>\n3\n<parameter=path>\nb\n</function>",
        "<tool_call>\n<function=edit>\n<parameter=opt>\nnull\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=edit>\n<parameter=opt>\nnot null\n</parameter>\n<parameter=path>\n\n</parameter>",
    ],
}
SCHEMAS = {"edit": {"properties": {"path": {"type": "string"}, "line": {"type": "integer"}, "opt": {"type": ["string", "null"]}}}}


@pytest.mark.parametrize("name", list(TOOL_CALL_PARSERS))
def test_every_parser_streams_arguments_that_only_grow_to_the_response_s(name: str) -> None:
    """Under any split, each call's arguments go out in pieces before the end, and what went
    out is a prefix of the response's arguments (nothing sent is later changed): the pieces
    with the last ones join to the response's calls."""
    parser, rng = TOOL_CALL_PARSERS[name], random.Random(1)
    for text in STREAMED[name]:
        for stopped in (True, False):
            want = split_calls(parser, text, stopped, SCHEMAS)
            for _ in range(30):
                stream, sent, pieces, at = CallStream(parser, SCHEMAS), "", [], 0
                while at < len(text):
                    step = rng.randint(1, 8)
                    sent += stream.feed(text[at : at + step])
                    pieces += stream.pieces()
                    at += step
                streamed = join_pieces(pieces)
                rest, calls = stream.finish(stopped)
                assert (sent + rest, calls) == want, text
                if calls:
                    assert len(streamed) <= len(calls), text
                    for (got_name, got), (want_name, arguments) in zip(streamed, calls):
                        assert got_name == want_name and arguments.startswith(got), (text, got, arguments)
                    assert join_pieces([*pieces, *stream.last_pieces(calls)]) == calls, text
    # The first call of the first text is all out before the output ends (several pieces).
    stream, pieces = CallStream(parser, SCHEMAS), []
    for ch in STREAMED[name][0]:
        stream.feed(ch)
        pieces += stream.pieces()
    calls = stream.finish(True)[1]
    assert calls is not None and join_pieces(pieces)[0] == calls[0]
    assert len([p for p in pieces if p[0] == 0]) > 2


def test_streamed_values_as_the_xml_and_python_parsers_read_them() -> None:
    """A qwen3_coder string value streams as it comes (less a tail that may be a tag, its newlines
    at the ends); a typed one once whole; a repeated parameter keeps its first value. A pythonic
    plain string streams up to an escape; a triple-quoted one once whole."""
    coder, pythonic = TOOL_CALL_PARSERS["qwen3_coder"], TOOL_CALL_PARSERS["pythonic"]
    head = "<tool_call>\n<function=edit>\n<parameter=line>\n12\n</parameter>\n<parameter=path>\n"
    assert coder.partial(head + "a/b\n</par", SCHEMAS) == [("edit", '{"line":12,"path":"a/b')]
    assert coder.partial(head[: head.index("12") + 1], SCHEMAS) == [("edit", '{"line":')]  # (12, or 123?)
    assert coder.partial(head + "a</parameter><parameter=path>b", SCHEMAS) == [("edit", '{"line":12,"path":"a"')]
    assert split_calls(coder, head + "a</parameter><parameter=path>b</function>", True, SCHEMAS)[1] == [
        ("edit", '{"line":12,"path":"a"}')
    ]
    assert coder.partial(head.replace("=path", "=opt") + "text", SCHEMAS) == [("edit", '{"line":12,"opt":')]
    assert pythonic.partial('[f(a=1, s="ab\\"c', None) == [("f", '{"a":1,"s":"ab')]
    assert pythonic.partial('[f(s="""abc', None) == [("f", '{"s":')]
    assert pythonic.partial('[f(a=[1, "x', None) == [("f", '{"a":')]  # (a list: once whole)
    assert pythonic.partial("[f(a=1), g(", None) == [("f", '{"a":1}'), ("g", "{")]


def _formatter(stream: bool, parser: str | None = "hermes", **body: Any) -> ResponseFormatter:
    spec = parse_chat({**BODY, "stream": stream, **body}, ChatParsers(parser))
    return ResponseFormatter(spec, "chatcmpl-1", "m", None, 3, None)


def test_auto_answers_tool_calls_streamed_or_not() -> None:
    pieces = [Piece("Adding. <tool_"), Piece(ONE[6:40]), Piece(ONE[40:], finish_reason="stop")]
    choice = _formatter(False).choice(pieces)
    calls = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Adding. "
    assert [c["function"] for c in calls] == [{"name": "add", "arguments": '{"a":1,"b":"é"}'}]
    assert calls[0]["id"].startswith("chatcmpl-tool-")
    fmt = _formatter(True)
    chunks = [c for p in pieces for c in fmt.stream_piece(p)]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"content": "Adding. "} and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # The call in pieces: its id and name once known (the second piece has them), then its arguments.
    assert deltas[1] == {"tool_calls": [{"index": 0, **calls[0], "function": {"name": "add", "arguments": ""}}]}
    assert deltas[2] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a":1,"b":"é"}'}}]}
    # Cut by the length limit inside a call: text, as vLLM answers it.
    # OpenAI's parallel_tool_calls: false: the first call only (vLLM's rule too).
    two = [Piece(TWO, finish_reason="stop")]
    assert len(_formatter(False).choice(two)["message"]["tool_calls"]) == 2
    single = _formatter(False, parallel_tool_calls=False)
    assert [c["function"]["name"] for c in single.choice(two)["message"]["tool_calls"]] == ["add"]
    streamed_one = _formatter(True, parallel_tool_calls=False).stream_piece(two[0])
    assert [c["function"]["name"] for c in streamed_one[-1]["choices"][0]["delta"]["tool_calls"]] == ["add"]
    cut = [Piece("Adding. "), Piece(ONE[:30], finish_reason="length")]
    assert _formatter(False).choice(cut)["message"] == {"role": "assistant", "content": "Adding. " + ONE[:30]}
    fmt = _formatter(True)
    streamed = [c["choices"][0] for p in cut for c in fmt.stream_piece(p)]
    assert "".join(c["delta"].get("content", "") for c in streamed) == "Adding. " + ONE[:30]
    assert streamed[-1]["finish_reason"] == "length"


def test_auto_needs_a_parser_which_reads_the_output_of_any_constraint() -> None:
    with pytest.raises(ApiError) as info:
        parse_chat(BODY)
    assert info.value.status == 400 and "--enable-auto-tool-choice" in info.value.message
    spec = parse_chat(BODY, HERMES_ONLY)
    assert spec.structured is not None and spec.structured.tool_call is not None
    assert (spec.structured.tool_call.kind, spec.structured.tool_call.parser) == ("parsed", "hermes")
    assert spec.sampling.structured_outputs is None and not spec.sampling.skip_special_tokens  # (tags may be special tokens)
    assert parse_chat({**BODY, "tool_choice": "none"}, HERMES_ONLY).sampling.skip_special_tokens  # no tools read: as asked
    regex = parse_chat({**BODY, "structured_outputs": {"regex": "<tool_call>.*"}}, HERMES_ONLY)
    assert regex.sampling.structured_outputs is not None and regex.structured.tool_call.kind == "parsed"  # type: ignore[union-attr]
    required = parse_chat({**BODY, "tool_choice": "required"}, HERMES_ONLY)
    assert required.structured.tool_call.kind == "required"  # type: ignore[union-attr]


def test_a_resumed_stream_reads_calls_with_the_parser_it_was_accepted_with() -> None:
    """The resuming gateway may run another parser, or none: the journal names the first one's."""
    body = journal_body({**BODY, "stream": True}, "chat")
    header = JournalHeader("chatcmpl-1", "chat", body, "m", 1, 5, [1], None, [], tool_parser="hermes")
    spec = journaled_spec(decode(encode(header)))
    assert spec.structured.tool_call.parser == "hermes"  # type: ignore[union-attr]


def test_the_gateway_settings() -> None:
    assert GatewayConfig(enable_auto_tool_choice=True, tool_call_parser="hermes").chat_parsers == HERMES_ONLY
    assert GatewayConfig(tool_call_parser="hermes").chat_parsers == ChatParsers()  # vLLM's: both flags
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        GatewayConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="known: hermes, llama3_json"):
        GatewayConfig(tool_call_parser="mystery")
    args = build_parser().parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"])
    assert args.enable_auto_tool_choice and args.tool_call_parser == "llama3_json"
    with pytest.raises(SystemExit) as exit_info:
        main(["--enable-auto-tool-choice"])
    assert exit_info.value.code == 2


def test_the_flags_read_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_ENABLE_AUTO_TOOL_CHOICE", "1")
    monkeypatch.setenv("CONVEYOR_TOOL_CALL_PARSER", "hermes")
    args = build_parser().parse_args([])
    assert args.enable_auto_tool_choice and args.tool_call_parser == "hermes"
    for off in ("false", "0", "no", "OFF", ""):
        monkeypatch.setenv("CONVEYOR_ENABLE_AUTO_TOOL_CHOICE", off)
        assert not build_parser().parse_args([]).enable_auto_tool_choice
    monkeypatch.setenv("CONVEYOR_TOOL_CALL_PARSER", "")  # set but empty: none (it refused to start)
    assert build_parser().parse_args([]).tool_call_parser is None


MISTRAL = TOOL_CALL_PARSERS["mistral"]


def test_mistral_reads_both_of_its_formats_and_gives_nine_character_ids() -> None:
    """Before v11 a JSON array after ``[TOOL_CALLS]``; from v11 ``name[ARGS]{...}`` after each. Its
    templates refuse a later turn whose call ids are not 9 letters and digits."""
    old = 'Sure.[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, {"name": "sub", "arguments": {}}]'
    assert split_calls(MISTRAL, old, True) == ("Sure.", [("add", '{"a":1}'), ("sub", "{}")])
    new = '[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]sub[ARGS]{}'
    assert split_calls(MISTRAL, new, True) == ("", [("add", '{"a":1}'), ("sub", "{}")])
    for bad in ("[TOOL_CALLS]add[ARGS]{", "[TOOL_CALLS][]", "[TOOL_CALLS]add{}", '[TOOL_CALLS][ARGS]{"a": 1}'):
        assert split_calls(MISTRAL, bad, True) == (bad, None), bad
    assert split_calls(MISTRAL, new, False)[1] is None  # no end tag: cut by the length limit, maybe incomplete
    spec = parse_chat({**BODY, "stream": True}, ChatParsers("mistral"))
    fmt = ResponseFormatter(spec, "chatcmpl-1", "m", None, 3, None)
    chunks = [c for p in (Piece("[TOOL_"), Piece("CALLS]add[ARGS]{}", finish_reason="stop")) for c in fmt.stream_piece(p)]
    (call,) = chunks[-1]["choices"][0]["delta"]["tool_calls"]
    assert len(call["id"]) == 9 and call["id"].isalnum() and call["function"] == {"name": "add", "arguments": "{}"}
    whole = ResponseFormatter(parse_chat(BODY, ChatParsers("mistral")), "chatcmpl-1", "m", None, 3, None)
    whole.created = fmt.created
    assert whole.choice([Piece(new, finish_reason="stop")])["message"]["tool_calls"][0]["id"] == call["id"]


def test_pythonic_reads_a_list_of_calls_without_running_it() -> None:
    pythonic = TOOL_CALL_PARSERS["pythonic"]
    text = '[get_weather(city="Paris", days=3), add(a=1.5, b=[1, (2, 3)], c=None, d=True)]'
    assert split_calls(pythonic, text, True) == (
        "",
        [("get_weather", '{"city":"Paris","days":3}'), ("add", '{"a":1.5,"b":[1,[2,3]],"c":null,"d":true}')],
    )
    assert split_calls(pythonic, "<|python_start|>[f()]<|python_end|>", True)[1] == [("f", "{}")]
    for bad in (
        "[f(1)]",  # positional arguments have no names
        "[f(**x)]",
        "[f(a=g())]",  # not a literal: never evaluated
        "[f(a=__import__('os').system('true'))]",
        "[f(a={1, 2})]",  # a set is no JSON
        "[os.system(a=1)]",
        "[f(a=1)",
        "[" * 500 + "]" * 500,  # nested too deep for the parser
        "[]",
        "The answer is [f(a=1)]",  # calls are the whole answer
    ):
        assert split_calls(pythonic, bad, True)[1] is None, bad
    assert split_calls(pythonic, text, False)[1] is None  # cut by the length limit


def test_qwen3_coder_reads_xml_calls_typed_by_the_tools_schemas() -> None:
    coder = TOOL_CALL_PARSERS["qwen3_coder"]
    schema = {
        "type": "object",
        "properties": {
            "path": {"type": "string"},
            "line": {"type": "integer"},
            "ratio": {"type": "number"},
            "force": {"type": "boolean"},
            "tags": {"type": "array"},
            "meta": {"type": "object"},
        },
    }
    schemas = {"edit": schema}
    text = (
        "Editing.\n<tool_call>\n<function=edit>\n<parameter=path>\n007.txt\n</parameter>\n<parameter=line>\n12\n</parameter>\n"
        '<parameter=ratio>\n0.5\n</parameter>\n<parameter=force>\nTrue\n</parameter>\n<parameter=tags>\n["a", 1]\n</parameter>\n'
        "<parameter=meta>\nnot json\n</parameter>\n<parameter=extra>\n42\n</parameter>\n</function>\n</tool_call>"
    )
    content, calls = split_calls(coder, text, True, schemas)
    assert content == "Editing.\n" and calls is not None
    assert [(n, json.loads(a)) for n, a in calls] == [
        # a string stays one ("007.txt"), a value that does not read as its type stays text,
        # and one without a schema too (vLLM's rule)
        (
            "edit",
            {"path": "007.txt", "line": 12, "ratio": 0.5, "force": True, "tags": ["a", 1], "meta": "not json", "extra": "42"},
        )
    ]
    code = "<tool_call>\n<function=write>\n<parameter=body>\ndef f():\n    return 1\n</parameter>\n</function>\n</tool_call>"
    assert split_calls(coder, code, True)[1] == [("write", json.dumps({"body": "def f():\n    return 1"}, separators=(",", ":")))]
    two = code + "\n" + code.replace("write", "read")
    assert [n for n, _ in split_calls(coder, two, True)[1] or []] == ["write", "read"]
    assert split_calls(coder, code[:-12], True)[1] is not None and split_calls(coder, code[:-12], False)[1] is None
    assert split_calls(coder, "<tool_call>no function</tool_call>", True)[1] is None
    # Through the formatter, with the request's tools' schemas.
    tools = [{"type": "function", "function": {"name": "edit", "parameters": schema}}]
    spec = parse_chat({**BODY, "tools": tools, "stream": True}, ChatParsers("qwen3_coder"))
    fmt = ResponseFormatter(spec, "chatcmpl-1", "m", None, 3, None)
    call = "<tool_call>\n<function=edit>\n<parameter=line>\n7\n</parameter>\n</function>\n</tool_call>"
    chunks = [c for p in (Piece(call[:20]), Piece(call[20:], finish_reason="stop")) for c in fmt.stream_piece(p)]
    assert chunks[-1]["choices"][0]["delta"]["tool_calls"][0]["function"] == {"name": "edit", "arguments": '{"line":7}'}


def test_edge_cases_of_the_xml_and_mistral_parsers() -> None:
    """A list-valued ``type`` is read (not a 500, or a cut stream); a run of ``<function=`` is
    cheap on the event loop; a block's second function is kept; mistral drops v11's ``[CALL_ID]``
    from the name; an overflowing number keeps the call."""
    coder, mistral = TOOL_CALL_PARSERS["qwen3_coder"], TOOL_CALL_PARSERS["mistral"]
    optional = {
        "f": {"properties": {"n": {"type": ["integer", "null"]}, "m": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}
    }
    call = (
        "<tool_call>\n<function=f>\n<parameter=n>\n5\n</parameter>\n<parameter=m>\nnull\n</parameter>\n</function>\n</tool_call>"
    )
    assert split_calls(coder, call, True, optional)[1] == [("f", '{"n":5,"m":null}')]
    assert split_calls(coder, call, True, {"f": {"properties": {"n": {"type": {"odd": 1}}}}})[1] == [
        ("f", '{"n":"5","m":"null"}')
    ]
    huge = {"f": {"properties": {"x": {"type": "number"}}}}
    assert split_calls(coder, call.replace("<parameter=n>\n5", "<parameter=x>\n1e999"), True, huge)[1] == [
        ("f", '{"x":"1e999","m":"null"}')
    ]
    # (Hostile runs of tags read as no call, in linear time: names stop at "<".)
    for hostile in ("<tool_call>" + "<function=" * 4_000, "<tool_call><function=f>" + "<parameter=" * 4_000):
        assert split_calls(coder, hostile, True)[1] in (None, [("f", "{}")])
    both = "<tool_call>\n<function=f>\n</function>\n<function=g>\n</function>\n</tool_call>"
    assert [n for n, _ in split_calls(coder, both, True)[1] or []] == ["f", "g"]
    echoed = '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}'
    assert split_calls(mistral, echoed, True)[1] == [("get_weather", '{"city":"Paris"}')]


def test_bare_qwen3_coder_functions_and_mistral_ids_for_every_tool_choice() -> None:
    """Qwen3-Coder's functions without ``<tool_call>`` are read (as vLLM does), and "required" or a
    named function behind the mistral parser get Mistral-shaped ids (Mistral's templates refuse
    OpenAI-shaped ones on a later turn)."""
    coder = TOOL_CALL_PARSERS["qwen3_coder"]
    bare = "Let me.\n<function=f>\n<parameter=a>\nx\n</parameter>\n</function>"
    assert split_calls(coder, bare, True) == ("Let me.\n", [("f", '{"a":"x"}')])
    assert split_calls(coder, bare, False)[1] is None  # (no end tag around it: only a stop says it is whole)
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        spec = parse_chat({**BODY, "tool_choice": choice}, ChatParsers("mistral"))
        fmt = ResponseFormatter(spec, "chatcmpl-1", "m", None, 3, None)
        text = '[{"name": "add", "parameters": {}}]' if choice == "required" else "{}"
        (call,) = fmt.choice([Piece(text, finish_reason="stop")])["message"]["tool_calls"]
        assert len(call["id"]) == 9 and call["id"].isalnum()
    plain = parse_chat({**BODY, "tool_choice": "required"})
    (call,) = ResponseFormatter(plain, "chatcmpl-1", "m", None, 3, None).choice(
        [Piece('[{"name": "add"}]', finish_reason="stop")]
    )["message"]["tool_calls"]
    assert call["id"].startswith("chatcmpl-tool-")


@pytest.mark.parametrize("name", ["mistral", "pythonic", "qwen3_coder"])
def test_streamed_calls_through_the_formatter_replay_alike_and_join_to_the_message(name: str) -> None:
    """Chunks in pieces (id and name in the first, arguments after), the same again from a second
    formatter over the same outputs (a resumed stream replays its journaled ones), and their
    arguments join to the non-streamed message's."""
    text = STREAMED[name][0]
    tools = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]
    body = {**BODY, "tools": [ADD, *tools]}
    outputs = [Piece(text[i : i + 5]) for i in range(0, len(text), 5)] + [Piece("", finish_reason="stop")]
    runs = []
    for _ in range(2):
        fmt = ResponseFormatter(parse_chat({**body, "stream": True}, ChatParsers(name)), "chatcmpl-1", "m", None, 3, None)
        fmt.created = 1
        runs.append([json.dumps(c) for p in outputs for c in fmt.stream_piece(p)])
    assert runs[0] == runs[1]
    entries = [e for c in runs[0] for e in json.loads(c)["choices"][0]["delta"].get("tool_calls", [])]
    assert len([e for e in entries if e["index"] == 0]) > 2  # (the first call in several pieces)
    whole = ResponseFormatter(parse_chat(body, ChatParsers(name)), "chatcmpl-1", "m", None, 3, None)
    whole.created = 1
    message = whole.choice([Piece(text, finish_reason="stop")])["message"]
    joined: dict[int, dict[str, str]] = {}
    for e in entries:
        call = joined.setdefault(e["index"], {"id": "", "name": "", "arguments": ""})
        call["id"] += e.get("id", "")
        call["name"] += e["function"].get("name", "")
        call["arguments"] += e["function"]["arguments"]
    assert [joined[i] for i in sorted(joined)] == [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in message["tool_calls"]
    ]
