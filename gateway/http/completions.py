"""The one request path of ``/v1/completions`` and ``/v1/chat/completions``: prompts in, one or
several choices out, whole or streamed, and ``GET /v1/streams/{id}``, which resumes a stream.

Every choice is a request of its own in the engine (`Generation`), so every one is tracked,
migrated and aborted by the `EngineClient` like any request (vLLM fans out the same way:
`common.parallel_sampling`); a response of one choice is the case k = 1, with the engine request
id of the response itself. The children of one prompt share a ``group_id`` and go to the engine
the first one went to, where the scheduler makes them share the prompt's KV blocks. Choice
indices follow vLLM: prompt ``i``, sample ``j`` -> ``i * n + j``; with ``best_of`` the ``n``
children with the highest cumulative logprob are returned (best first). ``usage`` counts every
prompt once and every generated token, the discarded candidates' too (as OpenAI bills
``best_of``), so it agrees with ``vllm:generation_tokens``.

Streaming interleaves the choices' chunks as their tokens arrive, each with its ``index`` and
each ending with its ``finish_reason``; a final usage chunk covers them all. With ``echo`` and
logprobs, each choice's echo chunk carries its prompt's logprobs, which child 0 computed
(`gateway.output.streaming.SharedPromptLogprobs`). A stream is journaled (all its choices
in one journal: `gateway.engine.journal`) and ``GET /v1/streams/{id}`` resumes it (`resume`)
with event ids that count each choice's events (`gateway.output.streaming.ChoiceCursor`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from common.parallel_sampling import child_params, cumulative_logprob, num_children, ranks_by_logprob, select_best
from common.protocol import EngineStatus, JournalHeader, encode
from common.sampling_params import sampling_to_dict, wire_size
from common.transport import Outgoing
from gateway.engine.client import EngineClient, RequestIdInUse
from gateway.engine.journal import Journal, journal_body, journaled_spec, stream_not_found
from gateway.http.errors import ApiError
from gateway.http.metrics import GatewayMetrics
from gateway.http.tenants import ANONYMOUS, Tenant
from gateway.openai.input_workers import InputWorkers
from gateway.openai.schema import ChatParsers, GenerationSpec
from gateway.openai.tokenization import echo_text, prepare_prompt, resolve_bad_words, tokenizes_inline
from gateway.output.generation import Generation, Piece, RequestLog, SequenceRequest
from gateway.output.responses import ResponseFormatter
from gateway.output.streaming import ChoiceCursor, stream_choices


@dataclass(slots=True)
class ServeContext:
    """What serving a completion request needs from the app."""

    client: EngineClient
    tokenizer: Any
    lock: threading.Lock
    workers: InputWorkers
    metrics: GatewayMetrics
    info: EngineStatus
    model: str  # the served name
    max_inflight: int
    parsers: ChatParsers = ChatParsers()  # of free-form chat output (journaled with the stream)
    tenant: Tenant = ANONYMOUS  # the request's: its journal is named by `Tenant.scope` of the response id


@dataclass(slots=True)
class _Prompt:
    ids: list[int]
    echo: str | None


async def _prompts(ctx: ServeContext, spec: GenerationSpec) -> tuple[list[_Prompt], list[int]]:
    """Each prompt's token ids and echo text, and its ``max_tokens`` (400s as for one prompt)."""
    items: list[Any] = spec.prompts if spec.prompts is not None else [None]
    out: list[_Prompt] = []
    budgets: list[int] = []
    inline = tokenizes_inline(spec, ctx.tokenizer)  # the whole request's size: all its prompts
    for item in items:
        sub = spec
        if item is not None:
            text, ids = (item, None) if isinstance(item, str) else (None, item)
            sub = dataclasses.replace(spec, prompt=text, prompt_token_ids=ids, prompts=None)
        prompt_ids, text, max_tokens = await prepare_prompt(ctx.workers, ctx.tokenizer, ctx.lock, sub, ctx.info, inline)
        out.append(_Prompt(prompt_ids, echo_text(spec, text, prompt_ids, ctx.tokenizer)))
        budgets.append(max_tokens)
    return out, budgets


