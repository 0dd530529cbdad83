"""Reasoning parsers (`gateway.output.reasoning_parsers`) and a chat choice's output through them and the
tool-call parsers (`gateway.output.chat_output`): the split of a whole output, and that a stream in any
pieces joins to it."""

from __future__ import annotations

import random
from typing import Any

import pytest

from common.protocol import JournalHeader, decode, encode
from gateway.engine.journal import journal_body, journaled_spec
from gateway.http.config import GatewayConfig
from gateway.http.server import build_parser
from gateway.openai.schema import ChatParsers, parse_chat
from gateway.output.chat_output import ChatOutput
from gateway.output.generation import Piece
from gateway.output.reasoning_parsers import REASONING_PARSERS, ReasoningStream, prompt_phase
from gateway.output.responses import ResponseFormatter
from gateway.output.tool_parsers import TOOL_CALL_PARSERS

pytestmark = pytest.mark.unit

R1, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]
MESSAGES = [{"role": "user", "content": "hi"}]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'


def test_a_whole_output_splits_into_reasoning_and_content() -> None:
    assert R1.split("Let me think.</think>\n\nIt is 4.") == ("Let me think.", "\n\nIt is 4.")
    assert R1.split("<think>Hmm.</think>4") == ("Hmm.", "4")  # a tag the model writes anyway is dropped
    assert R1.split("Still thinking when cut") == ("Still thinking when cut", "")
    assert QWEN3.split("<think>\nHmm.\n</think>\n\n4") == ("\nHmm.\n", "\n\n4")
    assert QWEN3.split("4, no thinking (enable_thinking=False)") == (None, "4, no thinking (enable_thinking=False)")
    assert QWEN3.split("<think>cut while thinking") == ("cut while thinking", "")
    assert QWEN3.split("x <think>y</think>") == (None, "x <think>y</think>")  # only at the start


TEXTS = [
    "",
    "<think>",
    "<thi",
    "</think>",
    "plain answer",
    "reasoning</think>answer",
    "<think>a < b, and </thin is no tag</think> so: <think>",
    "<think>\nstep 1\n</think>\n\nThe answer.</think>",
    "<<think>>",
]


def test_the_prompt_may_have_opened_or_closed_the_thinking() -> None:
    """As vLLM reads the prompt's tokens: a template that opens the thinking (Qwen3's 2507 thinking
    models) or closes it (``enable_thinking=False``), or a prefilled answer past its thinking."""
    assert prompt_phase("<|im_start|>assistant\n<think>\n") == "reasoning"
    assert prompt_phase("<|im_start|>assistant\n<think>\n\n</think>\n\n") == "content"
    assert prompt_phase("<think>old</think> then <|im_start|>assistant\n") == ""  # (only the end counts)
    assert prompt_phase("...", continued="<think>ok</think>The answer is") == "content"
    assert prompt_phase("...", continued="<think>Let me") == "reasoning"
    assert prompt_phase("...", continued="The answer is") == ""
    assert QWEN3.split("I should add.</think>42", "reasoning") == ("I should add.", "42")  # (vLLM's qwen3 does too)
    assert R1.split(" 42.", "content") == (None, " 42.")  # in the content phase it stays content
    assert R1.split("<think>x</think>y", "content") == (None, "<think>x</think>y")


@pytest.mark.parametrize("phase", ["", "reasoning", "content"])
@pytest.mark.parametrize("parser", [R1, QWEN3], ids=lambda p: p.name)
def test_a_stream_in_any_pieces_joins_to_the_whole_split(parser: Any, phase: str) -> None:
    rng = random.Random(1)
    for text in TEXTS:
        reasoning, content = parser.split(text, phase)
        for _ in range(30):
            stream, got_r, got_c, at = ReasoningStream(parser, phase), "", "", 0
            while at < len(text):
                step = rng.randint(1, 5)
                r, c = stream.feed(text[at : at + step])
                got_r, got_c, at = got_r + r, got_c + c, at + step
            r, c = stream.finish()
            assert (got_r + r, got_c + c) == (reasoning or "", content), (parser.name, phase, text)
    # The reasoning goes out as it comes; only what may begin the end tag waits.
    stream = ReasoningStream(R1)
    assert stream.feed("Let me see </th") == ("Let me see ", "")
    assert stream.feed("ink>It is") == ("", "It is")


def _output(reasoning: Any = R1, include: bool = True, tools: Any = TOOL_CALL_PARSERS["hermes"]) -> ChatOutput:
    return ChatOutput(reasoning, include, tools)


IDS = ("chatcmpl-1", 1700000000, 0)


