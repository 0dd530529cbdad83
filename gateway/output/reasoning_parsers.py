"""Reasoning parsers: a thinking model's output -> ``reasoning`` and ``content`` (vLLM's ``--reasoning-parser``).

Both parsers read ``<think>``...``</think>``:

- ``deepseek_r1`` (DeepSeek-R1 and its distills, QwQ, Qwen3's thinking-only 2507 models): the
  chat template opens the thinking in the prompt, so the output is reasoning from its first token
  (a ``<think>`` the model writes anyway is dropped) up to ``</think>``; without one it is all
  reasoning (cut by the length limit while thinking).
- ``qwen3`` (Qwen3's hybrid models): the output is reasoning only when it begins with ``<think>``
  (``enable_thinking=False`` makes the template close the thinking in the prompt, and the output
  is plain content).

Either way the prompt may already have decided (`prompt_phase`, as vLLM looks at the prompt's
tokens): one that ends opening the thinking (Qwen3's 2507 thinking models, DeepSeek-R1's newer
templates) makes the output reasoning from its first token; one that ends closing it (Qwen3 with
``enable_thinking=False``, a prefilled answer after its thinking) makes it all content.

Streamed, the text goes out as it comes, reasoning or content; what may be the start of a tag
waits for the next piece, so a stream and a response of the same tokens split alike (vLLM's
qwen3 parser decides on the whole text, which a stream cannot: here it decides on the start).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.output.stop import tag_prefix

START, END = "<think>", "</think>"


def prompt_phase(prompt: str, continued: str | None = None) -> str:
    """Where the prompt leaves the output: "reasoning" when it ends opening the thinking,
    "content" when it ends closing it, else "". ``continued``: the final (assistant) message the
    output goes on from (``continue_final_message``), whose last tag decides."""
    if continued is not None:
        start, end = continued.rfind(START), continued.rfind(END)
        return "" if start == end else "content" if end > start else "reasoning"
    tail = prompt.rstrip()
    return "content" if tail.endswith(END) else "reasoning" if tail.endswith(START) else ""


@dataclass(frozen=True, slots=True)
class ThinkParser:
    """Reasoning between ``<think>`` and ``</think>``; ``opened``: it starts with the output
    (deepseek_r1), else only where the output starts with the tag (qwen3)."""

    name: str
    opened: bool

    def split(self, text: str, phase: str = "") -> tuple[str | None, str]:
        """(reasoning, content) of a whole output that starts in ``phase`` (`prompt_phase`);
        reasoning None when there is none."""
        if phase == "content":
            return None, text
        if text.startswith(START):
            text = text[len(START) :]
        elif not self.opened and phase != "reasoning":
            return None, text
        reasoning, end, content = text.partition(END)
        return reasoning, content if end else ""


REASONING_PARSERS: dict[str, ThinkParser] = {p.name: p for p in (ThinkParser("deepseek_r1", True), ThinkParser("qwen3", False))}


class ReasoningStream:
    """One streamed choice's text through a `ThinkParser`: `feed` returns the (reasoning, content)
    that can go out now, `finish` what was held back, once the output has ended."""

    def __init__(self, parser: ThinkParser, phase: str = "") -> None:
        self.parser = parser
        self.start_phase = phase  # where the prompt left it (`prompt_phase`)
        # "start" (the output's first characters may be <think>), "reasoning", "content"
        self.phase = "content" if phase == "content" else "start"
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        text, self.held = self.held + text, ""
        if self.phase == "start":
            if START.startswith(text):  # (a prefix of the tag, or nothing yet)
                self.held = text
                return "", ""
            opened = text.startswith(START)
            if opened:
                text = text[len(START) :]
            self.phase = "reasoning" if opened or self.parser.opened or self.start_phase == "reasoning" else "content"
        if self.phase == "content":
            return "", text
        reasoning, end, content = text.partition(END)
        if end:
            self.phase = "content"
            return reasoning, content
        keep = tag_prefix(text, END)
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        """The held text, as what it turned out to be: a tag never completed is text."""
        held, self.held = self.held, ""
        if self.phase == "start":  # the whole output was a prefix of <think>
            reasoning, content = self.parser.split(held, self.start_phase)
            return reasoning or "", content
        return (held, "") if self.phase == "reasoning" else ("", held)