# What one request's sequences may carry of sampling parameters in all: each is a request of its
# own to the engine, which decodes, sizes and checks every copy between steps, so a large
# parameter (a long allowed_token_ids list) multiplied by n is bounded here, while plain
# parameters of thousands of sequences stay far below it.
MAX_FANOUT_SAMPLING_BYTES = 4 << 20


async def serve(
    ctx: ServeContext,
    request: Request,
    spec: GenerationSpec,
    ids: tuple[str, str, bool],
    body: dict[str, Any],
    arrival: float,
) -> dict[str, Any] | AsyncIterator[str]:
    """Run every child; a response body, or (streaming) the SSE events. ``ids``: the response id,
    the engine id, and whether the client chose the response id (a stream's journal claims it)."""
    response_id, engine_id, client_chose = ids
    prompts, budgets = await _prompts(ctx, spec)
    k = num_children(spec.sampling)
    sequences = k * len(prompts)
    if len(ctx.client.requests) + sequences > ctx.max_inflight:
        raise ApiError(
            429,
            f"too many requests in flight ({ctx.max_inflight}; this one needs {sequences}); retry shortly",
            "rate_limit_error",
            code="too_many_requests",
        )
    # (one sequence carries its parameters once, as any request: the limit is on their copies)
    if sequences > 1 and (size := wire_size(spec.sampling) * sequences) > MAX_FANOUT_SAMPLING_BYTES:
        raise ApiError(
            400,
            f"this request's {sequences} sequences would carry {size} bytes of sampling parameters "
            f"(allowed_token_ids, bad_words, a grammar...), over {MAX_FANOUT_SAMPLING_BYTES}: send fewer prompts, "
            "a smaller n or best_of, or shorter lists",
            param="n",
        )
    gens: list[list[Generation]] = []
    for i, (prompt, max_tokens) in enumerate(zip(prompts, budgets)):
        sampling = dataclasses.replace(spec.sampling, max_tokens=max_tokens)
        try:  # (in full once: the prompts differ only in max_tokens, and a long list takes ms)
            if i == 0:
                sampling.validate(ctx.info.vocab_size)
            else:
                sampling.validate_lengths()
        except ValueError as exc:
            raise ApiError(400, str(exc), param=str(exc).split(" ", 1)[0]) from None
        gens.append(
            [
                _generation(
                    ctx,
                    spec,
                    SequenceRequest(
                        engine_id if sequences == 1 else f"{engine_id}-{i}-{j}",
                        prompt.ids,
                        child_params(sampling, j),
                        spec.priority,
                        spec.cache_salt,
                    ),
                    response_id,
                    arrival,
                )
                for j in range(k)
            ]
        )
    num_prompt_tokens = sum(len(p.ids) for p in prompts)
    # (a chat's one prompt: its token ids go on the response, with return_token_ids)
    envelope = ResponseFormatter(spec, response_id, ctx.model, ctx.tokenizer, num_prompt_tokens, None, 0, prompts[0].ids)
    journal = _journal_headers(ctx, spec, body, response_id, envelope.created, prompts, budgets, gens) if spec.stream else []
    journal_id = ctx.tenant.scope(response_id) if spec.stream else ""
    await _start(gens, [f"{engine_id}-{i}" for i in range(len(gens))], journal_id, journal, client_chose)
    n = spec.sampling.n
    if spec.stream:
        formatters = [
            _formatter(spec, response_id, ctx, prompt, i * n + j, envelope.created)
            for i, prompt in enumerate(prompts)
            for j in range(k)
        ]
        return stream_choices([g for group in gens for g in group], formatters, envelope, k)
    pieces = await _collect(request, [g for group in gens for g in group])
    choices: list[dict[str, Any]] = []
    completion_tokens = 0
    for i, (prompt, group) in enumerate(zip(prompts, gens)):
        mine = pieces[i * k : (i + 1) * k]
        ranked = list(range(k))
        if ranks_by_logprob(spec.sampling):
            totals = [
                cumulative_logprob([t for p in ps for t in p.token_ids], [e for p in ps for e in p.logprobs]) for ps in mine
            ]
            ranked = select_best(totals, n)
        for rank, child in enumerate(ranked):
            fmt = _formatter(spec, response_id, ctx, prompt, i * n + rank, envelope.created)
            choices.append(fmt.choice(_with_prompt_logprobs(mine[child], mine[0])))
        completion_tokens += sum(g.num_completion_tokens for g in group)
    return envelope.response(choices, completion_tokens)


