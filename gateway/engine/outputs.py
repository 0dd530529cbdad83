"""Engine outputs -> per-request events: duplicates dropped, gaps found, steps read together merged.

The scheduler publishes one `StepOutputs` per step. When this gateway falls behind (a busy CPU,
many streams), one read returns several steps; each request's tokens from all of them become one
`EngineEvent`, hence one journal entry and one SSE chunk, as vLLM's output collector merges the
outputs a slow consumer has not taken yet. The work per event (journal write, detokenization, JSON,
a socket write on each side) is then paid once per read instead of once per step, so the cost of
streaming falls exactly when the CPU is short. The events of one response (its ``n`` choices) read
together go to its journal as one entry. A journal replay (`replay`) delivers the same
events again, so resumed streams number their SSE events as the first gateway did.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from common.codec import INT_BYTES, LOGPROB_ENTRY_BYTES, unpack_logprobs
from common.protocol import MAX_MESSAGE_BYTES, TAKEN_OVER, Names, StepOutputs, encode, row_bytes
from common.redis_errors import REDIS_FAILURES
from common.sampling_params import SamplingParams
from common.transport import Outgoing, Transport
from gateway.engine.handle import EngineEvent, RequestHandle, attempt_of, base_request_id

logger = logging.getLogger("conveyor.gateway")
# A journal write that cannot land in this long gives its events back (`write_ahead`): the reader
# goes on with the other streams.
JOURNAL_WRITE_DEADLINE_S = 5.0

# Steps read together merge into one event, one journal entry: at most this many tokens, a quarter
# of a message with the most logprobs a token can carry (a long resend's pieces, merged whole,
# could pass the message limit).
MAX_EVENT_TOKENS = MAX_MESSAGE_BYTES // 4 // (2 * INT_BYTES + LOGPROB_ENTRY_BYTES * (SamplingParams.MAX_LOGPROBS + 1))


@dataclass(slots=True)
class Routed:
    """What a batch of engine outputs means for this gateway's requests."""

    # (handle, event, output index of the event's first token), in the order first seen
    events: list[tuple[RequestHandle, EngineEvent, int]] = field(default_factory=list)
    syncs: list[RequestHandle] = field(default_factory=list)  # outputs were lost: ask for a resend
    migrate: list[RequestHandle] = field(default_factory=list)  # their engine does not hold them
    taken: list[tuple[RequestHandle, str]] = field(default_factory=list)  # resumed on another gateway (and why)


def _rows(msg: StepOutputs) -> Iterable[tuple[int, str, list[int], list[dict[int, float] | None]]]:
    """(row, engine request id, tokens, logprobs) of each request in one step's outputs."""
    logprobs = unpack_logprobs(msg.lp_counts, msg.lp_token_ids, msg.lp_values) if msg.lp_counts else None
    pos = 0
    for i, engine_request_id in enumerate(msg.request_ids):
        n = msg.num_tokens[i]
        yield i, engine_request_id, msg.token_ids[pos : pos + n], logprobs[pos : pos + n] if logprobs else [None] * n
        pos += n


