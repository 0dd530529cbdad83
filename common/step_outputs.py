"""`StepOutputs`: what one engine step produced for one gateway's requests (scheduler -> gateway).

A message type of `common.protocol` (re-exported there, registered under the tag ``out``), kept in
a module of its own for its size. Prompt logprobs travel in columns of their own
(`pack_prompt_logprobs`), also used by `common.protocol.StepResult`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.codec import pack_logprobs, packed, unpack_logprobs

PromptLogprobs = list[dict[int, float] | None]

# Sizes as packed on the wire (`common.codec`): what message splitting and the scheduler's byte
# budget (`scheduler.step_bytes`) count.
INT_BYTES = 4  # a packed int32: a token id, block id, count or index
LOGPROB_ENTRY_BYTES = 12  # a packed int32 id and float64 value
ROW_BYTES = 64  # about: a row's request id, flags and one-per-row columns


def logprobs_bytes(entries: list[dict[int, float] | None] | None) -> int:
    """The packed size of per-position logprob entries (a count each, and their pairs)."""
    return sum(INT_BYTES + LOGPROB_ENTRY_BYTES * len(e) if e else INT_BYTES for e in entries) if entries else 0


def row_bytes(tokens: list[int], logprobs: list[dict[int, float] | None] | None, prompt: PromptLogprobs | None) -> int:
    """About what one row of a `StepOutputs` adds to its encoded size."""
    return ROW_BYTES + INT_BYTES * len(tokens) + logprobs_bytes(logprobs) + logprobs_bytes(prompt)


def pack_prompt_logprobs(
    per_row: list[PromptLogprobs | None],
) -> tuple[list[int], list[int], list[int], list[float]]:
    """Columns ``(num, counts, ids, values)`` of per-row prompt logprobs (None: the row has none,
    ``num`` -1); all empty when no row has any (the common case)."""
    if all(entries is None for entries in per_row):
        return [], [], [], []
    num = [-1 if entries is None else len(entries) for entries in per_row]
    counts, ids, values = pack_logprobs([e for entries in per_row if entries is not None for e in entries])
    return num, counts, ids, values


def unpack_prompt_logprobs(
    rows: int, num: list[int], counts: list[int], ids: list[int], values: list[float]
) -> list[PromptLogprobs | None]:
    """Inverse of `pack_prompt_logprobs` for ``rows`` rows (all None when the columns are empty);
    raises `ProtocolError` if the columns disagree."""
    from common.codec import ProtocolError

    if not num:
        return [None] * rows
    if len(num) != rows or sum(max(k, 0) for k in num) != len(counts):
        raise ProtocolError("prompt-logprob columns disagree with the rows")
    flat = unpack_logprobs(counts, ids, values)
    out: list[PromptLogprobs | None] = []
    pos = 0
    for k in num:
        if k < 0:
            out.append(None)
        else:
            out.append(flat[pos : pos + k])
            pos += k
    return out


@dataclass(slots=True)
class StepOutputs:
    """scheduler -> one gateway: what one engine step produced for that gateway's requests.

    Per request: ``token_index`` is the output index of its first new token (a reader drops
    duplicates and detects gaps with it); ``num_tokens`` new tokens are concatenated in
    ``token_ids``; logprobs are per token, columnar as in `StepResult`, and ``lp_counts`` is
    empty when no request of the message asked for them. ``queue_time_s`` is the request's time
    from arrival at the scheduler to its first scheduling (vLLM's queue time; the gateway observes
    it), carried once, on the request's first output from that engine: -1 for the others, and
    empty when no request of the message carries it (the common case). ``stop_reason_ids``: on a
    request's last output, the stop token id (of its ``stop_token_ids``) that ended it (vLLM's
    ``stop_reason``); -1 for the others, and empty when no request of the message has one.
    """

    request_ids: list[str] = field(default_factory=list)
    token_index: list[int] = packed("i")
    num_tokens: list[int] = packed("i")
    token_ids: list[int] = packed("i")
    finished: list[bool] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)
    lp_counts: list[int] = packed("i")
    lp_token_ids: list[int] = packed("i")
    lp_values: list[float] = packed("d")
    queue_time_s: list[float] = packed("d")
    stop_reason_ids: list[int] = packed("i")
    plp_num: list[int] = packed("i")
    plp_counts: list[int] = packed("i")
    plp_token_ids: list[int] = packed("i")
    plp_values: list[float] = packed("d")

    def add(
        self,
        request_id: str,
        index: int,
        tokens: list[int],
        logprobs: list[dict[int, float] | None] | None,
        finished: bool = False,
        finish_reason: str | None = None,
        error: str | None = None,
        queue_time_s: float | None = None,
        stop_reason: int | None = None,
        prompt_logprobs: PromptLogprobs | None = None,
    ) -> None:
        """Append one request's tokens (the first at output index ``index``)."""
        self.request_ids.append(request_id)
        self.token_index.append(index)
        self.num_tokens.append(len(tokens))
        self.token_ids.extend(tokens)
        self.finished.append(finished)
        self.finish_reasons.append(finish_reason)
        self.errors.append(error)
        if logprobs and any(lp is not None for lp in logprobs):
            counts, ids, values = pack_logprobs(logprobs)
        else:  # the common case: no logprobs requested
            counts, ids, values = [-1] * len(tokens), [], []
        self.lp_counts.extend(counts)
        self.lp_token_ids.extend(ids)
        self.lp_values.extend(values)
        self.queue_time_s.append(-1.0 if queue_time_s is None else queue_time_s)
        self.stop_reason_ids.append(-1 if stop_reason is None else stop_reason)
        if prompt_logprobs is not None:
            self.plp_num.extend([-1] * (len(self.request_ids) - 1 - len(self.plp_num)))
            counts, ids, values = pack_logprobs(prompt_logprobs)
            self.plp_num.append(len(prompt_logprobs))
            self.plp_counts.extend(counts)
            self.plp_token_ids.extend(ids)
            self.plp_values.extend(values)

    def check_columns(self) -> None:
        """Raise ``ValueError`` unless the columns describe the same requests and tokens: called by
        `common.codec` on every decode, so a malformed message is dead-lettered alone instead of
        failing its whole read (and every request in it) in the gateway."""
        rows = len(self.request_ids)
        if (
            not len(self.token_index)
            == len(self.num_tokens)
            == len(self.finished)
            == len(self.finish_reasons)
            == len(self.errors)
            == rows
        ):
            raise ValueError(f"per-request columns disagree with the {rows} requests")
        # (min(), not a generator: this runs on every decode, over every token of a step)
        if min(self.num_tokens, default=0) < 0 or sum(self.num_tokens) != len(self.token_ids):
            raise ValueError("num_tokens disagrees with token_ids")
        if min(self.token_index, default=0) < 0 or min(self.token_ids, default=0) < 0:
            raise ValueError("token indices and token ids must not be negative")
        for name in ("queue_time_s", "stop_reason_ids", "plp_num"):
            if len(getattr(self, name)) > rows:
                raise ValueError(f"{name} has more entries than requests")
        if self.lp_counts:
            if len(self.lp_counts) != len(self.token_ids):
                raise ValueError("lp_counts disagrees with token_ids")
            unpack_logprobs(self.lp_counts, self.lp_token_ids, self.lp_values)  # ProtocolError if they disagree
        if self.plp_num:
            self.prompt_logprobs()

    def sealed(self) -> StepOutputs:
        """Ready to send: without logprob columns when no request asked for logprobs, and without
        queue times when none is carried."""
        if not self.lp_token_ids:
            self.lp_counts.clear()  # the reader then skips unpacking
        if self.queue_time_s and max(self.queue_time_s) < 0:
            self.queue_time_s.clear()
        if self.stop_reason_ids and max(self.stop_reason_ids) < 0:
            self.stop_reason_ids.clear()
        if self.plp_num:
            self.plp_num.extend([-1] * (len(self.request_ids) - len(self.plp_num)))
        return self

    def prompt_logprobs(self) -> list[PromptLogprobs | None]:
        """Per request, its prompt logprobs (None where not carried)."""
        num = self.plp_num + [-1] * (len(self.request_ids) - len(self.plp_num)) if self.plp_num else []
        return unpack_prompt_logprobs(len(self.request_ids), num, self.plp_counts, self.plp_token_ids, self.plp_values)

    def queue_times(self) -> list[float | None]:
        """``queue_time_s`` per request, None where not carried (all None if the column is absent
        or does not match the requests)."""
        if len(self.queue_time_s) != len(self.request_ids):
            return [None] * len(self.request_ids)
        return [q if q >= 0 else None for q in self.queue_time_s]

    def stop_reasons(self) -> list[int | None]:
        """``stop_reason_ids`` per request: the stop token id that ended it, None where none did
        (all None if the column is absent or does not match the requests)."""
        if len(self.stop_reason_ids) != len(self.request_ids):
            return [None] * len(self.request_ids)
        return [t if t >= 0 else None for t in self.stop_reason_ids]
