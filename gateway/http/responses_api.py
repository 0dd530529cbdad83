"""The Responses API: ``POST /v1/responses`` (whole, streamed with typed events, or in the
background), ``GET``/``DELETE /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``.

A response is a chat completion underneath: its body is mapped to a chat request
(`gateway.responses.request`) and served by the one request path (`gateway.http.completions.serve`,
through the app's ``generate``), and its output is reshaped (`gateway.responses.objects`,
`gateway.responses.events`). Stored responses live in Redis (`gateway.responses.store`).

A background response runs as a task of the gateway that accepted it, which holds its lease; it
does not survive that gateway: once the lease lapses (`RESPONSE_LEASE_MS`), a GET on any gateway
reports it "failed". A cancel marks it "cancelled" in the store; the running gateway sees that
at its next lease refresh (at once if it runs here) and stops the generation.

A background response created with ``stream: true`` runs as a chat stream: the running gateway
appends its typed events to a Redis stream (`ResponseStore.append_events`) as they come, and the
creating request, like ``GET /v1/responses/{id}?stream=true&starting_after=N`` on any gateway
(its owner's key only: another's gets 404), replays them from there (`replay`): those after
sequence number N, then the live ones, until the response's last event. One whose gateway died
ends with ``response.failed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from common.protocol import MAX_STORED_RESPONSE_BYTES, RESPONSE_LEASE_MS
from gateway.http.errors import ApiError, bad
from gateway.http.tenants import Tenant, request_tenant
from gateway.openai.json_input import json_size, preview
from gateway.openai.schema import GenerationSpec
from gateway.output.responses import EventStreamResponse
from gateway.responses.events import ResponseEvents, chat_chunks, typed_sse
from gateway.responses.objects import ResponseShell, history_messages, new_response_id
from gateway.responses.request import ResponsesRequest, parse_responses
from gateway.responses.store import RUNNING, ResponseStore, StoredResponse

logger = logging.getLogger("conveyor.gateway")

# The events that end a response's stream.
_LAST_EVENTS = ("response.completed", "response.incomplete", "response.failed")
# How long a replay waits for the next event before it looks whether the response still runs.
_REPLAY_WAIT_MS = 1_000

# ``generate(request, spec, body, response_id)``: the served model's name, and the chat body or its SSE events.
Generate = Callable[[Request, GenerationSpec, dict[str, Any], str], Awaitable[tuple[str, dict[str, Any] | AsyncIterator[str]]]]


@dataclass(slots=True)
class ResponsesDeps:
    """What the Responses routes take from the app."""

    check_key: Callable[[Request], Tenant]  # a 401 for a wrong key; the request's tenant, who owns what it stores
    read_body: Callable[[Request], Awaitable[Any]]
    parse_chat: Callable[[dict[str, Any]], GenerationSpec]
    served: Callable[[str | None], str]  # the served model's name, a 404 for another model's (or a 503)
    generate: Generate
    store: ResponseStore
    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)  # background responses run here


class _Detached:
    """The HTTP request a background response runs under: its client has gone, by design; its
    tenant is the accepting request's (`gateway.http.tenants.request_tenant` reads it)."""

    def __init__(self, tenant: Tenant) -> None:
        self.state = SimpleNamespace(tenant=tenant)

    async def is_disconnected(self) -> bool:
        return False


def _event_stream(events: AsyncIterator[str], response_id: str) -> EventStreamResponse:
    return EventStreamResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": response_id},
    )


def not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id {preview(response_id)} not found.", "not_found_error", "response_id", "not_found")


