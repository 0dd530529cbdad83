"""Incremental detokenization: text deltas from token ids as they arrive.

Decoding token by token breaks in two ways: a multi-byte character split across tokens decodes
to U+FFFD, and tokenizers that drop a word's leading space at the start of a string (SentencePiece)
lose spaces. So each step decodes a short window of already-emitted tokens plus the new ones and
emits only the part past the window's own text; a delta that ends in U+FFFD is held back until
the character completes. `finish` reconciles with one full decode, so the concatenated deltas
equal ``decode(all tokens)`` whenever the decoder is monotonic (appending tokens never changes
the text of earlier ones).

A byte-fallback decoder (Llama-2, Mistral: ``<0xE6>`` tokens) is not, for invalid UTF-8: a run of
byte tokens decodes to text while it is valid and to one U+FFFD per byte once a stray byte joins
it, so text already streamed can change meaning. What was sent stays sent; the stream goes on
from there (`diverged`), and nothing after it is lost (it used to wait for the window's text to
match again, which it never did: the rest of the stream was dropped).
"""

from __future__ import annotations

import logging
from typing import Any

from tokenizers.decoders import DecodeStream

logger = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text deltas."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # A fast tokenizer's Rust decoder directly, unless transformers would post-process its
        # text (clean-up of spaces): the same string without the wrapper's per-call Python work.
        # Its streaming decoder (`DecodeStream`, the same window algorithm in Rust) then does the
        # steps: one call per token instead of two window decodes.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        cleans = getattr(tokenizer, "clean_up_tokenization_spaces", True)
        self._backend = backend if backend is not None and cleans is False else None
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if self._backend is not None else None
        self.token_ids: list[int] = []
        self.text = ""  # everything emitted so far
        # Tokens [prefix_offset, read_offset) are emitted context; [read_offset:] are pending.
        self.prefix_offset = 0
        self.read_offset = 0
        self.diverged = False  # emitted text no longer matches the full decode (see the module docstring)

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return str(self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens))
        return str(self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens))

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the new text that is now safe to emit (maybe "")."""
        if not token_ids:
            return ""
        start = len(self.token_ids)
        self.token_ids.extend(token_ids)
        pieces: list[str] = []
        if self._stream is not None:
            assert self._backend is not None
            for i, token_id in enumerate(token_ids, start):
                try:
                    piece = self._stream.step(self._backend, token_id)
                except Exception:  # tokenizers' "Invalid prefix encountered": a byte run turned invalid
                    # Its state is broken: the window below takes over from the last emitted token
                    # (its context keeps the next word's leading space, a new stream would not).
                    self._stream, self.diverged = None, True
                    break
                if piece is not None:
                    pieces.append(piece)
                    self.prefix_offset, self.read_offset = self.read_offset, i + 1
        if self._stream is None:
            pieces.append(self._window_delta(final=False))
        delta = "".join(pieces)
        self.text += delta
        return delta

    def _window_delta(self, final: bool) -> str:
        """The text of the pending tokens past their window's emitted context; before the end,
        nothing while that text is empty or ends inside a character."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if not final and (len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT)):
            return ""  # incomplete character (or nothing visible yet): wait for more tokens
        if not full_text.startswith(prefix_text):
            self.diverged = True  # the context's text changed: what is past its length is new
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return full_text[len(prefix_text) :]

    def finish(self) -> str:
        """Emit whatever is still held back, so that all deltas equal one full decode (unless the
        stream diverged: then the held-back tokens' text, after their window)."""
        full = self._decode(self.token_ids)
        if full.startswith(self.text):
            rest = full[len(self.text) :]
        else:
            if not self.diverged:  # should not happen; never re-emit what the client already has
                logger.warning("incremental text diverged from the full decode")
            self.diverged = True
            rest = self._window_delta(final=True)
        self.text += rest
        self.read_offset = self.prefix_offset = len(self.token_ids)
        return rest
