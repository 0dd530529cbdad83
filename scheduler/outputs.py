"""`OutputRouter`: where each request's output tokens go, and what happens when a gateway dies.

Every request is owned by the gateway that submitted it, and its outputs go to that gateway's
stream, one `StepOutputs` per gateway per step. When a gateway's heartbeat expires, a resumable
request (a streaming response with a journal) is *orphaned*: it keeps generating and its outputs
are appended to its journal, where the gateway that resumes the stream reads them, until a
`SyncRequest` adopts it or the resume window ends (then it is aborted). A request that cannot be
resumed is aborted at once: nobody is left to read it.

Pure bookkeeping: it returns the messages to send (`Outgoing`) and the requests to abort; the
service sends and aborts. Changed by the engine thread alone (the watcher thread only reads `gateways`).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.codec import INT_BYTES, LOGPROB_ENTRY_BYTES
from common.protocol import OUTPUTS_MAXLEN, OUTPUTS_TTL_MS, TAKEN_OVER, Names, StepOutputs, encode, row_bytes
from common.transport import Outgoing
from scheduler.request import Request, StepOutput


@dataclass(slots=True)
class _Route:
    gateway_id: str  # "" while orphaned
    journal_id: str  # "" when the request cannot be resumed
    orphaned_until: float = 0.0
    orphaned_from: str = ""  # the gateway that was declared dead (it may only have been late)
    queue_time_sent: bool = False  # the request's queue time went out (with its first output)


class OutputRouter:
    """Per request: its gateway, its journal, and the orphan deadline."""

    def __init__(self, names: Names, resume_window_s: float, max_message_bytes: int) -> None:
        self.names = names
        self.resume_window_s = resume_window_s
        self.max_message_bytes = max_message_bytes
        self.routes: dict[str, _Route] = {}

    def add(self, request_id: str, gateway_id: str, journal_id: str) -> None:
        self.routes[request_id] = _Route(gateway_id, journal_id)

    def forget(self, request_id: str) -> None:
        self.routes.pop(request_id, None)

    def gateways(self) -> tuple[set[str], set[str]]:
        """The gateways that own requests, and those declared dead that orphans came from."""
        routes = list(self.routes.values())  # a copy: the watcher thread calls this
        return {r.gateway_id for r in routes if r.gateway_id}, {r.orphaned_from for r in routes if not r.gateway_id}

    def may_abort(self, request_id: str, gateway_id: str) -> bool:
        """Whether ``gateway_id`` ("": anyone) may abort ``request_id``: not once another gateway
        adopted it (the client hung up on the first gateway, then resumed on that one)."""
        route = self.routes.get(request_id)
        return not gateway_id or route is None or route.gateway_id in ("", gateway_id)

    def orphans_of(self, gateway_id: str) -> list[str]:
        return [r for r, route in self.routes.items() if not route.gateway_id and route.orphaned_from == gateway_id]

    def _out(self, stream: str, msg: StepOutputs, ttl_ms: int) -> Outgoing:
        maxlen = None if self._is_journal(stream) else OUTPUTS_MAXLEN  # a journal is never trimmed (`Names.journal`)
        return Outgoing(stream, encode(msg.sealed(), self.max_message_bytes), maxlen, ttl_ms)

    def _is_journal(self, stream: str) -> bool:
        return self.names.is_journal(stream)

    # -- outputs --------------------------------------------------------------------------------
    def route(self, outputs: list[StepOutput]) -> list[Outgoing]:
        """One message per gateway (and per orphan's journal) for one step's outputs; more where
        one would pass half the message limit (prompt logprobs: `scheduler.step_bytes`)."""
        by_stream: dict[str, StepOutputs] = {}
        sizes: dict[str, int] = {}  # about each message's bytes of prompt logprobs (`row_bytes`)
        sends: list[Outgoing] = []
        for out in outputs:
            route = self.routes.get(out.request_id)
            if route is None:
                continue
            stream = self.names.outputs(route.gateway_id) if route.gateway_id else self.names.journal(route.journal_id)
            queue_time_s = None
            if not route.queue_time_sent and out.queue_time_s is not None:  # once: it is a per-request metric
                queue_time_s, route.queue_time_sent = out.queue_time_s, True
            if out.prompt_logprobs is not None:
                # The one row a step's output can make big: the others (a token, with at most 21
                # logprobs) take a few hundred bytes each, a few hundred KB for a whole batch.
                row = row_bytes(out.new_token_ids, out.new_logprobs, out.prompt_logprobs)
                self._make_room(by_stream, sizes, stream, row, sends)
            msg = by_stream.setdefault(stream, StepOutputs())
            msg.add(
                out.request_id,
                out.num_output_tokens - len(out.new_token_ids),
                out.new_token_ids,
                out.new_logprobs,
                out.finished,
                out.finish_reason,
                queue_time_s=queue_time_s,
                stop_reason=out.stop_reason,
                prompt_logprobs=out.prompt_logprobs,
            )
            if out.finished:
                del self.routes[out.request_id]
        return sends + [self._out(stream, msg, self._ttl_ms(stream)) for stream, msg in by_stream.items()]

    def _make_room(
        self, by_stream: dict[str, StepOutputs], sizes: dict[str, int], stream: str, row: int, sends: list[Outgoing]
    ) -> None:
        """Count a row of ``row`` bytes into ``stream``'s message (``sizes``), sending the message
        first if the row would take it past half the limit (a row alone fits: `step_bytes.check_fits`)."""
        size = sizes.get(stream, 0)
        if size + row > self.max_message_bytes // 2 and stream in by_stream:
            sends.append(self._out(stream, by_stream.pop(stream), self._ttl_ms(stream)))
            size = 0
        sizes[stream] = size + row

    def _ttl_ms(self, stream: str) -> int:
        # A journal lives as long as its stream may still be resumed; an outputs stream a while longer.
        return int(self.resume_window_s * 1000) if self._is_journal(stream) else OUTPUTS_TTL_MS

    def errors(self, request_ids: list[str], error: str, reason: str = "error") -> list[Outgoing]:
        """Final error outputs for these requests (which are forgotten)."""
        by_stream: dict[str, StepOutputs] = {}
        for request_id in request_ids:
            route = self.routes.pop(request_id, None)
            if route is None:
                continue
            if route.gateway_id:
                stream = self.names.outputs(route.gateway_id)
            else:
                stream = self.names.journal(route.journal_id)
            by_stream.setdefault(stream, StepOutputs()).add(request_id, 0, [], None, True, reason, error)
        return [self._out(stream, msg, self._ttl_ms(stream)) for stream, msg in by_stream.items()]

    def reject(self, request_id: str, gateway_id: str, error: str) -> Outgoing:
        """The answer to a request that was never admitted (bad parameters: an HTTP 400)."""
        msg = StepOutputs()
        msg.add(request_id, 0, [], None, True, "rejected", error)
        return self._out(self.names.outputs(gateway_id), msg, OUTPUTS_TTL_MS)

    # -- gateways come and go -------------------------------------------------------------------
    def adopt(self, request: Request | None, request_id: str, gateway_id: str, from_index: int) -> list[Outgoing]:
        """Route ``request_id`` to ``gateway_id`` and resend its tokens from ``from_index``. A
        gateway that served it until now (its client reconnected elsewhere while this one still
        held the stream) is told `TAKEN_OVER`, or its copy would wait for outputs forever.

        ``request`` None: not held here (finished, or never arrived); the answer says ``unknown``.
        """
        stream = self.names.outputs(gateway_id)
        by_stream, sizes = {stream: StepOutputs()}, {stream: 0}
        sends: list[Outgoing] = []
        if request is None or request_id not in self.routes:
            by_stream[stream].add(request_id, 0, [], None, True, "unknown", "the scheduler does not hold this request")
        else:
            route = self.routes[request_id]
            if route.gateway_id not in ("", gateway_id):
                notice = StepOutputs()
                notice.add(request_id, 0, [], None, True, TAKEN_OVER, f"the stream was resumed on gateway {gateway_id}")
                sends.append(self._out(self.names.outputs(route.gateway_id), notice, OUTPUTS_TTL_MS))
            route.gateway_id, route.orphaned_until = gateway_id, 0.0
            start = max(0, min(from_index, request.num_output_tokens))
            # A resend from the start brings the prompt's logprobs again: the gateway may have lost them.
            plp = [None, *request.prompt_logprobs] if start == 0 and request.prompt_logprobs_sent else None
            # In pieces of a quarter message, over several messages: a long generation's logprobs can pass the limit.
            lps = request.sampling_params.logprobs
            per_token = INT_BYTES + (INT_BYTES + LOGPROB_ENTRY_BYTES * (lps + 1) if lps is not None else 0)
            piece = max(1, self.max_message_bytes // 4 // per_token)
            for i in range(start, max(start + 1, request.num_output_tokens), piece):
                tokens, logprobs = request.output_token_ids[i : i + piece], request.output_logprobs[i : i + piece]
                first = plp if i == start else None
                self._make_room(by_stream, sizes, stream, row_bytes(tokens, logprobs, first), sends)
                msg = by_stream.setdefault(stream, StepOutputs())
                msg.add(request_id, i, tokens, logprobs, False, None, None, prompt_logprobs=first)
        sends.extend(self._out(stream, msg, OUTPUTS_TTL_MS) for msg in by_stream.values())
        return sends

    def gateway_died(self, gateway_id: str, now: float) -> list[str]:
        """Orphan the resumable requests of ``gateway_id``; returns the others (to abort)."""
        doomed: list[str] = []
        for request_id, route in self.routes.items():
            if route.gateway_id != gateway_id:
                continue
            if route.journal_id:
                route.gateway_id, route.orphaned_from = "", gateway_id
                route.orphaned_until = now + self.resume_window_s
            else:
                doomed.append(request_id)
        return doomed

    def expired_orphans(self, now: float) -> list[str]:
        """Orphans nobody resumed within the window (to abort)."""
        return [r for r, route in self.routes.items() if not route.gateway_id and route.orphaned_until < now]