def _journal_headers(
    ctx: ServeContext,
    spec: GenerationSpec,
    body: dict[str, Any],
    response_id: str,
    created: int,
    prompts: list[_Prompt],
    budgets: list[int],
    gens: list[list[Generation]],
) -> list[Outgoing]:
    """A stream's journal headers, one per prompt naming its choices (`gateway.engine.journal`)."""
    return [
        Outgoing(
            ctx.client.names.journal(ctx.tenant.scope(response_id)),
            encode(
                JournalHeader(
                    response_id,
                    spec.kind,
                    journal_body(body, spec.kind) if i == 0 else "",  # the parameters, once
                    ctx.model,
                    created,
                    max_tokens,
                    prompt.ids,
                    prompt.echo,
                    [g.request_id for g in group],
                    ctx.parsers.tools or "",
                    ctx.parsers.reasoning or "",
                    spec.reasoning_phase,
                )
            ),
            None,
            ctx.client.journal_ttl_ms,
        )
        for i, (prompt, max_tokens, group) in enumerate(zip(prompts, budgets, gens))
    ]


def _generation(
    ctx: ServeContext, spec: GenerationSpec, request: SequenceRequest, response_id: str, arrival: float | None = None
) -> Generation:
    """The `Generation` of one sequence of a response (``arrival``: when this gateway got the
    request; None for a stream resumed here, whose times began on another gateway)."""
    metrics = ctx.metrics.request(ctx.model, len(request.prompt_token_ids), arrival)
    log = RequestLog(response_id, ctx.model, spec.kind, spec.stream, arrival)
    return Generation(ctx.client, ctx.tokenizer, request, metrics, log)


def _formatter(
    spec: GenerationSpec, response_id: str, ctx: ServeContext, prompt: _Prompt, index: int, created: int
) -> ResponseFormatter:
    fmt = ResponseFormatter(spec, response_id, ctx.model, ctx.tokenizer, len(prompt.ids), prompt.echo, index, prompt.ids)
    fmt.created = created
    return fmt


def _with_prompt_logprobs(pieces: list[Piece], first_child: list[Piece]) -> list[Piece]:
    """Only a prompt's child 0 computes its prompt logprobs; every choice of the prompt shows them."""
    shared = next((p.prompt_logprobs for p in first_child if p.prompt_logprobs is not None), None)
    if shared is None or not pieces or any(p.prompt_logprobs is not None for p in pieces):
        return pieces
    return [dataclasses.replace(pieces[0], prompt_logprobs=shared), *pieces[1:]]


async def _start(
    gens: list[list[Generation]], group_ids: list[str], journal_id: str, journal: list[Outgoing], claim: bool
) -> None:
    """Submit every child: a prompt's first, then its siblings to the same engine (together).
    A stream's children share the journal ``journal_id``, whose headers (``journal``) go with the
    first child, the first of them as a claim when ``claim`` (`EngineClient.submit`). If any child
    cannot start, those started are aborted, the journal is deleted and the error is raised."""
    started: list[Generation] = []
    try:
        for n, (group, group_id) in enumerate(zip(gens, group_ids)):
            first = group[0]
            if len(group) == 1:
                group_id = ""
            if n == 0 and journal_id:
                await first.start(journal_id, journal[1:] if claim else journal, journal[0] if claim else None, group_id)
            else:
                await first.start(journal_id, group_id=group_id)
            started.append(first)
            engine = first.handle.scheduler_id if first.handle is not None else ""
            rest = group[1:]
            results = await asyncio.gather(
                *(g.start(journal_id, group_id=group_id, prefer_engine=engine) for g in rest), return_exceptions=True
            )
            started.extend(g for g, r in zip(rest, results) if r is None)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
    except BaseException:
        for g in started:
            g.client.abort(g.request_id)
        if started and journal_id:  # the stream never started: its id is free again
            t = started[0].client.transport
            with contextlib.suppress(Exception):
                await t.call(t.redis.delete, journal[0].stream, deadline_s=2)
        raise


