"""`EngineClient` when Redis fails it mid-request, or its caller is cancelled: nothing it
registered is left behind, nothing it sent runs unread, nothing it read is lost, and what it could
not send is sent later. fakeredis with its failures injected; each test drives the methods."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis

from common.protocol import OUTPUTS_MAXLEN, AbortRequests, GenerateRequest, Route, SyncRequest
from gateway.engine.handle import EngineEvent
from gateway.engine.journal import read_journal
from gateway.engine.outputs import journal_write
from tests.test_engine_client import NAMES, SAMPLING, async_test, drain, engine, make_client, outputs, publish, sent

pytestmark = pytest.mark.unit


def kinds(msgs: list[Any]) -> list[str]:
    return [type(m).__name__ for m in msgs]


async def refused(*_: Any, **__: Any) -> None:
    raise redis.ConnectionError("Redis is away")


@async_test
async def test_a_submit_cancelled_before_its_batch_leaves_leaves_nothing_behind() -> None:
    client = make_client()
    await publish(client, engine("s1"))
    task = asyncio.create_task(client.submit("r1", [1, 2], dict(SAMPLING)))
    await asyncio.sleep(0)  # inside `SendBatch.send`: the batch has not left
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await client.aborts.flush("test")
    assert "r1" not in client.requests and "r1" not in client.attempts
    assert GenerateRequest.__name__ not in kinds(await sent(client, "s1"))  # nothing runs


@async_test
async def test_a_submit_cancelled_after_its_request_left_aborts_it() -> None:
    client = make_client()
    await publish(client, engine("s1"))
    real, gate = client.transport.send_many, asyncio.Event()

    async def landed_then_slow(sends: Any, deadline_s: float | None = None) -> None:
        await real(sends, deadline_s=deadline_s)
        await gate.wait()  # the reply is slow to come back

    client.transport.send_many = landed_then_slow  # type: ignore[method-assign]
    task = asyncio.create_task(client.submit("r1", [1, 2], dict(SAMPLING)))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gate.set()
    client.transport.send_many = real  # type: ignore[method-assign]
    await client.aborts.flush("test")
    assert "r1" not in client.requests and "r1" not in client.attempts
    assert kinds(await sent(client, "s1")) == ["GenerateRequest", "AbortRequests"]  # the engine stops it


@async_test
async def test_a_submit_whose_reply_is_lost_aborts_the_request_that_landed() -> None:
    client = make_client()
    await publish(client, engine("s1"))
    real = client.transport.send_many

    async def landed_reply_lost(sends: Any, deadline_s: float | None = None) -> None:
        await real(sends, deadline_s=deadline_s)
        raise redis.TimeoutError("no reply")

    client.transport.send_many = landed_reply_lost  # type: ignore[method-assign]
    with pytest.raises(redis.TimeoutError):
        await client.submit("r1", [1, 2], dict(SAMPLING))
    client.transport.send_many = real  # type: ignore[method-assign]
    await client.aborts.flush("test")
    msgs = await sent(client, "s1")
    assert kinds(msgs) == ["GenerateRequest", "AbortRequests"]
    assert "r1" in msgs[1].request_ids and "r1" not in client.requests


@async_test
async def test_a_move_whose_send_fails_is_made_on_a_later_round() -> None:
    client = make_client()
    await publish(client, engine("s1"))
    handle = await client.submit("r1", [1, 2], dict(SAMPLING))
    await client.transport.redis.delete(NAMES.engine("s1"))  # s1 is gone, s2 is up
    await client.transport.redis.zrem(NAMES.engines, "s1")
    await publish(client, engine("s2"))
    client.submits.send = refused  # type: ignore[method-assign]
    for _ in range(client.migration_limit + 2):  # failed tries are no moves: the limit is not used up
        await client.watch.check_routes()  # the move fails; the client is not told (it may still work)
    assert handle.unrouted_since is not None and not handle.done and not drain(handle)
    del client.submits.send  # Redis is back
    await client.aborts.flush("test")
    await client.watch.check_routes()
    moved = [m for m in await sent(client, "s2") if isinstance(m, GenerateRequest)]
    assert [m.request_id for m in moved] == [f"r1~{client.migration_limit + 3}"]  # a failed try's id is never reused
    assert handle.unrouted_since is None and handle.scheduler_id == "s2"
    aborted = [rid for m in await sent(client, "s2") if isinstance(m, AbortRequests) for rid in m.request_ids]
    assert aborted == [f"r1~{n}" for n in range(1, client.migration_limit + 3)]  # each failed try, in case it landed


@async_test
async def test_events_whose_journal_write_fails_are_asked_for_again_and_reach_the_client() -> None:
    client = make_client()
    await publish(client, engine("s1"))
    handle = await client.submit("r1", [1, 2], dict(SAMPLING), journal_id="cmpl-1", journal=[])
    plain = await client.submit("r2", [1, 2], dict(SAMPLING))
    real = client.transport.send_many

    async def out_of_memory(sends: Any, deadline_s: float | None = None) -> None:
        raise redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'")

    client.transport.send_many = out_of_memory  # type: ignore[method-assign]
    await client._dispatch([outputs(("r1", 0, [5, 6]), ("r2", 0, [9]))])  # this read's outputs exist nowhere else
    client.transport.send_many = real  # type: ignore[method-assign]
    assert not drain(handle) and handle.next_index == 0  # never seen unjournaled (write-ahead)
    assert [e.token_ids for e in drain(plain)] == [[9]]  # a stream without a journal is not held back
    await client.watch.resend_owed()  # `EngineWatch.run`, every half second
    syncs = [m for m in await sent(client, "s1") if isinstance(m, SyncRequest)]
    assert [(m.request_id, m.from_index) for m in syncs] == [("r1", 0)]
    await client._dispatch([outputs(("r1", 0, [5, 6]))])  # the engine's resend
    await client._dispatch([outputs(("r1", 2, [7], True, "length"))])
    events = drain(handle)
    assert [t for e in events for t in e.token_ids] == [5, 6, 7] and events[-1].finished
    assert [m.token_ids for m in (await read_journal(client, "cmpl-1")).outputs] == [[5, 6], [7]]


@async_test
async def test_a_resend_that_could_not_be_asked_for_is_asked_later_without_another_gap() -> None:
    client = make_client()
    await publish(client, engine("s1"))
    handle = await client.submit("r1", [1, 2], dict(SAMPLING))
    client.submits.send = refused  # type: ignore[method-assign]
    await client._dispatch([outputs(("r1", 3, [8], True, "length"))])  # tokens 0-2 were lost, and this is the last
    assert handle.resend_owed and not drain(handle)
    del client.submits.send
    await client.watch.resend_owed()  # `EngineWatch.run`, every half second
    syncs = [m for m in await sent(client, "s1") if isinstance(m, SyncRequest)]
    assert [(m.request_id, m.from_index) for m in syncs] == [("r1", 0)] and not handle.resend_owed
    await client.watch.resend_owed()
    assert len([m for m in await sent(client, "s1") if isinstance(m, SyncRequest)]) == 1  # once


@async_test
async def test_an_adoption_that_fails_leaves_the_stream_free_to_resume() -> None:
    client = make_client()
    await publish(client, engine("s1"))
    client.submits.send = refused  # type: ignore[method-assign]
    with pytest.raises(redis.ConnectionError):
        await client.adopt("cmpl-a", [1, 2], dict(SAMPLING), Route("cmpl-a", "s1"), [])
    assert not client.requests and not client.attempts
    del client.submits.send
    handle = await client.adopt("cmpl-a", [1, 2], dict(SAMPLING), Route("cmpl-a", "s1"), [])  # the client's retry
    assert client.requests["cmpl-a"] is handle


@async_test
async def test_a_long_journal_keeps_its_first_entries() -> None:
    client = make_client()
    await publish(client, engine("s1"))
    handle = await client.submit("r2", [1, 2], dict(SAMPLING), journal_id="cmpl-2", journal=[])  # its first entry: a Route
    n = OUTPUTS_MAXLEN + 500  # more events than an outputs stream keeps
    writes = [journal_write(NAMES, handle, EngineEvent([7], [None]), i, 60_000) for i in range(n)]
    for i in range(0, n, 2000):
        await client.transport.send_many(writes[i : i + 2000])
    journal = await read_journal(client, "cmpl-2")
    assert "r2" in journal.routes and len(journal.outputs) == n


@async_test
async def test_a_request_whose_journal_write_is_in_flight_is_not_moved_meanwhile() -> None:
    client = make_client()
    await publish(client, engine("s1"))
    handle = await client.submit("r1", [1, 2], dict(SAMPLING), journal_id="cmpl-1", journal=[])
    await client.transport.redis.delete(NAMES.engine("s1"))
    await client.transport.redis.zrem(NAMES.engines, "s1")
    await publish(client, engine("s2"))
    handle.journal_writes = 1  # `_dispatch` awaits its write: its tokens may yet be taken back
    await client.watch.check_routes()
    assert handle.scheduler_id == "s1" and handle.unrouted_since is None
    handle.journal_writes = 0
    await client.watch.check_routes()
    assert handle.scheduler_id == "s2"


def test_a_long_resend_read_at_once_becomes_events_of_a_journal_entrys_size() -> None:
    from gateway.engine.handle import RequestHandle
    from gateway.engine.outputs import MAX_EVENT_TOKENS, route_outputs

    handle = RequestHandle("r1", [1], {}, "cmpl-1", engine_request_id="r1")
    piece = MAX_EVENT_TOKENS // 2 + 1  # tokens a resend row
    msgs = [outputs(("r1", i, [7] * piece)) for i in range(0, 6 * piece, piece)]
    routed = route_outputs(msgs, {"r1": handle})
    assert len(routed.events) >= 3 and handle.next_index == 6 * piece
    assert all(len(e.token_ids) <= MAX_EVENT_TOKENS for _, e, _ in routed.events)
    ends = [start + len(e.token_ids) for _, e, start in routed.events]
    assert [start for _, _, start in routed.events] == [0, *ends[:-1]] and ends[-1] == 6 * piece  # in order, no gap


def test_every_form_of_a_write_refusal_is_told_from_other_errors() -> None:
    from common.redis_errors import WritesRefused, as_transient, refuses_writes

    refusals = [
        redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'"),
        redis.exceptions.ReadOnlyError("You can't write against a read only replica."),
        redis.ResponseError("MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist"),
        redis.ResponseError("Command # 1 (XTRIM s) of pipeline caused error: MISCONF Redis is configured to save"),
        redis.ResponseError("Command # 1 (XTRIM s) of pipeline caused error: ('MISCONF Redis is configured to save',)"),
    ]
    assert all(refuses_writes(e) and isinstance(as_transient(e), WritesRefused) for e in refusals)
    others = [redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"), ValueError("x")]
    assert not any(refuses_writes(e) for e in others)