def test_reasoning_then_tool_calls_streamed_or_not() -> None:
    text = "I should add.</think>Adding." + CALL
    message, reason = _output().message(text, "stop", IDS)
    assert reason == "tool_calls" and message["reasoning"] == message["reasoning_content"] == "I should add."
    assert message["content"] == "Adding." and message["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a":1}'}
    rng = random.Random(2)
    for _ in range(20):
        out, deltas, at = _output(), [], 0
        while at < len(text):
            step = rng.randint(1, 7)
            deltas.append(out.delta(text[at : at + step], "stop" if at + step >= len(text) else None, IDS))
            at += step
        assert deltas[-1][1] == "tool_calls" and all(r is None for _, r in deltas[:-1])
        assert "".join(d.get("reasoning", "") for d, _ in deltas) == "I should add."
        assert all(d.get("reasoning") == d.get("reasoning_content") for d, _ in deltas)
        assert "".join(d.get("content", "") for d, _ in deltas) == "Adding."
        entries = [c for d, _ in deltas for c in d.get("tool_calls", [])]  # (the call in pieces)
        assert [c["function"]["name"] for c in entries if "name" in c["function"]] == ["add"]
        assert "".join(c["function"]["arguments"] for c in entries) == '{"a":1}'
    # vLLM's include_reasoning: false drops it; content left empty by thinking is null.
    assert _output(include=False).message(text, "stop", IDS)[0].keys() == {"role", "content", "tool_calls"}
    assert _output(tools=None).message("cut while thinking", "length", IDS) == (
        {"role": "assistant", "content": None, "reasoning": "cut while thinking", "reasoning_content": "cut while thinking"},
        "length",
    )
    plain = _output(reasoning=None).message("no thinking here", "length", IDS)
    assert plain[0] == {"role": "assistant", "content": "no thinking here"}


def test_the_formatter_splits_chat_only_and_not_under_a_grammar() -> None:
    parsers = ChatParsers(reasoning="deepseek_r1")
    spec = parse_chat({"messages": MESSAGES, "stream": True}, parsers)
    fmt = ResponseFormatter(spec, "chatcmpl-1", "m", None, 3, None)
    chunks = [c for p in (Piece("Hmm</th"), Piece("ink>4", finish_reason="stop")) for c in fmt.stream_piece(p)]
    assert [c["choices"][0]["delta"] for c in chunks] == [{"reasoning": "Hmm", "reasoning_content": "Hmm"}, {"content": "4"}]
    # A grammar binds the output from its first token: there is no thinking to take out.
    constrained = parse_chat({"messages": MESSAGES, "response_format": {"type": "json_object"}}, parsers)
    assert constrained.reasoning_parser is None
    assert not parse_chat({"messages": MESSAGES, "include_reasoning": False}, parsers).include_reasoning
    body = journal_body({"messages": MESSAGES, "stream": True}, "chat")
    header = JournalHeader(
        "chatcmpl-1", "chat", body, "m", 1, 5, [1], None, [], reasoning_parser="qwen3", reasoning_phase="content"
    )
    resumed = journaled_spec(decode(encode(header)))
    assert (resumed.reasoning_parser, resumed.reasoning_phase) == ("qwen3", "content")  # as the accepting gateway had it


def test_the_reasoning_parser_setting() -> None:
    assert GatewayConfig(reasoning_parser="qwen3").chat_parsers == ChatParsers(reasoning="qwen3")
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2'"):
        GatewayConfig(reasoning_parser="r2")
    assert build_parser().parse_args(["--reasoning-parser", "deepseek_r1"]).reasoning_parser == "deepseek_r1"


def test_template_variables_cannot_take_the_renderers_names_or_crash_it() -> None:
    """``messages`` cannot be passed as a template variable, and a variable a template divides by
    is a clear error, not a 500."""
    from types import SimpleNamespace

    from gateway.http.errors import ApiError
    from gateway.openai.chat_messages import TemplateOptions, chat_text

    def render(
        messages: Any, tools: Any = None, tokenize: bool = False, add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        return "x" * (10 // kwargs.get("n", 1))

    tok = SimpleNamespace(chat_template="x", apply_chat_template=render)
    assert chat_text(tok, MESSAGES, TemplateOptions(kwargs={"n": 2})) == "xxxxx"
    for kwargs, words in (
        ({"messages": []}, "may not set 'messages'"),
        ({"tokenize": True}, "may not set"),
        ({"n": 0}, "ZeroDivision"),
    ):
        with pytest.raises(ApiError, match=words) as info:
            chat_text(tok, MESSAGES, TemplateOptions(kwargs=kwargs))
        assert info.value.status == 400 and info.value.param == "chat_template_kwargs"


def test_big_template_variables_or_messages_count_as_a_large_input() -> None:
    from gateway.openai.json_input import LARGE_INPUT_BYTES, json_size
    from gateway.openai.schema import parse_tokenize

    big = {"messages": MESSAGES, "chat_template_kwargs": {"docs": ["x" * 1000] * 100}}
    assert parse_chat(big).input_size() > LARGE_INPUT_BYTES and parse_tokenize(big).input_size() > LARGE_INPUT_BYTES
    thought = [*MESSAGES, {"role": "assistant", "content": "4", "reasoning": "y" * LARGE_INPUT_BYTES}]
    assert parse_tokenize({"messages": thought}).input_size() > LARGE_INPUT_BYTES
    assert json_size(list(range(10**6))) < 2 * LARGE_INPUT_BYTES  # (counted only so far)