async def _collect(request: Request, gens: list[Generation]) -> list[list[Piece]]:
    """Every child's pieces; a client that hangs up aborts them all (499)."""
    pieces: list[list[Piece]] = [[] for _ in gens]

    async def run(i: int) -> None:
        async for piece in gens[i].pieces():
            pieces[i].append(piece)

    tasks = [asyncio.create_task(run(i)) for i in range(len(gens))]
    try:
        while not all(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=0.25, return_when=asyncio.FIRST_EXCEPTION)
            if any(t.done() and not t.cancelled() and t.exception() is not None for t in tasks):
                break
            if not all(t.done() for t in tasks) and await request.is_disconnected():
                raise ApiError(499, "client disconnected")
        for t in tasks:
            if t.done():
                t.result()  # the first error, as for one choice
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
    return pieces


async def resume(ctx: ServeContext, response_id: str, journal: Journal, last_event_id: str) -> AsyncIterator[str]:
    """Resume a stream from its ``journal`` (`gateway.engine.journal.read_journal`): every choice's
    request is adopted (`EngineClient.adopt`: its journaled outputs first, then live), and the
    events the client has (``Last-Event-ID``, `ChoiceCursor`) are skipped."""
    ids = [rid for header in journal.headers for rid in header.choice_ids]
    if not ids or any(rid not in journal.routes for rid in ids):
        raise stream_not_found(response_id)
    seen = ChoiceCursor.parse(last_event_id, len(ids))
    first = journal.headers[0]
    spec = journaled_spec(first)
    await resolve_bad_words(ctx.workers, ctx.tokenizer, ctx.lock, spec)
    k = len(first.choice_ids)
    gens: list[Generation] = []
    formatters: list[ResponseFormatter] = []
    try:
        if any(rid in ctx.client.requests for rid in ids):
            raise RequestIdInUse(f"stream {response_id!r} is already being served by this gateway")
        for i, header in enumerate(journal.headers):
            prompt = _Prompt(header.prompt_token_ids, header.echo_text)
            sampling = dataclasses.replace(spec.sampling, max_tokens=header.max_tokens)
            for j, rid in enumerate(header.choice_ids):
                child = child_params(sampling, j)
                handle = await ctx.client.adopt(
                    ctx.tenant.scope(response_id),
                    prompt.ids,
                    sampling_to_dict(child),
                    journal.routes[rid],
                    journal.outputs,
                    spec.priority,
                    spec.cache_salt,
                )
                gen = _generation(
                    ctx, spec, SequenceRequest(handle.request_id, prompt.ids, child, spec.priority, spec.cache_salt), response_id
                )
                gen.handle = handle
                gens.append(gen)
                formatters.append(_formatter(spec, response_id, ctx, prompt, i * k + j, first.created))
    except BaseException as exc:
        for g in gens:
            ctx.client.abort(g.request_id)
        if isinstance(exc, RequestIdInUse):
            raise ApiError(409, str(exc), code="stream_in_use") from None
        raise
    num_prompt_tokens = sum(len(h.prompt_token_ids) for h in journal.headers)
    envelope = ResponseFormatter(spec, response_id, ctx.model, ctx.tokenizer, num_prompt_tokens, None, 0, first.prompt_token_ids)
    envelope.created = first.created
    return stream_choices(gens, formatters, envelope, k, seen)
