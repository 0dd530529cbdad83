"""One sequence's output processing: its token ids in, the text its client sees out.

The one place where generated tokens become text, shared by the server (`Generation`, one
engine event at a time) and the offline `gateway.llm.LLM` (one engine step at a time), so both
give the same text, ``finish_reason`` and ``stop_reason`` for the same tokens:

- incremental detokenization (`IncrementalDetokenizer`);
- stop strings (`StopMatcher`), with the hold-back of text that may begin one; where one ends
  the sequence, the tokens after it are not the client's (nor their logprobs);
- the stop-token rule (vLLM's): the token that stopped the engine (EOS, or one of
  ``stop_token_ids``) is no text unless ``include_stop_str_in_output``; it is still a
  completion token, in ``token_ids`` and in the logprobs.

Why here, in the frontend, and not in ``common/``: turning tokens into text needs the tokenizer
and the request's API semantics, which only a frontend holds (the engine works in token ids).
vLLM splits it the same way: its ``LLM`` is a frontend (detokenization, output processing)
around an in-process engine core, which is why the offline `LLM` lives beside the gateway's
other frontend code and imports the scheduler and executor it drives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.sampling_params import SamplingParams
from gateway.output.detokenizer import IncrementalDetokenizer
from gateway.output.stop import StopMatcher


@dataclass(slots=True)
class OutputDelta:
    """What a sequence's new tokens give its client.

    ``num_tokens``: how many of the new tokens are the client's (fewer when a stop string ended
    the sequence inside them). ``finish_reason`` is "stop" or "length" once the sequence ended,
    else None; ``stop_reason`` (vLLM's) the stop string or stop token id that ended it (None for
    EOS and the length limit). ``cut_short``: a stop string ended it before the engine did, so
    the engine must be told to stop.
    """

    text: str
    num_tokens: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cut_short: bool = False


class OutputProcessor:
    """Turns one sequence's generated tokens into text deltas (see the module docstring)."""

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.stop = StopMatcher(params.stop, params.include_stop_str_in_output)
        self.include_stop = params.include_stop_str_in_output

    def add(
        self, token_ids: list[int], finished: bool = False, finish_reason: str | None = None, stop_reason: int | None = None
    ) -> OutputDelta:
        """The delta of ``token_ids``, the sequence's next tokens; ``finished``, ``finish_reason``
        and ``stop_reason``: the engine's word on whether (and why) they are its last."""
        text, stopped, used = self._text(token_ids, finished, finish_reason)
        if stopped:
            return OutputDelta(text, used, "stop", self.stop.matched, not finished)
        if finished:
            reason = "length" if finish_reason == "length" else "stop"
            return OutputDelta(text + self.stop.flush(), used, reason, stop_reason if reason == "stop" else None)
        return OutputDelta(text, used)

    def _text(self, token_ids: list[int], finished: bool, finish_reason: str | None) -> tuple[str, bool, int]:
        """The text of ``token_ids`` up to a stop string; whether one ended it; how many of the
        tokens that text used. With stop strings, tokens are checked one by one, so that where a
        sequence stops, and its token count, do not depend on how its steps were grouped."""
        tokens = token_ids
        if finished and finish_reason == "stop" and not self.include_stop:
            tokens = tokens[:-1]  # (the stop-token rule: still a completion token)
        if not self.stop.stops or len(tokens) <= 1:
            text = self.detokenizer.add(tokens)
            if finished:
                text += self.detokenizer.finish()
            out, stopped = self.stop.feed(text)
            return out, stopped, len(tokens) if stopped else len(token_ids)
        out = ""
        for k, token in enumerate(tokens):
            text = self.detokenizer.add([token])
            if finished and k == len(tokens) - 1:
                text += self.detokenizer.finish()
            piece, stopped = self.stop.feed(text)
            out += piece
            if stopped:
                return out, True, k + 1
        return out, False, len(token_ids)
