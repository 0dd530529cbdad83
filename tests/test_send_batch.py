"""`SendBatch`: a burst is one Redis call, in order; errors, cancellations; submissions and resends through it."""

from __future__ import annotations

import asyncio

import fakeredis
import pytest
import redis

from common.protocol import ENTRY_FIELD, Names, decode
from common.transport import Outgoing, Transport
from gateway.engine.send_batch import MAX_BATCH_BYTES, SendBatch
from tests.test_engine_client import SAMPLING, async_test, engine, make_client, publish, sent

pytestmark = pytest.mark.unit

NAMES = Names("t-batch")


def transport() -> Transport:
    t = Transport("redis://unused", NAMES)
    t.redis = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
    return t


def append(stream: str, value: int) -> Outgoing:
    return Outgoing(stream, str(value).encode(), None, None)


async def entries(t: Transport, stream: str) -> list[int]:
    return [int(f[ENTRY_FIELD]) for _, f in await t.redis.xrange(stream)]


@async_test
async def test_calls_made_together_leave_as_one_call_in_their_order() -> None:
    t = transport()
    batch = SendBatch(t, deadline_s=1)
    # Two appends per caller: a caller's own appends stay in order too.
    await asyncio.gather(*(batch.send([append("s", 2 * i), append("s", 2 * i + 1)]) for i in range(20)))
    assert batch.num_calls == 1
    assert await entries(t, "s") == list(range(40))
    await batch.send([append("s", 40)])  # a later call starts a batch of its own
    assert batch.num_calls == 2
    assert (await entries(t, "s"))[-1] == 40


@async_test
async def test_every_caller_gets_the_batchs_error() -> None:
    t = transport()
    batch = SendBatch(t, deadline_s=1)

    async def refused(*args: object, **kwargs: object) -> None:
        raise redis.ConnectionError("Redis is away")

    t.send_many = refused  # type: ignore[method-assign]
    results = await asyncio.gather(*(batch.send([append("s", i)]) for i in range(5)), return_exceptions=True)
    assert [type(r) for r in results] == [redis.ConnectionError] * 5
    assert batch.num_calls == 1


@async_test
async def test_a_caller_cancelled_before_its_batch_leaves_sends_nothing() -> None:
    t = transport()
    batch = SendBatch(t, deadline_s=1)
    kept = asyncio.ensure_future(batch.send([append("s", 1)]))
    gone = asyncio.ensure_future(batch.send([append("s", 2)]))
    await asyncio.sleep(0)  # both have joined the batch; it has not left yet
    gone.cancel()
    await kept
    assert gone.cancelled()
    assert await entries(t, "s") == [1]


@async_test
async def test_a_burst_of_submissions_is_one_round_trip_with_each_requests_journal_first() -> None:
    client = make_client()
    await publish(client, engine("a"))
    handles = await asyncio.gather(*(client.submit(f"r{i}", [1, 2], SAMPLING, journal_id=f"j{i}") for i in range(8)))
    assert client.submits.num_calls == 1
    assert [m.request_id for m in await sent(client, "a")] == [h.engine_request_id for h in handles]
    for i in range(8):  # the route to the engine is journaled with the request, in the same call
        route = [decode(f[ENTRY_FIELD]) for _, f in await client.transport.redis.xrange(client.names.journal(f"j{i}"))]
        assert [r.scheduler_id for r in route] == ["a"]


@async_test
async def test_a_burst_past_the_byte_cap_leaves_in_several_calls_in_order() -> None:
    t = transport()
    batch = SendBatch(t, deadline_s=1)
    big = MAX_BATCH_BYTES // 3 + 1  # three of them overflow one batch

    def padded(i: int) -> Outgoing:
        return Outgoing("s", str(i).encode().ljust(big), None, None)

    await asyncio.gather(*(batch.send([padded(i)]) for i in range(6)))
    assert batch.num_calls == 3
    assert [int(f[ENTRY_FIELD]) for _, f in await t.redis.xrange("s")] == list(range(6))


@async_test
async def test_a_batch_that_never_leaves_fails_its_callers_and_the_next_call_goes_on() -> None:
    t = transport()
    batch = SendBatch(t, deadline_s=1)
    caller = asyncio.ensure_future(batch.send([append("s", 1)]))
    await asyncio.sleep(0)  # the caller joined; its batch's task has not run
    for task in list(batch._leaving):
        task.cancel()  # as at the loop's teardown
    with pytest.raises(ConnectionError, match="stopped"):
        await caller
    await asyncio.wait_for(batch.send([append("s", 2)]), 2)
    assert await entries(t, "s") == [2]


@async_test
async def test_a_resend_request_that_fails_is_asked_again_at_the_next_gap() -> None:
    client = make_client()
    await publish(client, engine("a"))
    handles = await asyncio.gather(*(client.submit(f"r{i}", [1], SAMPLING) for i in range(3)))

    async def refused(*args: object, **kwargs: object) -> None:
        raise redis.ConnectionError("Redis is away")

    client.transport.send_many = refused  # type: ignore[method-assign]
    with pytest.raises(redis.ConnectionError):
        await client.watch.sync_all("test")
    assert [h.sync_from for h in handles] == [-1, -1, -1]  # none counts as asked
