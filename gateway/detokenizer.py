"""Incremental detokenization: text deltas from token ids as they arrive.

Decoding token by token breaks in two ways: a multi-byte character split across tokens decodes
to U+FFFD, and tokenizers that drop a word's leading space at the start of a string (SentencePiece)
lose spaces. So each step decodes a short window of already-emitted tokens plus the new ones and
emits only the part past the window's own text; a delta that ends in U+FFFD is held back until
the character completes. `finish` reconciles with one full decode, so the concatenated deltas
always equal ``decode(all tokens)``.
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
        # steps: one call per token instead of two window decodes (6.2 -> 4.3 us per token of a
        # 128-token stream, measured here).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        cleans = getattr(tokenizer, "clean_up_tokenization_spaces", True)
        self._backend = backend if backend is not None and cleans is False else None
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if self._backend is not None else None
        self.token_ids: list[int] = []
        self.text = ""  # everything emitted so far
        # Tokens [prefix_offset, read_offset) are emitted context; [read_offset:] are pending.
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return str(self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens))
        return str(self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens))

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the new text that is now safe to emit (maybe "")."""
        if not token_ids:
            return ""
        self.token_ids.extend(token_ids)
        if self._stream is not None:
            step, backend = self._stream.step, self._backend
            assert backend is not None  # a stream exists only with the backend
            delta = "".join([piece for token_id in token_ids if (piece := step(backend, token_id)) is not None])
            self.text += delta
            return delta
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT) or not full_text.startswith(prefix_text):
            # Incomplete character (or nothing visible yet): wait for more tokens.
            return ""
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        """Emit whatever is still held back, so that all deltas equal one full decode."""
        full = self._decode(self.token_ids)
        if full.startswith(self.text):
            rest = full[len(self.text) :]
        else:  # should not happen; never re-emit what the client already has
            logger.warning("incremental text diverged from the full decode; %d chars dropped", len(full) - len(self.text))
            rest = ""
        self.text += rest
        self.read_offset = self.prefix_offset = len(self.token_ids)
        return rest
