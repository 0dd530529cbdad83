"""`EngineClient` (the gateway's side of the streams) on fakeredis: engine choice, output dispatch
(duplicates, gaps, write-ahead journaling), migration of requests an engine does not hold, and
adoption of a journaled stream. Background tasks are not started: each test drives the methods."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

import fakeredis
import pytest
import redis

from common.codec import unpack_logprobs
from common.protocol import (
    ENTRY_FIELD,
    OUTPUTS_TTL_MS,
    AbortRequests,
    EngineStatus,
    GenerateRequest,
    JournalHeader,
    Names,
    Route,
    StepOutputs,
    SyncRequest,
    decode,
    encode,
)
from common.sampling_params import SamplingParams
from common.transport import Outgoing, SyncTransport, renewed_ttl_ms
from gateway.engine.client import AFFINITY_SLACK, EngineClient, EngineEvent, EngineUnavailable, RequestHandle, RequestIdInUse
from gateway.engine.journal import read_journal
from gateway.engine.outputs import replay
from scheduler.outputs import OutputRouter
from scheduler.request import Request, StepOutput

pytestmark = pytest.mark.unit

NAMES = Names("t-client")
SAMPLING = {"temperature": 0.0, "max_tokens": 10}


def async_test(fn: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(fn(*args, **kwargs))

    return wrapper


def engine(
    sid: str,
    *,
    running: int = 0,
    waiting: int = 0,
    free: int = 100,
    executor: str = "e",
    model: str = "tiny",
    incarnation: str | None = None,
) -> EngineStatus:
    return EngineStatus(
        scheduler_id=sid,
        incarnation=incarnation or f"inc-{sid}",
        model_name=model,
        model_path="/m",
        max_model_len=256,
        vocab_size=100,
        block_size=16,
        num_blocks=100,
        executor_id=executor,
        epoch=1,
        num_free_blocks=free,
        num_running=running,
        num_waiting=waiting,
        num_steps=0,
        num_preemptions=0,
        num_dead_letters=0,
        updated_at=0.0,
    )


def make_client(gateway_id: str = "g1", server: fakeredis.FakeServer | None = None, **kwargs: Any) -> EngineClient:
    client = EngineClient("redis://unused", NAMES, gateway_id, **kwargs)
    client.transport.redis = fakeredis.FakeAsyncRedis(server=server or fakeredis.FakeServer())
    return client


async def publish(client: EngineClient, *statuses: EngineStatus) -> None:
    """Write the engines' status keys as `EngineBeat` does, and let the client read them."""
    r = client.transport.redis
    for status in statuses:
        await r.set(NAMES.engine(status.scheduler_id), encode(status))
        await r.zadd(NAMES.engines, {status.scheduler_id: 1.0})
    await client.watch.refresh()


async def sent(client: EngineClient, sid: str) -> list[Any]:
    """Every message on ``requests:<sid>``, in order."""
    return [decode(f[ENTRY_FIELD]) for _, f in await client.transport.redis.xrange(NAMES.requests(sid))]


async def journal(client: EngineClient, response_id: str) -> list[Any]:
    return [decode(f[ENTRY_FIELD]) for _, f in await client.transport.redis.xrange(NAMES.journal(response_id))]


def outputs(*rows: tuple[Any, ...]) -> StepOutputs:
    """``(request id, first index, tokens[, finished, reason, error])`` per row, as a gateway reads it."""
    msg = StepOutputs()
    for rid, index, tokens, *rest in rows:
        finished, reason, error = list(rest) + [False, None, None][len(rest) :]
        msg.add(rid, index, tokens, None, finished, reason, error)
    return decode(encode(msg.sealed()))


def drain(handle: RequestHandle) -> list[EngineEvent]:
    events = []
    while not handle.events.empty():
        events.append(handle.events.get_nowait())
    return events