def route_outputs(msgs: list[StepOutputs], attempts: Mapping[str, RequestHandle]) -> Routed:
    """Events for the requests in ``msgs`` (consecutive steps, in order), one per request.

    Extends each handle's ``output_token_ids`` with the new tokens; ``attempts`` maps engine
    request ids to the handles in flight (finished or unknown ones are skipped).
    """
    routed = Routed()
    pending: dict[int, EngineEvent] = {}  # id(handle) -> its event in this batch
    for msg in msgs:
        queue_times = msg.queue_times()
        stop_reasons = msg.stop_reasons()
        prompt_lps = msg.prompt_logprobs() if msg.plp_num else None
        for i, engine_request_id, tokens, lps in _rows(msg):
            handle = attempts.get(engine_request_id)
            if handle is None or handle.done:
                continue  # aborted, finished, or an earlier attempt of a migrated request
            event = pending.get(id(handle))
            if event is not None and event.finished:
                continue  # nothing follows the end
            if msg.finish_reasons[i] == "unknown":
                if handle not in routed.migrate:
                    routed.migrate.append(handle)
                continue
            if msg.finish_reasons[i] == TAKEN_OVER:
                routed.taken.append((handle, msg.errors[i] or "the stream was resumed on another gateway"))
                continue
            index = msg.token_index[i]
            if index > handle.next_index:
                if handle.sync_from != handle.next_index and handle not in routed.syncs:
                    routed.syncs.append(handle)
                continue
            skip = handle.next_index - index  # duplicates already delivered
            tokens, lps = tokens[skip:], lps[skip:]
            if not tokens and not msg.finished[i]:
                continue  # nothing new (duplicates, or a resend with nothing after its index)
            handle.output_token_ids.extend(tokens)
            if event is None or len(event.token_ids) + len(tokens) > MAX_EVENT_TOKENS:  # a long resend: several events
                event = pending[id(handle)] = EngineEvent(tokens, lps, queue_time_s=queue_times[i])
                routed.events.append((handle, event, handle.next_index - len(tokens)))
            elif tokens:
                event.num_steps += 1
                event.token_ids.extend(tokens)
                event.logprobs.extend(lps)
            if event.queue_time_s is None:
                event.queue_time_s = queue_times[i]
            if prompt_lps is not None and prompt_lps[i] is not None:
                event.prompt_logprobs = prompt_lps[i]
            event.finished = msg.finished[i]
            event.finish_reason = msg.finish_reasons[i]
            event.error = msg.errors[i]
            event.stop_reason = stop_reasons[i]
    return routed


def journal_entry(engine_request_id: str, start: int, event: EngineEvent, entry: StepOutputs | None = None) -> StepOutputs:
    """The journal's copy of one delivered event (what `replay` delivers again): a row added to
    ``entry`` (a new one if None)."""
    entry = StepOutputs() if entry is None else entry
    entry.add(
        engine_request_id,
        start,
        event.token_ids,
        event.logprobs,
        event.finished,
        event.finish_reason,
        event.error,
        stop_reason=event.stop_reason,
        prompt_logprobs=event.prompt_logprobs,
    )
    return entry


def journal_write(names: Names, handle: RequestHandle, event: EngineEvent, start: int, ttl_ms: int) -> Outgoing:
    """The append of ``event`` (its first token at output index ``start``) to ``handle``'s journal."""
    entry = encode(journal_entry(handle.engine_request_id, start, event).sealed())
    return Outgoing(names.journal(handle.journal_id), entry, None, ttl_ms)  # never trimmed (`Names.journal`)


def journal_writes(names: Names, events: list[tuple[RequestHandle, EngineEvent, int]], ttl_ms: int) -> list[Outgoing]:
    """The appends of the events of resumable streams: one entry per journal, a row per event (the
    choices of one response share its journal), in order; a further entry where the rows would
    pass half the message limit (prompt logprobs, a long resend)."""
    entries: dict[str, list[StepOutputs]] = {}
    sizes: dict[str, int] = {}
    for handle, event, start in events:
        if not handle.journal_id:
            continue
        row = row_bytes(event.token_ids, event.logprobs, event.prompt_logprobs)
        pieces = entries.setdefault(handle.journal_id, [StepOutputs()])
        if sizes.get(handle.journal_id, 0) + row > MAX_MESSAGE_BYTES // 2 and pieces[-1].request_ids:
            pieces.append(StepOutputs())
            sizes[handle.journal_id] = 0
        sizes[handle.journal_id] = sizes.get(handle.journal_id, 0) + row
        journal_entry(handle.engine_request_id, start, event, pieces[-1])
    return [
        Outgoing(names.journal(journal_id), encode(piece.sealed()), None, ttl_ms)  # never trimmed (`Names.journal`)
        for journal_id, pieces in entries.items()
        for piece in pieces
    ]