def add_responses_routes(app: FastAPI, deps: ResponsesDeps) -> None:
    """Register the Responses API's routes on ``app``."""
    store = deps.store

    async def history_of(req: ResponsesRequest, owner: str) -> list[dict[str, Any]]:
        if req.previous_response_id is None:
            return []
        stored = await store.load(req.previous_response_id, owner)
        if stored is None:
            raise not_found(req.previous_response_id)
        if stored.status in ("queued", "in_progress"):
            raise bad(f"response {preview(req.previous_response_id)} is still {stored.status}", "previous_response_id")
        return stored.history

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        tenant = deps.check_key(request)
        req = parse_responses(await deps.read_body(request))
        owner = tenant.id
        history = await history_of(req, owner)
        chat = req.chat_body(history)
        if req.store and json_size(chat["messages"]) > MAX_STORED_RESPONSE_BYTES:
            raise bad(
                f"this conversation is over {MAX_STORED_RESPONSE_BYTES} bytes, too long to store: send store: false", "store"
            )
        spec = deps.parse_chat(chat)
        response_id = new_response_id()
        request.state.response_id = response_id
        turn = [*history, *req.messages]
        if req.background:
            return await start_background(request, req, spec, chat, response_id, owner, turn)
        model, out = await deps.generate(request, spec, chat, response_id)
        shell = ResponseShell(response_id, int(time.time()), model, req)
        headers = {"X-Request-Id": response_id}
        if isinstance(out, dict):
            shell.created_at = out.get("created", shell.created_at)
            body = shell.from_chat(out)
            if req.store:
                await store.save(body, [*turn, *history_messages(body["output"])], owner)
            return JSONResponse(body, headers=headers)
        return _event_stream(stream(shell, out, turn, owner), response_id)

    async def stream(
        shell: ResponseShell, chunks: AsyncIterator[str], turn: list[dict[str, Any]], owner: str
    ) -> AsyncIterator[str]:
        """The typed events of a chat stream; the response is stored before its last event."""
        events = ResponseEvents(shell)
        yield "".join(typed_sse(e) for e in events.start())
        try:
            async for item in chunks:
                out = [e for chunk in chat_chunks(item) for e in events.feed(chunk)]
                if events.final is not None:  # failed
                    break
                if out:
                    yield "".join(typed_sse(e) for e in out)
            else:
                out = events.finish()
        finally:
            with contextlib.suppress(Exception):
                await cast(Any, chunks).aclose()
        final = events.final
        assert final is not None
        if shell.request.store:
            try:
                await store.save(final, [*turn, *history_messages(final["output"])], owner)
            except Exception:  # the client still gets its response; a GET will not find it
                logger.exception("could not store response %s", shell.response_id)
        yield "".join(typed_sse(e) for e in out)

    async def start_background(
        request: Request,
        req: ResponsesRequest,
        spec: GenerationSpec,
        chat: dict[str, Any],
        response_id: str,
        owner: str,
        turn: list[dict[str, Any]],
    ) -> Response:
        shell = ResponseShell(response_id, int(time.time()), deps.served(spec.model), req)
        queued = shell.object("queued", [])
        tenant = request_tenant(request)
        await store.hold(response_id, RESPONSE_LEASE_MS)
        await store.save(queued, turn, owner)
        events = ResponseEvents(shell) if req.stream else None
        if events is not None:
            await store.append_events(response_id, events.start())

        async def run() -> None:
            work = asyncio.create_task(generate())
            try:
                while not work.done():
                    await asyncio.wait([work], timeout=RESPONSE_LEASE_MS / 3000)
                    if not work.done() and await refresh() in ("cancelled", "gone"):
                        work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
            except asyncio.CancelledError:
                work.cancel()
                raise
            finally:
                deps.tasks.pop(response_id, None)
                with contextlib.suppress(Exception):
                    await store.release(response_id)

        async def refresh() -> str:
            """Hold the lease on; the stored status ("" if Redis failed: a lapsed lease then reads as failed)."""
            try:
                return await store.hold(response_id, RESPONSE_LEASE_MS) or "gone"
            except Exception as exc:
                logger.warning("could not refresh the lease of background response %s: %s", response_id, exc)
                return ""

        async def generate() -> None:
            try:
                await store.save(shell.object("in_progress", []), turn, owner, unless_cancelled=True)
                model, out = await deps.generate(cast(Request, _Detached(tenant)), spec, chat, response_id)
                shell.model = model
                if isinstance(out, dict):
                    body, last = shell.from_chat(out), list[dict[str, Any]]()
                else:
                    assert events is not None
                    body, last = await record(events, out)
                await store.save(body, [*turn, *history_messages(body["output"])], owner, unless_cancelled=True)
                await store.append_events(response_id, last)  # (once stored: a GET after the last event finds it)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                error = (
                    exc.body()["error"] if isinstance(exc, ApiError) else {"code": "server_error", "message": "internal error"}
                )
                if not isinstance(exc, ApiError):
                    logger.exception("background response %s failed", response_id)
                failed = shell.object(
                    "failed", [], error={"code": error.get("code") or error["type"], "message": error["message"]}
                )
                with contextlib.suppress(Exception):
                    await store.save(failed, turn, owner, unless_cancelled=True)

        async def record(events: ResponseEvents, chunks: AsyncIterator[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
            """Append a chat stream's events as they come but the last ones; the final response
            and those last events."""
            try:
                async for item in chunks:
                    out = [e for chunk in chat_chunks(item) for e in events.feed(chunk)]
                    if events.final is not None:  # failed
                        return events.final, out
                    await store.append_events(response_id, out)
            finally:
                with contextlib.suppress(Exception):
                    await cast(Any, chunks).aclose()
            last = events.finish()
            assert events.final is not None
            return events.final, last

        deps.tasks[response_id] = asyncio.create_task(run())
        if events is None:
            return JSONResponse(queued, headers={"X-Request-Id": response_id})
        return _event_stream(replay(response_id, owner, -1), response_id)

    async def replay(response_id: str, owner: str, after: int) -> AsyncIterator[str]:
        """A background response's typed events after sequence number ``after``, as they come,
        until its last event (or until it ended without one: a gateway that died)."""
        cursor, sequence = b"0-0", -1
        while True:
            found: StoredResponse | None = None
            entries = await store.read_events(response_id, cursor, _REPLAY_WAIT_MS)
            running = bool(entries)
            if not entries:
                found = await store.load(response_id, owner)
                running = found is not None and found.status in RUNNING
                if not running:  # (its last events may have come meanwhile)
                    entries = await store.read_events(response_id, cursor, None)
            for entry_id, event in entries:
                cursor, sequence = entry_id, event["sequence_number"]
                if sequence > after:
                    yield typed_sse(event)
                if event["type"] in _LAST_EVENTS:
                    return
            if not running:
                if found is not None and found.status == "failed" and sequence >= after:
                    yield typed_sse({"type": "response.failed", "sequence_number": sequence + 1, "response": found.response})
                return

    async def stored(request: Request, response_id: str) -> StoredResponse:
        found = await store.load(response_id, deps.check_key(request).id)
        if found is None:
            raise not_found(response_id)
        return found

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(request: Request, response_id: str) -> Response:
        found = await stored(request, response_id)
        if request.query_params.get("stream", "false").lower() not in ("true", "1"):
            return JSONResponse(found.response)
        raw = request.query_params.get("starting_after", "-1")
        try:
            after = int(raw)
        except ValueError:
            raise bad(f"starting_after must be an integer, got {preview(raw)}", "starting_after") from None
        if not await store.has_events(response_id):
            raise bad("only a background response created with stream: true can be streamed", "stream")
        return _event_stream(replay(response_id, deps.check_key(request).id, after), response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        if not await store.delete(response_id, deps.check_key(request).id):
            raise not_found(response_id)
        task = deps.tasks.get(response_id)
        if task is not None:
            task.cancel()
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str) -> Response:
        found = await stored(request, response_id)
        if not found.response.get("background"):
            raise bad("only a background response can be cancelled", "response_id")
        if found.status not in ("queued", "in_progress"):
            return JSONResponse(found.response)  # over already: as it ended
        cancelled = {**found.response, "status": "cancelled"}
        await store.save(cancelled, found.history, deps.check_key(request).id)
        task = deps.tasks.get(response_id)
        if task is not None:
            task.cancel()
        return JSONResponse(cancelled)