def tokens_of(events: list[EngineEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


# -- choosing an engine ------------------------------------------------------------------------------
@async_test
async def test_pick_engine_prefers_executor_then_least_load() -> None:
    client = make_client()
    assert client.pick_engine() is None
    with pytest.raises(EngineUnavailable):
        await client.submit("r0", [1], SAMPLING)
    await publish(
        client,
        engine("idle-no-executor", executor=""),  # no executor: last resort
        engine("busy", waiting=1, free=50),  # load 4
        engine("light", running=2),  # load 2
        engine("starting", model=""),
    )  # no model yet: not an engine
    assert set(client.engines) == {"idle-no-executor", "busy", "light"} and client.down_reason is None
    assert client.pick_engine().scheduler_id == "light"
    # What this gateway sent since the last refresh counts too (one each): light at 2, 3, then a
    # tie with busy at 4 (more free blocks wins), then busy at 4 against light at 5, then a tie at 5.
    handles = [await client.submit(f"r{i}", [1, 2], SAMPLING) for i in range(1, 6)]
    assert [h.scheduler_id for h in handles] == ["light", "light", "light", "busy", "light"]
    assert client.sent_since_refresh == {"light": 4, "busy": 1}
    # Each request went to its engine's own stream, addressed to that engine's incarnation.
    msgs = await sent(client, "light")
    assert [m.request_id for m in msgs] == ["r1", "r2", "r3", "r5"]
    assert [m.request_id for m in await sent(client, "busy")] == ["r4"]
    assert msgs[0] == GenerateRequest("r1", "g1", "light", "inc-light", [1, 2], [], SAMPLING, msgs[0].arrival_time, "")
    assert await sent(client, "idle-no-executor") == []
    # A refresh starts counting anew.
    await client.watch.refresh()
    assert client.sent_since_refresh == {} and client.pick_engine().scheduler_id == "light"


@async_test
async def test_pick_engine_load_and_free_blocks() -> None:
    client = make_client()
    await publish(client, engine("a", running=2, free=10), engine("b", running=2, free=50), engine("c", waiting=1))
    assert client.pick_engine().scheduler_id == "b"  # equal load: more free blocks wins
    client.sent_since_refresh["b"] = 1
    assert client.pick_engine().scheduler_id == "a"
    client.sent_since_refresh["a"] = 3
    assert client.pick_engine().scheduler_id == "b"  # b: 3, a: 5, c: 4
    client.sent_since_refresh["b"] = 3
    assert client.pick_engine().scheduler_id == "c"
    # Without any executor bound, the least loaded one still serves (it will get one).
    client2 = make_client()
    await publish(client2, engine("x", executor="", running=5), engine("y", executor="", running=1))
    assert client2.pick_engine().scheduler_id == "y"


@async_test
async def test_concurrent_submissions_spread_over_engines() -> None:
    """Requests routed at the same moment see each other's choice (a burst does not pile up)."""
    client = make_client()
    await publish(client, engine("a"), engine("b"))
    handles = await asyncio.gather(*(client.submit(f"r{i}", [1], SAMPLING) for i in range(10)))
    chosen = [h.scheduler_id for h in handles]
    assert chosen.count("a") == chosen.count("b") == 5


@async_test
async def test_first_block_prompts_sharing_a_prefix_meet_on_one_engine_unless_it_is_too_busy() -> None:
    gateways = [make_client("g1", routing="first_block"), make_client("g2", routing="first_block")]
    for client in gateways:
        await publish(client, *(engine(sid) for sid in "abcd"))
    system = list(range(100, 100 + 16))  # one full block (block_size 16) shared by every prompt
    chosen = {client.pick_engine(system + [i, i + 1]).scheduler_id for client in gateways for i in range(20)}
    assert len(chosen) == 1, "one prefix, one engine, whichever gateway routes it"
    spread = {gateways[0].pick_engine([i] * 16).scheduler_id for i in range(40)}
    assert len(spread) == 4, "different prefixes spread over the engines"
    assert gateways[0].pick_engine([1, 2, 3]).scheduler_id in "abcd"  # shorter than a block: least loaded
    # Too much busier than the least-loaded engine: the prefix goes elsewhere.
    favourite = chosen.pop()
    gateways[0].sent_since_refresh[favourite] = AFFINITY_SLACK + 1
    assert gateways[0].pick_engine(system + [7]).scheduler_id != favourite
    gateways[0].sent_since_refresh[favourite] = AFFINITY_SLACK
    assert gateways[0].pick_engine(system + [7]).scheduler_id == favourite


# -- dispatching outputs -------------------------------------------------------------------------------
async def dispatch_steps(client: EngineClient, *msgs: StepOutputs) -> None:
    """Deliver steps' outputs as one read of the outputs stream (`EngineClient._dispatch`)."""
    await client._dispatch(list(msgs))


@async_test
async def test_dispatch_drops_duplicate_token_indices() -> None:
    client = make_client()
    await publish(client, engine("s0"))
    h = await client.submit("r", [1, 2, 3], SAMPLING)
    other = await client.submit("q", [4], SAMPLING)
    await dispatch_steps(client, outputs(("r", 0, [5, 6]), ("q", 0, [9])))
    await dispatch_steps(client, outputs(("r", 1, [6, 7])))  # overlaps by one
    await dispatch_steps(client, outputs(("r", 0, [5, 6])))  # a whole duplicate (a retried exchange)
    await dispatch_steps(client, outputs(("r", 3, [8]), ("ghost", 0, [1])))
    events = drain(h)
    assert [e.token_ids for e in events] == [[5, 6], [7], [8]]
    assert h.output_token_ids == [5, 6, 7, 8] and not h.done
    assert tokens_of(drain(other)) == [9]
    # The final output (a duplicate index, with no new token) still ends the request, once.
    await dispatch_steps(client, outputs(("r", 3, [8], True, "length")))
    [last] = drain(h)
    assert last.token_ids == [] and last.finished and last.finish_reason == "length" and h.done
    await dispatch_steps(client, outputs(("r", 4, [1], True, "length")))
    assert drain(h) == [] and h.output_token_ids == [5, 6, 7, 8]
    assert [type(m) for m in await sent(client, "s0")] == [GenerateRequest, GenerateRequest]  # no sync asked


@async_test
async def test_steps_read_together_become_one_event_and_one_journal_entry() -> None:
    client = make_client()
    await publish(client, engine("s0"))
    header = JournalHeader("resp", "completion", "{}", "tiny", 1, 10, [1], None)
    h = await client.submit("r", [1], SAMPLING, "resp", journal=[Outgoing(NAMES.journal("resp"), encode(header))])
    other = await client.submit("q", [4], SAMPLING)
    # Three steps read at once (the gateway fell behind): one event per request, in order, with
    # a duplicate dropped, the end carried, and the number of engine steps it stands for.
    await dispatch_steps(
        client,
        outputs(("r", 0, [5]), ("q", 0, [9])),
        outputs(("r", 1, [6]), ("q", 0, [9])),  # q's is a duplicate
        outputs(("r", 2, [7], True, "length")),
    )
    [event] = drain(h)
    assert event.token_ids == [5, 6, 7] and event.finished and event.finish_reason == "length"
    assert event.num_steps == 3 and h.done
    [q_event] = drain(other)
    assert q_event.token_ids == [9] and q_event.num_steps == 1 and not q_event.finished
    entries = await journal(client, "resp")
    assert [(m.token_index, m.token_ids, m.finished) for m in entries[2:]] == [([0], [5, 6, 7], [True])]
    # A journal replay delivers the same single event again (resumed streams number alike).
    [replayed] = replay(RequestHandle("r", [1], SAMPLING), entries[2:])
    assert replayed.token_ids == [5, 6, 7] and replayed.finished and replayed.replayed


@async_test
async def test_the_choices_of_a_response_read_together_are_one_journal_entry() -> None:
    """The choices of one response share its journal: what one read brings for them is one entry
    (a row per choice), and each choice's replay takes its own rows from it."""
    client = make_client()
    await publish(client, engine("s0"))
    header = JournalHeader("resp", "completion", "{}", "tiny", 1, 10, [1], None)
    c0 = await client.submit("c0", [1], SAMPLING, "resp", journal=[Outgoing(NAMES.journal("resp"), encode(header))])
    c1 = await client.submit("c1", [1], SAMPLING, "resp")
    await dispatch_steps(client, outputs(("c0", 0, [5]), ("c1", 0, [7])), outputs(("c0", 1, [6]), ("c1", 1, [8], True, "length")))
    assert (tokens_of(drain(c0)), tokens_of(drain(c1))) == ([5, 6], [7, 8])
    entries = [m for m in await journal(client, "resp") if isinstance(m, StepOutputs)]
    assert [(m.request_ids, m.token_index, m.token_ids, m.finished) for m in entries] == [
        (["c0", "c1"], [0, 0], [5, 6, 7, 8], [False, True])
    ]
    for request_id, tokens, finished in (("c0", [5, 6], False), ("c1", [7, 8], True)):
        [event] = replay(RequestHandle(request_id, [1], SAMPLING), entries)
        assert event.token_ids == tokens and event.finished == finished


@async_test
async def test_a_stream_interval_delivers_the_steps_meanwhile_as_one_event() -> None:
    """With ``stream_interval_ms`` the outputs reader delivers what a read brings at once, then waits
    out the interval: the steps that arrive meanwhile become one event (and one journal entry)."""
    client = make_client(stream_interval_ms=300)
    await publish(client, engine("s0"))
    h = await client.submit("r", [1], SAMPLING)
    r, stream = client.transport.redis, client.outputs_stream
    reader = asyncio.create_task(client._read_outputs())
    try:
        await asyncio.sleep(0.05)  # the reader is waiting for the first output
        await r.xadd(stream, {ENTRY_FIELD: encode(outputs(("r", 0, [5])))})
        first = await asyncio.wait_for(h.events.get(), 1)
        assert first.token_ids == [5]  # not held back: nothing was delivered within the interval
        for index, token in ((1, 6), (2, 7)):
            await r.xadd(stream, {ENTRY_FIELD: encode(outputs(("r", index, [token])))})
            await asyncio.sleep(0.02)
        assert h.events.empty()  # within the interval
        second = await asyncio.wait_for(h.events.get(), 1)
        assert second.token_ids == [6, 7] and second.num_steps == 2
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


@async_test
async def test_dispatch_gap_asks_for_one_resend() -> None:
    client = make_client()
    await publish(client, engine("s0"))
    h = await client.submit("r", [1, 2, 3], SAMPLING)
    await dispatch_steps(client, outputs(("r", 0, [5, 6, 7])))
    await dispatch_steps(client, outputs(("r", 5, [9])))  # 3 and 4 were lost
    await dispatch_steps(client, outputs(("r", 6, [10])))  # still missing: no second request
    assert tokens_of(drain(h)) == [5, 6, 7] and h.sync_from == 3
    syncs = [m for m in await sent(client, "s0") if isinstance(m, SyncRequest)]
    assert syncs == [SyncRequest("r", "g1", 3)]
    # The engine resends from 3; what arrives after is contiguous again.
    await dispatch_steps(client, outputs(("r", 3, [7, 8, 9, 10])))
    await dispatch_steps(client, outputs(("r", 7, [11])))
    assert tokens_of(drain(h)) == [7, 8, 9, 10, 11] and h.output_token_ids == [5, 6, 7, 7, 8, 9, 10, 11]
    # A new gap (at a new index) is a new request.
    await dispatch_steps(client, outputs(("r", 9, [1])))
    await dispatch_steps(client, outputs(("r", 9, [1])))
    syncs = [m for m in await sent(client, "s0") if isinstance(m, SyncRequest)]
    assert syncs == [SyncRequest("r", "g1", 3), SyncRequest("r", "g1", 8)]


@async_test
async def test_dispatch_journals_resumable_events_before_delivering_them() -> None:
    client = make_client(resume_window_s=30.0)
    await publish(client, engine("s0"))
    header = JournalHeader("resp", "chat", "{}", "tiny", 1, 10, [1, 2, 3], None)
    h = await client.submit(
        "resp",
        [1, 2, 3],
        SAMPLING,
        "resp",
        journal=[Outgoing(NAMES.journal("resp"), encode(header), None, client.journal_ttl_ms)],
    )
    plain = await client.submit("plain", [1], SAMPLING)
    assert h.journal_id == "resp" and plain.journal_id == ""
    assert await journal(client, "resp") == [header, Route("resp", "s0")]
    assert (await sent(client, "s0"))[0].journal_id == "resp"

    writes: list[tuple[list[str], int]] = []  # (streams written, events the client had by then)
    real_send_many = client.transport.send_many

    async def spy(sends: list[Outgoing], deadline_s: float | None = None) -> None:
        writes.append(([s.stream for s in sends], h.events.qsize()))
        await real_send_many(sends, deadline_s=deadline_s)

    client.transport.send_many = spy  # type: ignore[method-assign]
    logprobs_msg = StepOutputs()
    logprobs_msg.add("resp", 0, [5, 6], [{5: -0.5}, {6: -0.25, 1: -3.0}])
    logprobs_msg.add("plain", 0, [7], None)
    await dispatch_steps(client, decode(encode(logprobs_msg.sealed())))
    assert writes == [([NAMES.journal("resp")], 0)]  # written while the client had seen nothing
    await dispatch_steps(client, outputs(("resp", 1, [6, 8]), ("plain", 1, [9])))  # one duplicate token
    await dispatch_steps(client, outputs(("resp", 3, [9], True, "stop")))
    assert [w[1] for w in writes] == [0, 1, 2]
    events = drain(h)
    assert [e.token_ids for e in events] == [[5, 6], [8], [9]] and events[0].logprobs == [{5: -0.5}, {6: -0.25, 1: -3.0}]
    entries = await journal(client, "resp")
    assert entries[:2] == [header, Route("resp", "s0")]
    replay = [(m.request_ids, m.token_index, m.token_ids, m.finished, m.finish_reasons) for m in entries[2:]]
    assert replay == [
        (["resp"], [0], [5, 6], [False], [None]),
        (["resp"], [2], [8], [False], [None]),
        (["resp"], [3], [9], [True], ["stop"]),
    ]
    assert unpack_logprobs(entries[2].lp_counts, entries[2].lp_token_ids, entries[2].lp_values) == [
        {5: -0.5},
        {6: -0.25, 1: -3.0},
    ]
    assert 30_000 < await client.transport.redis.pttl(NAMES.journal("resp")) <= renewed_ttl_ms(30_000)
    assert tokens_of(drain(plain)) == [7, 9]  # not journaled: only resp's stream exists
    assert await client.transport.redis.exists(NAMES.journal("plain")) == 0

    # A journal write that fails delivers nothing: no client sees an event that cannot be replayed.
    h2 = await client.submit("resp2", [1], SAMPLING, "resp2", journal=[Outgoing(NAMES.journal("resp2"), encode(header))])

    async def broken(sends: list[Outgoing], deadline_s: float | None = None) -> None:
        raise ConnectionError("redis down")

    client.transport.send_many = broken  # type: ignore[method-assign]
    await dispatch_steps(client, outputs(("resp2", 0, [4])))
    assert drain(h2) == [] and h2.next_index == 0 and h2.resend_owed  # asked for again (tests/test_engine_client_faults.py)


@async_test
async def test_a_claimed_stream_id_is_one_streams_on_every_gateway() -> None:
    """A stream whose id a client chose claims its journal first (`submit`'s ``claim``): a second
    claim, on the same gateway or another, is refused before anything reaches an engine; the
    claim of a request that cannot start is released."""
    server = fakeredis.FakeServer()
    g1, g2 = make_client("g1", server), make_client("g2", server)
    await publish(g1, engine("s0"))
    await g2.watch.refresh()
    header = JournalHeader("mine", "completion", "{}", "tiny", 1, 10, [1], None)
    first = Outgoing(NAMES.journal("mine"), encode(header), None, g1.journal_ttl_ms)
    h = await g1.submit("mine-0a1b2c3d", [1], SAMPLING, "mine", claim=first)
    assert h.journal_id == "mine" and h.engine_request_id == "mine-0a1b2c3d"
    assert await journal(g1, "mine") == [header, Route("mine-0a1b2c3d", "s0")]
    assert 0 < await g1.transport.redis.pttl(NAMES.journal("mine")) <= renewed_ttl_ms(g1.journal_ttl_ms)
    await g1.transport.redis.pexpire(NAMES.journal("mine"), 5_000)  # as if its owner had died a while ago
    for gateway in (g1, g2):
        with pytest.raises(RequestIdInUse):
            await gateway.submit("mine-ffffffff", [1], SAMPLING, "mine", claim=first)
        assert "mine-ffffffff" not in gateway.requests
    # A refused claim leaves the journal's TTL alone: retrying clients cannot keep a dead one alive.
    assert 0 < await g1.transport.redis.pttl(NAMES.journal("mine")) <= 5_000 < g1.journal_ttl_ms
    assert [m.request_id for m in await sent(g1, "s0") if isinstance(m, GenerateRequest)] == ["mine-0a1b2c3d"]
    assert await journal(g1, "mine") == [header, Route("mine-0a1b2c3d", "s0")]  # untouched
    # Two resumes of the stream on one gateway would split its outputs: the second is refused.
    _, route = (mine := await read_journal(g2, "mine")).single()
    assert route is not None
    await g2.adopt("mine", [1], SAMPLING, route, mine.outputs)
    with pytest.raises(RequestIdInUse):
        await g2.adopt("mine", [1], SAMPLING, route, mine.outputs)
    # The request cannot start (no engine left to take it): the id is free again.
    g1.engines.clear()
    free = Outgoing(NAMES.journal("free"), encode(header), None, g1.journal_ttl_ms)
    with pytest.raises(EngineUnavailable):
        await g1.submit("free-00000000", [1], SAMPLING, "free", claim=free)
    assert await g1.transport.redis.exists(NAMES.journal("free")) == 0 and not g1.requests.get("free-00000000")


@async_test
async def test_a_claimed_stream_gets_its_ttl_on_a_server_older_than_redis_7() -> None:
    """Redis 6 refuses ``PEXPIRE ... NX``: the stream a claim creates still gets its TTL at once
    (not only with the route the gateway journals next, which a gateway that dies first never writes)."""
    g = make_client("g1", fakeredis.FakeServer(version=6))
    header = JournalHeader("old", "completion", "{}", "tiny", 1, 10, [1], None)
    first = Outgoing(NAMES.journal("old"), encode(header), None, g.journal_ttl_ms)
    assert await g.transport.create_stream(first)
    assert 0 < await g.transport.redis.pttl(NAMES.journal("old")) <= g.journal_ttl_ms
    assert not await g.transport.create_stream(first)


# -- migration ---------------------------------------------------------------------------------------
@async_test
async def test_requests_leave_an_engine_left_without_an_executor_for_one_that_has_one() -> None:
    """An engine whose executor died (and is not back) keeps its requests for a new one up to the
    recovery timeout; with another engine able to run them, they move there after two heartbeat
    TTLs instead of waiting out the recovery timeout and failing."""
    client = make_client(heartbeat_ttl_ms=1000)
    await publish(client, engine("s0", free=200), engine("s1"))
    h = await client.submit("resp", [1, 2, 3], SAMPLING, "resp")
    assert h.scheduler_id == "s0"
    await dispatch_steps(client, outputs(("resp", 0, [5])))
    await publish(client, engine("s0", executor=""), engine("s1"))  # s0 lost its executor
    await client.watch.check_routes()
    assert h.scheduler_id == "s0", "moved before the engine had a chance to get a new executor"
    client.unbound_since["s0"] -= 2.5  # two TTLs (and a half) without one
    await client.watch.check_routes()
    assert (h.scheduler_id, h.engine_request_id, client.num_migrations) == ("s1", "resp~1", 1)
    [moved] = await sent(client, "s1")
    assert isinstance(moved, GenerateRequest) and moved.output_token_ids == [5]
    # With no engine able to run it, a request stays and waits for an executor.
    alone = make_client(heartbeat_ttl_ms=1000)
    await publish(alone, engine("s0"))
    h2 = await alone.submit("solo", [1], SAMPLING, "solo")
    await publish(alone, engine("s0", executor=""))
    alone.unbound_since["s0"] -= 60
    await alone.watch.check_routes()
    assert h2.scheduler_id == "s0" and alone.num_migrations == 0


@async_test
async def test_unknown_request_migrates_to_least_loaded_engine() -> None:
    client = make_client()
    await publish(client, engine("s0"), engine("s1", running=1))
    h = await client.submit(
        "resp",
        [1, 2, 3],
        SAMPLING,
        "resp",
        journal=[Outgoing(NAMES.journal("resp"), encode(JournalHeader("resp", "completion", "{}", "tiny", 1, 10, [1, 2, 3])))],
    )
    assert h.scheduler_id == "s0" and h.engine_request_id == "resp" and h.attempts == 1
    await dispatch_steps(client, outputs(("resp", 0, [5, 6])))
    # s0 restarted and lost it (and is now busy); s2 appeared and is the least loaded.
    await publish(client, engine("s0", waiting=3, incarnation="inc-s0-b"), engine("s1", running=1), engine("s2"))
    await dispatch_steps(client, outputs(("resp", 0, [], True, "unknown", "the scheduler does not hold this request")))
    events = drain(h)  # the two tokens only: "unknown" is not shown to the client
    assert [e.token_ids for e in events] == [[5, 6]] and not any(e.finished for e in events) and not h.done
    assert h.output_token_ids == [5, 6]
    assert (h.engine_request_id, h.scheduler_id, h.incarnation, h.attempts) == ("resp~1", "s2", "inc-s2", 2)
    assert client.num_migrations == 1 and h.unrouted_since is None
    assert set(client.attempts) == {"resp~1"} and client.requests["resp"] is h
    [moved] = await sent(client, "s2")
    assert moved == GenerateRequest("resp~1", "g1", "s2", "inc-s2", [1, 2, 3], [5, 6], SAMPLING, moved.arrival_time, "resp")
    assert (await journal(client, "resp"))[-1] == Route("resp~1", "s2")
    # The old attempt is stopped on the old engine.
    await client.aborts.flush("client")
    assert [m for m in await sent(client, "s0") if isinstance(m, AbortRequests)] == [AbortRequests(["resp"], "client", "g1")]
    assert await sent(client, "s1") == []
    # Late outputs of the old attempt are ignored; the new attempt continues at index 2.
    await dispatch_steps(client, outputs(("resp", 2, [99])))
    await dispatch_steps(client, outputs(("resp~1", 2, [7], True, "stop")))
    events = drain(h)
    assert tokens_of(events) == [7] and events[-1].finish_reason == "stop" and h.done


@async_test
async def test_migration_limit_fails_the_request() -> None:
    client = make_client(migration_limit=1)
    await publish(client, engine("s0"))
    h = await client.submit("r", [1], SAMPLING)
    await dispatch_steps(client, outputs(("r", 0, [4])))
    await dispatch_steps(client, outputs(("r", 0, [], True, "unknown")))
    assert h.engine_request_id == "r~1" and h.attempts == 2 and not h.done
    await dispatch_steps(client, outputs(("r~1", 1, [], True, "unknown")))
    events = drain(h)
    assert tokens_of(events) == [4]
    last = events[-1]
    assert last.finished and last.finish_reason == "error" and "giving up" in (last.error or "") and h.done
    reqs = [m for m in await sent(client, "s0") if isinstance(m, GenerateRequest)]
    assert [m.request_id for m in reqs] == ["r", "r~1"]  # no third attempt
    await client.aborts.flush("client")
    aborts = [m for m in await sent(client, "s0") if isinstance(m, AbortRequests)]
    assert len(aborts) == 1 and set(aborts[0].request_ids) == {"r", "r~1"}
    # Nothing more happens for it.
    await dispatch_steps(client, outputs(("r~1", 1, [5])))
    assert drain(h) == []


@async_test
async def test_a_resumable_stream_that_fails_here_journals_its_error() -> None:
    """The gateway's own verdict (here: moved too often) ends the journal as an engine's error would:
    a client that lost its connection meanwhile and resumes gets the error, not a 404."""
    client = make_client(migration_limit=0)
    await publish(client, engine("s0"))
    header = Outgoing(NAMES.journal("resp"), encode(JournalHeader("resp", "completion", "{}", "tiny", 1, 10, [1])))
    h = await client.submit("resp", [1], SAMPLING, "resp", journal=[header])
    await dispatch_steps(client, outputs(("resp", 0, [4])))
    await dispatch_steps(client, outputs(("resp", 0, [], True, "unknown")))
    assert h.done and drain(h)[-1].finish_reason == "error"
    journaled = await read_journal(client, "resp")
    again = RequestHandle("resp", [1], SAMPLING, journal_id="resp")
    events = replay(again, journaled.outputs)
    assert tokens_of(events) == [4] and events[-1].finished and "giving up" in (events[-1].error or "")


@async_test
async def test_a_journal_outlives_a_stream_that_waits_long_for_an_engine() -> None:
    """A journal lives the resume window past its last write. A stream this gateway still serves
    but has not written to for a quarter of the window (waiting for an engine, a long queue) gets
    its journal's TTL refreshed: it must not expire under a live stream. A finished one's is not."""
    client = make_client(resume_window_s=8.0)
    await publish(client, engine("s0"))
    key, r = NAMES.journal("resp"), client.transport.redis
    header = Outgoing(key, encode(JournalHeader("resp", "completion", "{}", "tiny", 1, 10, [1])), None, client.journal_ttl_ms)
    h = await client.submit("resp", [1], SAMPLING, "resp", journal=[header])
    await r.pexpire(key, 500)  # as if its last write were nearly a window ago
    await client.watch.keep_journals()
    assert 0 < await r.pttl(key) <= 500  # written less than a quarter window ago: left alone
    h.journaled_at -= 2.5  # idle for more than 8 s / 4
    await client.watch.keep_journals()
    assert await r.pttl(key) > 7_000
    await r.pexpire(key, 500)
    await client.watch.keep_journals()
    assert await r.pttl(key) <= 500  # just refreshed: not again at every tick
    h.done, h.journaled_at = True, h.journaled_at - 2.5
    await client.watch.keep_journals()
    assert await r.pttl(key) <= 500


@async_test
async def test_unknown_request_with_all_tokens_finishes_with_length() -> None:
    client = make_client()
    await publish(client, engine("s0"))
    h = await client.submit("r", [1], {"temperature": 0.0, "max_tokens": 2})
    await dispatch_steps(client, outputs(("r", 0, [4, 5])))
    await dispatch_steps(client, outputs(("r", 0, [], True, "unknown")))  # the final output was lost
    events = drain(h)
    assert tokens_of(events) == [4, 5] and events[-1].finished and events[-1].finish_reason == "length"
    assert [type(m) for m in await sent(client, "s0")] == [GenerateRequest]  # not resubmitted


# -- adopting a journaled stream -------------------------------------------------------------------------
@async_test
async def test_adopt_replays_journal_in_order_up_to_a_gap_and_syncs() -> None:
    client = make_client("g2")
    await publish(client, engine("s1"))
    journaled = [
        outputs(("resp", 0, [5, 6])),
        outputs(("resp", 1, [6, 7])),  # overlap: 6 is a duplicate
        outputs(("resp~1", 3, [8, 9])),  # the next attempt
        outputs(("resp~1", 7, [12])),  # a gap: 5 and 6 were lost with the old gateway
        outputs(("resp~1", 8, [13])),
    ]
    h = await client.adopt("resp", [1, 2], SAMPLING, Route("resp~1", "s1"), journaled)
    events = drain(h)
    assert tokens_of(events) == [5, 6, 7, 8, 9] and h.output_token_ids == [5, 6, 7, 8, 9]
    assert not any(e.finished for e in events)
    assert (h.engine_request_id, h.scheduler_id, h.incarnation, h.attempts, h.journal_id) == ("resp~1", "s1", "inc-s1", 2, "resp")
    assert client.requests["resp"] is h and client.attempts["resp~1"] is h
    assert await sent(client, "s1") == [SyncRequest("resp~1", "g2", 5)]
    # The resend arrives: it continues the stream without duplicates.
    await dispatch_steps(client, outputs(("resp~1", 5, [10, 11, 12])))
    assert tokens_of(drain(h)) == [10, 11, 12]


@async_test
async def test_a_stream_resumed_where_its_client_hung_up_sends_no_abort_after_its_sync() -> None:
    """The client hung up on this gateway (its abort queued) and resumes here at once. The engine
    cannot tell that abort from a later one by its gateway, so it must not follow the sync: a
    queued one is dropped, and the sync waits for one already on its way."""
    client = make_client("g1")
    await publish(client, engine("s1"))
    journaled = [outputs(("resp", 0, [5]))]
    client.aborts.add("s1", "resp")  # the hang-up; not sent yet
    client.aborts.add("s1", "other")
    await client.adopt("resp", [1, 2], SAMPLING, Route("resp", "s1"), journaled)
    await client.aborts.flush("client")
    assert await sent(client, "s1") == [SyncRequest("resp", "g1", 1), AbortRequests(["other"], "client", "g1")]
    client.release("resp")

    # An abort already on its way when the client resumes: the sync leaves after it.
    slow, real = asyncio.Event(), client.transport.send_many

    async def send_many(sends: list[Outgoing], deadline_s: float | None = None) -> None:
        if any(isinstance(decode(out.data), AbortRequests) for out in sends):
            await slow.wait()
        await real(sends, deadline_s)

    client.transport.send_many = send_many  # type: ignore[method-assign]
    client.aborts.add("s1", "resp")
    flushing = asyncio.create_task(client.aborts.flush("client"))
    await asyncio.sleep(0)
    adopting = asyncio.create_task(client.adopt("resp", [1, 2], SAMPLING, Route("resp", "s1"), journaled))
    await asyncio.sleep(0.05)
    assert not adopting.done()  # waiting for the abort to be in the engine's stream
    slow.set()
    await flushing
    await adopting
    assert (await sent(client, "s1"))[2:] == [AbortRequests(["resp"], "client", "g1"), SyncRequest("resp", "g1", 1)]

    # One that does not get through (Redis away): the resume fails after the deadline, as its sync would.
    slow.clear()
    client.aborts.add("s1", "next")
    flushing = asyncio.create_task(client.aborts.flush("client"))
    await asyncio.sleep(0)
    with pytest.raises(asyncio.TimeoutError):
        await client.aborts.withdraw("s1", "next", deadline_s=0.05)
    flushing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await flushing


@async_test
async def test_a_redis_restart_seen_by_a_refresh_that_fails_is_synced_by_the_next_one() -> None:
    client = make_client()
    await publish(client, engine("a"))
    handle = await client.submit("r0", [1], SAMPLING)
    send_many = client.transport.send_many
    before = [m.request_id for m in await sent(client, "a")]

    async def refused(*args: object, **kwargs: object) -> None:
        raise redis.ConnectionError("Redis is loading")

    client.run_id = "the run before the restart"
    client.transport.send_many = refused  # type: ignore[method-assign]
    with pytest.raises(redis.ConnectionError):
        await client.watch.refresh()  # sees the restart, cannot send the resend requests
    assert client.resync_why == "Redis restarted" and handle.sync_from == -1
    client.transport.send_many = send_many  # type: ignore[method-assign]
    await client.watch.refresh()  # the same run id now: the restart is not news, but the resend is still owed
    syncs = (await sent(client, "a"))[len(before) :]
    assert [(type(m).__name__, m.request_id) for m in syncs] == [("SyncRequest", handle.engine_request_id)]
    assert client.resync_why is None


@async_test
async def test_adopt_a_finished_journal_without_registering() -> None:
    client = make_client("g2")
    await publish(client, engine("s0"))
    journaled = [outputs(("resp", 0, [5, 6])), outputs(("resp", 2, [7], True, "stop"))]
    h = await client.adopt("resp", [1, 2], SAMPLING, Route("resp", "s0"), journaled)
    events = drain(h)
    assert tokens_of(events) == [5, 6, 7] and events[-1].finished and events[-1].finish_reason == "stop" and h.done
    assert client.requests == {} and client.attempts == {}
    assert await sent(client, "s0") == []


def test_a_late_writers_entries_give_way_to_the_adopters() -> None:
    """Gateway A lost its client; B read the journal (up to token 3), adopted the stream and
    streamed from there while A still journaled two more steps. The journal replays as B streamed,
    so a client that followed B resumes from B's event ids: nothing twice, nothing missing."""
    read_by_b = [outputs(("resp", 0, [5, 6])), outputs(("resp", 2, [7]))]
    late_a = [outputs(("resp", 3, [8])), outputs(("resp", 4, [9]))]
    by_b = [outputs(("resp", 3, [8, 9, 10])), outputs(("resp", 6, [11], True, "length"))]
    handle = RequestHandle("resp", [1], SAMPLING)
    events = replay(handle, read_by_b + late_a + by_b)
    assert [e.token_ids for e in events] == [[5, 6], [7], [8, 9, 10], [11]]
    assert events[-1].finished and handle.output_token_ids == [5, 6, 7, 8, 9, 10, 11]
    # A's late entries may reach the end first: B's entries still replace them.
    late_to_the_end = [outputs(("resp", 3, [8])), outputs(("resp", 4, [9, 10, 11], True, "length"))]
    events = replay(RequestHandle("resp", [1], SAMPLING), read_by_b + late_to_the_end + by_b)
    assert [e.token_ids for e in events] == [[5, 6], [7], [8, 9, 10], [11]] and events[-1].finish_reason == "length"
    # One writer alone: nothing is replaced, and nothing follows the end.
    alone = read_by_b + late_to_the_end + [outputs(("resp", 7, [12]))]
    assert [e.token_ids for e in replay(RequestHandle("resp", [1], SAMPLING), alone)] == [[5, 6], [7], [8], [9, 10, 11]]


def test_a_second_adopter_replays_past_the_first_ones_gap() -> None:
    """Gateway A was killed with steps 2-4 read from its outputs stream but never journaled; the
    scheduler journaled steps 5-6 as orphans. B replayed up to the gap, asked for a resend from 2
    and journaled what it streamed. B dies too: C must replay the events as B delivered them (A's
    two, then B's), not stop at the orphans' gap and renumber the rest, which would make a client
    that resumes from B's event ids miss tokens (or see them twice)."""
    by_a = [outputs(("resp", 0, [5])), outputs(("resp", 1, [6]))]
    orphaned = [outputs(("resp", 5, [10])), outputs(("resp", 6, [11]))]
    by_b = [outputs(("resp", 2, [7, 8, 9, 10, 11])), outputs(("resp", 7, [12])), outputs(("resp", 8, [13]))]
    b = RequestHandle("resp", [1], SAMPLING)
    assert [e.token_ids for e in replay(b, by_a + orphaned)] == [[5], [6]] and b.next_index == 2  # B syncs from 2
    c = RequestHandle("resp", [1], SAMPLING)
    events = replay(c, by_a + orphaned + by_b)
    assert [e.token_ids for e in events] == [[5], [6], [7, 8, 9, 10, 11], [12], [13]]
    assert c.output_token_ids == [5, 6, 7, 8, 9, 10, 11, 12, 13]
    # A late writer's entry that only repeats delivered tokens is no event of its own.
    one_event = [outputs(("resp", 0, [5, 6]))]
    late = [outputs(("resp", 1, [6]))]
    d = RequestHandle("resp", [1], SAMPLING)
    assert [e.token_ids for e in replay(d, one_event + late + by_b)] == [[5, 6], [7, 8, 9, 10, 11], [12], [13]]


def test_replay_skips_a_superseded_attempts_entries_and_keeps_an_orphans_error() -> None:
    """The request moved to a second attempt (``resp~1``) while its first engine only looked
    gone: that engine's late entries for ``resp`` are not the stream's. An engine's error while
    the stream was orphaned is journaled at index 0 with no tokens: it ends the stream and
    replaces none of its events."""
    journal = [
        outputs(("resp", 0, [5])),
        outputs(("resp", 1, [6])),
        outputs(("resp~1", 2, [7])),
        outputs(("resp~1", 5, [10])),  # an orphan past a gap
        outputs(("resp", 3, [99, 98])),  # the first engine, late
    ]
    h = RequestHandle("resp", [1], SAMPLING)
    assert [e.token_ids for e in replay(h, journal)] == [[5], [6], [7]] and h.next_index == 3
    failed = [*journal[:3], outputs(("resp~1", 0, [], True, "error", "engine error: boom"))]
    h = RequestHandle("resp", [1], SAMPLING)
    events = replay(h, failed)
    assert [e.token_ids for e in events] == [[5], [6], [7], []] and h.output_token_ids == [5, 6, 7]
    assert events[-1].finished and events[-1].error == "engine error: boom"


@async_test
async def test_journal_written_by_one_gateway_is_adopted_by_another() -> None:
    server = fakeredis.FakeServer()
    g1, g2 = make_client("g1", server), make_client("g2", server)
    await publish(g1, engine("s0"))
    await g2.watch.refresh()
    header = JournalHeader("resp", "completion", '{"prompt": "hi"}', "tiny", 7, 10, [1, 2], "hi")
    h1 = await g1.submit("resp", [1, 2], SAMPLING, "resp", journal=[Outgoing(NAMES.journal("resp"), encode(header))])
    await dispatch_steps(g1, outputs(("resp", 0, [5, 6])))
    await dispatch_steps(g1, outputs(("resp", 2, [7])))
    assert tokens_of(drain(h1)) == [5, 6, 7]
    # g1 dies; the client reconnects to g2, which reads the journal and takes the stream over.
    read = await read_journal(g2, "resp")
    got_header, route = read.single()
    assert got_header == header and route == Route("resp", "s0") and read.headers == [header]
    h2 = await g2.adopt("resp", got_header.prompt_token_ids, SAMPLING, route, read.outputs)
    assert tokens_of(drain(h2)) == [5, 6, 7]
    assert [m for m in await sent(g2, "s0") if isinstance(m, SyncRequest)] == [SyncRequest("resp", "g2", 3)]
    # g2 journals what it delivers from now on, so a third gateway could resume it too.
    await dispatch_steps(g2, outputs(("resp", 3, [8], True, "length")))
    assert tokens_of(drain(h2)) == [8] and h2.done
    journaled = (await read_journal(g2, "resp")).outputs
    assert [t for m in journaled for t in m.token_ids] == [5, 6, 7, 8] and journaled[-1].finished == [True]


@async_test
async def test_a_stream_resumes_twice_after_its_engine_journaled_it_as_an_orphan() -> None:
    """The real gateway and scheduler sides on one Redis: g1 is killed with steps it read but did
    not journal, the scheduler declares it dead and journals the next steps as orphans, g2 adopts
    (its replay ends at the gap, the engine resends from there), then g2 is killed too: g3 replays
    the journal into the very events g2 delivered, so event ids stay valid across both moves."""
    server = fakeredis.FakeServer()
    g1, g2, g3 = make_client("g1", server), make_client("g2", server), make_client("g3", server)
    redis = g1.transport.redis
    await publish(g1, engine("s0"))
    for g in (g2, g3):
        await g.watch.refresh()
    router = OutputRouter(NAMES, resume_window_s=30.0, max_message_bytes=1 << 20)
    router.add("resp", "g1", "resp")
    request = Request("resp", [1, 2], SamplingParams(temperature=0, max_tokens=10))

    async def step(*new: int) -> list[Outgoing]:  # the engine samples ``new``; the router says where it goes
        request.output_token_ids.extend(new)
        request.output_logprobs.extend([None] * len(new))
        sends = router.route([StepOutput("resp", list(new), [None] * len(new), False, None, request.num_output_tokens)])
        for o in sends:
            await redis.xadd(o.stream, {ENTRY_FIELD: o.data})
        return sends

    header = JournalHeader("resp", "completion", '{"prompt": "hi"}', "tiny", 7, 10, [1, 2], "hi")
    h1 = await g1.submit("resp", [1, 2], SAMPLING, "resp", journal=[Outgoing(NAMES.journal("resp"), encode(header))])
    for t in (5, 6):
        await dispatch_steps(g1, decode((await step(t))[0].data))
    assert tokens_of(drain(h1)) == [5, 6]
    for t in (7, 8, 9):
        await step(t)  # into g1's outputs stream: g1 is dead and never journals them
    assert router.gateway_died("g1", now=0.0) == []
    for t in (10, 11):
        assert [o.stream for o in await step(t)] == [NAMES.journal("resp")]  # orphans
    read = await read_journal(g2, "resp")
    h2 = await g2.adopt("resp", [1, 2], SAMPLING, read.single()[1], read.outputs)
    assert [m for m in await sent(g2, "s0") if isinstance(m, SyncRequest)] == [SyncRequest("resp", "g2", 2)]
    await dispatch_steps(g2, decode(router.adopt(request, "resp", "g2", 2)[-1].data))  # the resend
    for t in (12, 13):
        await dispatch_steps(g2, decode((await step(t))[0].data))
    delivered_by_g2 = [e.token_ids for e in drain(h2)]
    assert delivered_by_g2 == [[5], [6], [7, 8, 9, 10, 11], [12], [13]]
    # g2 is killed; the client resumes on g3.
    read = await read_journal(g3, "resp")
    h3 = await g3.adopt("resp", [1, 2], SAMPLING, read.single()[1], read.outputs)
    assert [e.token_ids for e in drain(h3)] == delivered_by_g2
    assert [m for m in await sent(g3, "s0") if isinstance(m, SyncRequest)][-1] == SyncRequest("resp", "g3", 9)


@async_test
async def test_a_request_with_a_priority_goes_only_to_an_engine_that_takes_it() -> None:
    """In a deployment that mixes scheduling policies, a priority only reaches an engine with the
    priority policy (an fcfs one would refuse the request, a migration included); none: no engine."""
    client = make_client()
    busy = engine("p", running=9)
    busy.scheduling_policy = "priority"
    await publish(client, busy, engine("f"))
    assert client.pick_engine().scheduler_id == "f"  # the least loaded
    assert client.pick_engine(priority=-2).scheduler_id == "p"
    fcfs_only = make_client()
    await publish(fcfs_only, engine("f"))
    assert fcfs_only.pick_engine(priority=1) is None and fcfs_only.pick_engine().scheduler_id == "f"


@async_test
async def test_priority_and_cache_salt_go_with_every_attempt() -> None:
    """A request's priority and cache salt are sent with its first attempt and again with the next
    (a migration: `_route` once more, to another engine), tokens so far included."""
    client = make_client()
    first, second = engine("p1", running=0), engine("p2", running=5)
    first.scheduling_policy = second.scheduling_policy = "priority"
    await publish(client, first, second)
    h = await client.submit("r", [1, 2, 3], SAMPLING, priority=-4, cache_salt="tenant-salt")
    await dispatch_steps(client, outputs(("r", 0, [7])))
    [msg] = await sent(client, "p1")
    assert (msg.priority, msg.cache_salt) == (-4, "tenant-salt")
    await publish(client, engine("p1", executor=""))  # p1 loses its executor: the request moves
    assert await client._route(h, [])
    [moved] = await sent(client, "p2")
    assert (moved.priority, moved.cache_salt, moved.output_token_ids) == (-4, "tenant-salt", [7])


@async_test
async def test_a_stopped_gateways_outputs_stream_keeps_its_ttl() -> None:
    """A scheduler renews an outputs stream's TTL once per eighth of it, so a stream deleted under
    it and made again by its next write would have none; the outputs of a step in flight still
    reach a gateway that just stopped (before its aborts are applied), and its stream must expire."""
    server = fakeredis.FakeServer()
    client = make_client(server=server)
    scheduler = SyncTransport("redis://unused", NAMES, owner="scheduler")
    scheduler.redis = fakeredis.FakeRedis(server=server)
    stream = client.outputs_stream
    step = Outgoing(stream, encode(outputs(("r", 0, [5]))), 100, OUTPUTS_TTL_MS)
    scheduler.exchange([step])  # renews the stream's TTL
    await client.stop()
    scheduler.exchange([step])  # a step in flight when the gateway stopped
    assert 0 < await fakeredis.FakeAsyncRedis(server=server).pttl(stream) <= renewed_ttl_ms(OUTPUTS_TTL_MS)