async def write_ahead(
    transport: Transport, names: Names, events: list[tuple[RequestHandle, EngineEvent, int]], ttl_ms: int
) -> list[tuple[RequestHandle, EngineEvent, int]]:
    """Journal the events of resumable streams before their clients see any (no client sees an
    event another gateway could not replay); the events to deliver. When the write fails, the read
    that brought them has moved on: the journaled ones are taken back and owed a resend (the
    watcher asks, `EngineWatch.resend_owed`), as outputs lost on the way are; the rest go on."""
    journal = journal_writes(names, events, ttl_ms)
    if not journal:
        return events
    writing = [h for h, _, _ in events if h.journal_id]
    for handle in writing:  # not moved meanwhile (`EngineWatch.check_routes`): its tokens may be taken back
        handle.journal_writes += 1
    try:
        await transport.send_many(journal, deadline_s=JOURNAL_WRITE_DEADLINE_S)
    except REDIS_FAILURES as exc:
        logger.warning("could not journal %d events (%s); asking for them again", len(journal), exc)
        for handle, _, start in events:
            if handle.journal_id:
                del handle.output_token_ids[start:]
                handle.resend_owed = True
        return [(h, event, start) for h, event, start in events if not h.journal_id]
    finally:
        for handle in writing:
            handle.journal_writes -= 1
    now = time.monotonic()
    for handle in writing:
        handle.journaled_at = now
    return events


def replay(handle: RequestHandle, outputs: list[StepOutputs]) -> list[EngineEvent]:
    """The journaled events of a stream, in order and without duplicates, as first delivered
    (one per journal entry); ends with the end. Extends ``handle.output_token_ids``. Outputs of
    other requests (the other choices of a response, which share its journal) are skipped.

    Entries past a gap are skipped, not stopped at: a killed gateway leaves one (the steps it had
    read but not journaled), the scheduler journals the steps after it as orphans, and the adopter
    replays up to the gap, has the engine resend from there and journals what it streams after
    those orphans. A second adopter must replay the first one's entries too, numbered as it
    delivered them. An entry that repeats only delivered tokens is no event (a late writer's).

    One writer's entries never overlap. Two writers' do when a gateway whose client left (or the
    scheduler, while the stream was orphaned) journals a little more after another gateway read
    the journal to adopt the stream: the adopter then journals what it streams from where its
    replay ended, the start of an event. An entry that starts at an event's start but before the
    end is that later writer's, so its events replace the earlier writer's from there: a stream
    resumed from the adopter's event ids numbers its events as the adopter did. An entry without
    tokens (an engine's error, which it journals at index 0) replaces nothing: it ends the stream.

    Once a request migrated (attempt ``n`` runs as ``<id>~n``), entries of earlier attempts are
    stale: an engine that only looked gone may still journal its attempt as an orphan."""
    events: list[EngineEvent] = []
    starts: list[int] = []  # the output index of each event's first token
    latest = 0  # the latest attempt seen
    for msg in outputs:
        stop_reasons = msg.stop_reasons()
        prompt_lps = msg.prompt_logprobs() if msg.plp_num else [None] * len(msg.request_ids)
        for i, engine_request_id, tokens, lps in _rows(msg):
            if base_request_id(engine_request_id) != handle.request_id:
                continue
            attempt = attempt_of(engine_request_id)
            if attempt < latest:
                continue
            latest = attempt
            index = msg.token_index[i]
            if index < handle.next_index and index in starts and tokens:  # a later writer (see above)
                k = starts.index(index)
                del events[k:], starts[k:], handle.output_token_ids[index:]
            elif events and events[-1].finished:
                continue  # nothing follows the end but a later writer's entries
            if index > handle.next_index:
                continue  # past a gap (see above)
            skip = handle.next_index - index
            tokens, lps = tokens[skip:], lps[skip:]
            if not tokens and not msg.finished[i]:
                continue
            starts.append(handle.next_index)
            handle.output_token_ids.extend(tokens)
            event = EngineEvent(
                tokens,
                lps,
                msg.finished[i],
                msg.finish_reasons[i],
                msg.errors[i],
                stop_reason=stop_reasons[i],
                replayed=True,
                prompt_logprobs=prompt_lps[i],
            )
            events.append(event)
    return events
