"""Wire protocol: round trips, rejection of malformed messages, dead-lettering, and steps (a
`SchedulerOutput` is a delta the executor's `PersistentBatch` turns into each batch)."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import fakeredis
import msgpack
import numpy as np
import pytest

from common.codec import pack_logprobs, unpack_logprobs
from common.protocol import (
    PROTOCOL_VERSION,
    AbortRequests,
    BindExecutor,
    EngineStatus,
    ExecutorHello,
    GenerateRequest,
    JournalHeader,
    Names,
    ProtocolError,
    Route,
    SchedulerOutput,
    StepOutputs,
    StepResult,
    SyncRequest,
    decode,
    encode,
)
from common.sampling_params import SamplingParams
from common.transport import Transport
from executor.input_batch import Batch, PersistentBatch

pytestmark = pytest.mark.unit

V = PROTOCOL_VERSION  # raw messages below are of this build's version


def _req(
    request_id: str = "r", prompt: list[int] | None = None, output: list[int] | None = None, journal_id: str = ""
) -> GenerateRequest:
    return GenerateRequest(
        request_id,
        "g1",
        "s0",
        "inc1",
        [1, 2] if prompt is None else prompt,
        [] if output is None else output,
        {"temperature": 0.0, "max_tokens": 4},
        12.5,
        journal_id,
    )


def _engine_status(**kw: object) -> EngineStatus:
    base: dict[str, object] = dict(
        scheduler_id="s0",
        incarnation="inc1",
        model_name="tiny",
        model_path="/m",
        max_model_len=2048,
        vocab_size=1024,
        block_size=16,
        num_blocks=100,
        executor_id="e1",
        epoch=17,
        num_free_blocks=90,
        num_running=3,
        num_waiting=2,
        num_steps=1234,
        num_preemptions=1,
        num_dead_letters=0,
        updated_at=1.5e9,
    )
    base.update(kw)
    return EngineStatus(**base)  # type: ignore[arg-type]


def test_round_trip_every_type() -> None:
    outputs = StepOutputs()
    outputs.add("x", 4, [9, 10], None, True, "length")
    step = SchedulerOutput(step=7, epoch=3, finished_req_ids=["gone"])
    step.add_new("n", SamplingParams(temperature=0.5, seed=2**40, stop_token_ids=[3]), 2, [1, 2, 2**31 - 1], [4, 5])
    step.add_cached("c", True, [7, 8])
    step.add_scheduled("n", 3, 0, True)
    step.add_scheduled("c", 1, 9, True)
    msgs = [
        _req("r1", [1, 2, 3, 2**31 - 1], [7, 8], journal_id="resp-1"),
        _req("r2"),  # no earlier output, not resumable
        AbortRequests(["a", "b"], "client"),
        SyncRequest("r1~2", "g2", 5),
        ExecutorHello("e1", "tiny", "/m", 100, 16, 2048, 1024, [1, 2]),
        ExecutorHello("e2", "gemma3", "/g", 200, 16, 2048, 1024, [1], 0, [0, 512]),
        BindExecutor("e1", "s0", 42),
        StepResult(3, 7, [5, -1], [2, -1], [5, 6], [-0.5, -1.25], None, 0.01),
        StepResult(3, 8, error="boom"),
        outputs.sealed(),
        StepOutputs(["x"], [4], [2], [9, 10], [True], ["length"], [None], [-1, -1], [], []),
        _engine_status(),
        _engine_status(executor_id="", model_name="", step_wall_s=1.25, step_forward_s=0.5, step_count=9),
        JournalHeader("resp-1", "chat", '{"messages": []}', "tiny", 1700000000, 16, [1, 2, 3], None),
        JournalHeader("resp-2", "completion", '{"prompt": "hi"}', "tiny", 1700000001, 8, [4], "hi"),
        Route("resp-1~1", "s1"),
        step,
        SchedulerOutput(),
    ]
    for msg in msgs:
        back = decode(encode(msg))
        assert type(back) is type(msg) and back == msg


def test_engine_status_load() -> None:
    status = decode(encode(_engine_status(num_waiting=2, num_running=3)))
    assert status.load == 4 * 2 + 3


def test_journal_header_echo_text() -> None:
    for echo in (None, "", "Once upon a time"):
        msg = JournalHeader("resp", "completion", "{}", "tiny", 1, 4, [1], echo)
        assert decode(encode(msg), expected=(JournalHeader,)).echo_text == echo
    body = msgpack.unpackb(encode(JournalHeader("resp", "chat", "{}", "tiny", 1, 4, [1, 2])), raw=False)
    assert body["t"] == "jhead" and isinstance(body["prompt_token_ids"], bytes) and body["echo_text"] is None
    bad = dict(body, echo_text=5)
    with pytest.raises(ProtocolError, match="JournalHeader.echo_text: expected"):
        decode(msgpack.packb(bad, use_bin_type=True))


def test_step_outputs_add_and_sealed() -> None:
    # No request asks for logprobs: the columns are dropped, and the reader sees none.
    plain = StepOutputs()
    plain.add("a", 0, [5, 6], None)
    plain.add("b", 3, [7], [None], True, "stop")
    plain.add("c", 0, [], None, True, "error", "it broke")
    assert plain.lp_counts == [-1, -1, -1]  # one per token until sealed
    sealed = decode(encode(plain.sealed()))
    assert sealed.request_ids == ["a", "b", "c"]
    assert sealed.token_index == [0, 3, 0] and sealed.num_tokens == [2, 1, 0] and sealed.token_ids == [5, 6, 7]
    assert sealed.finished == [False, True, True] and sealed.finish_reasons == [None, "stop", "error"]
    assert sealed.errors == [None, None, "it broke"]
    assert sealed.lp_counts == [] and sealed.lp_token_ids == [] and sealed.lp_values == []
    # One request with logprobs: every token keeps its column entry (-1 for those without).
    mixed = StepOutputs()
    mixed.add("a", 0, [5, 6], None)
    mixed.add("b", 1, [7, 8], [{7: -0.5, 3: -1.5}, None])
    back = decode(encode(mixed.sealed()))
    assert back.lp_counts == [-1, -1, 2, -1]
    assert unpack_logprobs(back.lp_counts, back.lp_token_ids, back.lp_values) == [None, None, {7: -0.5, 3: -1.5}, None]
    # Logprobs asked for but all None: nothing to carry.
    none = StepOutputs()
    none.add("a", 0, [5], [None])
    assert decode(encode(none.sealed())).lp_counts == []


def test_token_ids_travel_packed() -> None:
    data = encode(_req(prompt=list(range(1000)), output=list(range(500))))
    body = msgpack.unpackb(data, raw=False)
    assert isinstance(body["prompt_token_ids"], bytes) and len(body["prompt_token_ids"]) == 4000
    assert isinstance(body["output_token_ids"], bytes) and len(body["output_token_ids"]) == 2000
    fixed = len(encode(_req(prompt=[], output=[])))  # the other fields (the sampling map: ~400 bytes)
    assert len(data) - fixed <= 4 * 1500 + 8  # columnar + packed: 4 bytes per token


_MISSING = object()  # a field left out of a raw message


def _raw_req(**overrides: object) -> bytes:
    body: dict[str, object] = {
        "v": V,
        "t": "req",
        "request_id": "r",
        "gateway_id": "g",
        "scheduler_id": "s0",
        "incarnation": "i",
        "prompt_token_ids": b"\x01\x00\x00\x00",
        "output_token_ids": b"",
        "sampling": {},
        "arrival_time": 0.0,
        "journal_id": "",
        "group_id": "",
        "priority": 0,
        "cache_salt": "",
    }
    body.update(overrides)
    return msgpack.packb({k: v for k, v in body.items() if v is not _MISSING}, use_bin_type=True)


def test_raw_request_helper_is_valid() -> None:
    assert decode(_raw_req()) == GenerateRequest("r", "g", "s0", "i", [1], [], {}, 0.0, "")


@pytest.mark.parametrize(
    "data, error",
    [
        (b"\xc1garbage", "not a msgpack message"),
        (msgpack.packb([1, 2, 3]), "must be a msgpack map"),
        (msgpack.packb({"v": 99, "t": "abort"}), "unsupported protocol version 99"),
        (msgpack.packb({"v": 1, "t": "abort"}), "unsupported protocol version 1"),  # before `SchedulerOutput`
        (msgpack.packb({"v": V, "t": "nope"}), "unknown message type 'nope'"),
        (msgpack.packb({"v": V, "t": "abort", "reason": "x"}), "missing field 'request_ids'"),
        (msgpack.packb({"v": V, "t": "abort", "request_ids": "abc", "reason": "x"}), "AbortRequests.request_ids: expected"),
        (msgpack.packb({"v": V, "t": "abort", "request_ids": [1], "reason": "x"}), "expected"),
        (
            msgpack.packb({"v": V, "t": "abort", "request_ids": [], "reason": "x", "gateway_id": "", "evil": 1}),
            "unknown fields ['evil']",
        ),
        (_raw_req(prompt_token_ids=b"abc"), "GenerateRequest.prompt_token_ids: packed array of 3 bytes is not a multiple of 4"),
        (_raw_req(prompt_token_ids=[1, 2]), "GenerateRequest.prompt_token_ids: expected packed bytes"),
        (_raw_req(output_token_ids=[3]), "GenerateRequest.output_token_ids: expected packed bytes"),
        (_raw_req(output_token_ids=b"\x01\x00"), "GenerateRequest.output_token_ids: packed array of 2 bytes"),
        (_raw_req(scheduler_id=_MISSING), "GenerateRequest: missing field 'scheduler_id'"),
        (_raw_req(journal_id=_MISSING), "GenerateRequest: missing field 'journal_id'"),
        (_raw_req(incarnation=7), "GenerateRequest.incarnation: expected str"),
        (_raw_req(sampling=[1]), "GenerateRequest.sampling: expected"),
        (_raw_req(arrival_time="now"), "GenerateRequest.arrival_time: expected float"),
        (_raw_req(queue="q"), "GenerateRequest: unknown fields ['queue']"),
        (
            msgpack.packb({"v": V, "t": "sync", "request_id": "r", "gateway_id": "g", "from_index": 1.5}),
            "SyncRequest.from_index: expected int",
        ),
        (
            msgpack.packb({"v": V, "t": "sync", "request_id": "r", "gateway_id": "g", "from_index": True}),
            "SyncRequest.from_index: expected int",
        ),
        (msgpack.packb({"v": V, "t": "route", "request_id": "r"}), "Route: missing field 'scheduler_id'"),
    ],
)
def test_decode_rejects_malformed(data: bytes, error: str) -> None:
    with pytest.raises(ProtocolError, match=error.replace("[", r"\[").replace("]", r"\]")):
        decode(data)


def test_size_limits_and_expected_type() -> None:
    big = _req(prompt=[1] * 10_000)
    with pytest.raises(ProtocolError, match="over the 1000-byte limit"):
        encode(big, max_bytes=1000)
    with pytest.raises(ProtocolError, match="over the 1000-byte limit"):
        decode(encode(big), max_bytes=1000)
    with pytest.raises(ProtocolError, match="unexpected message type AbortRequests"):
        decode(encode(AbortRequests(["a"])), expected=(GenerateRequest,))
    with pytest.raises(ProtocolError, match="not a protocol message type"):
        encode(SamplingParams())


def test_logprob_columns_round_trip() -> None:
    entries = [None, {3: -0.1, 7: -2.5}, {}, None, {1: -0.0}]
    assert unpack_logprobs(*pack_logprobs(entries)) == entries


def test_garbage_is_dead_lettered_and_reader_continues() -> None:
    async def run() -> None:
        names = Names("t-dead")
        stream = names.requests("0")
        t = Transport("redis://unused", names, owner="test")
        t.redis = fakeredis.FakeAsyncRedis()
        await t.send_raw(stream, b"\x00not msgpack")
        await t.redis.xadd(stream, {b"other": b"field"})
        good = _req("r1")
        good_id = await t.send(stream, good)
        await t.send(stream, AbortRequests(["r0"]))  # valid, but not a type this reader takes
        cursors: dict[str, bytes | str] = {stream: "0-0"}
        got = await t.read(cursors, block_ms=None, expected=(GenerateRequest, SyncRequest))
        assert [(s, i, m) for s, i, m in got] == [(stream, good_id, good)]
        last = (await t.redis.xrevrange(stream, count=1))[0][0]
        assert cursors[stream] == last  # past the bad entries too: they are never read again
        dead = await t.redis.xrange(names.dead_letter)
        reasons = [fields[b"reason"].decode() for _, fields in dead]
        assert len(reasons) == 3
        assert "not a msgpack message" in reasons[0] and "no 'm' field" in reasons[1]
        assert "unexpected message type AbortRequests" in reasons[2]
        assert all(fields[b"stream"].decode() == stream and fields[b"by"] == b"test" for _, fields in dead)
        assert dead[0][1][b"raw:m"] == b"\x00not msgpack"  # the raw entry is kept for inspection
        assert t.num_dead_letters == 3
        # The reader continues: later entries are read from the advanced cursor.
        later = SyncRequest("r1", "g", 2)
        await t.send(stream, later)
        got = await t.read(cursors, block_ms=None, expected=(GenerateRequest, SyncRequest))
        assert [m for _, _, m in got] == [later]
        assert await t.read(cursors, block_ms=None) == []
        assert t.num_dead_letters == 3

    asyncio.run(run())


def test_columns_that_disagree_are_dead_lettered_alone() -> None:
    """A `StepOutputs` (or `StepResult`) whose columns disagree, or that carries negative token
    ids, is rejected at decode: dead-lettered by itself, while the good messages of the same read
    go on. Raising while the gateway routes the read (IndexError, or OverflowError in the
    detokenizer) would drop every output in that read, other requests' included."""
    bad_outputs = [
        StepOutputs(["a", "b"], [0], [1], [5], [False], [None], [None]),  # two requests, one row of columns
        StepOutputs(["a"], [0], [2], [5], [False], [None], [None]),  # 2 tokens said, 1 given
        StepOutputs(["a"], [0], [1], [-5], [False], [None], [None]),  # a negative token id
        StepOutputs(["a"], [0], [1], [5], [False], [None], [None], lp_counts=[3], lp_token_ids=[1], lp_values=[]),
    ]
    bad_results = [StepResult(1, 2, [5], lp_counts=[3], lp_token_ids=[1], lp_values=[]), StepResult(1, 2, [5, 6], plp_num=[1])]
    for msg in [*bad_outputs, *bad_results]:
        with pytest.raises(ProtocolError):
            decode(encode(msg))

    async def run() -> None:
        names = Names("t-columns")
        stream = names.outputs("g")
        t = Transport("redis://unused", names, owner="test")
        t.redis = fakeredis.FakeAsyncRedis()
        good = StepOutputs()
        good.add("legit", 0, [7, 8], None)
        for msg in [bad_outputs[0], good.sealed(), bad_outputs[2]]:
            await t.send(stream, msg)
        got = await t.read({stream: "0-0"}, block_ms=None, expected=(StepOutputs,))
        assert [m for _, _, m in got] == [good] and t.num_dead_letters == 2

    asyncio.run(run())


# -- steps: the executor rebuilds each batch from its state and the step's delta -----------------
def _wire(output: SchedulerOutput) -> SchedulerOutput:
    back = decode(encode(output), expected=(SchedulerOutput,))
    assert type(back) is SchedulerOutput and back == output
    return back


def _columns() -> SimpleNamespace:
    """A `Batch`'s columns as lists, to append to and then pass to `Batch`."""
    names = "request_ids input_ids positions slot_mapping query_lens seq_lens block_tables sample output_lens sampling_params"
    return SimpleNamespace(**{name: [] for name in names.split()})


def _batch(rows: list[tuple[str, list[int], int, int, list[int], int, SamplingParams]], bs: int) -> Batch:
    """rows: (id, every token the executor knows, start, end, block table, prompt length, params)."""
    b = _columns()
    for rid, tokens, start, end, table, num_prompt, params in rows:
        b.request_ids.append(rid)
        b.input_ids.extend(tokens[start:end])
        b.positions.extend(range(start, end))
        b.slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        b.query_lens.append(end - start)
        b.seq_lens.append(end)
        b.block_tables.append(table[: -(-end // bs)])  # the blocks the step reads
        b.sample.append(end == len(tokens))
        b.output_lens.append(len(tokens) - num_prompt)
        b.sampling_params.append(params)
    return Batch(**vars(b))


def same_inputs(a: Batch, b: Batch) -> bool:
    """Whether two batches give the forward pass and the sampler the same inputs."""
    arrays = ("input_ids", "positions", "slot_mapping", "query_lens", "seq_lens", "block_tables", "sample", "output_lens")
    return (
        a.request_ids == b.request_ids
        and all(np.array_equal(getattr(a, k), getattr(b, k)) for k in arrays)
        and a.sampling_params == b.sampling_params
        and a.token_counts == b.token_counts
        and (a.prompt_lp, a.prompt_lp_targets, a.num_groups) == (b.prompt_lp, b.prompt_lp_targets, b.num_groups)
    )


def test_steps_rebuild_batches_and_stay_small() -> None:
    bs = 4
    executor = PersistentBatch(bs, vocab_size=1000)
    rng = random.Random(0)
    tokens = {r: [rng.randrange(1000) for _ in range(n)] for r, n in (("a", 6), ("b", 6), ("c", 5))}
    prompt = {r: list(t) for r, t in tokens.items()}
    params = {
        "a": SamplingParams(temperature=0.0, max_tokens=8),
        "b": SamplingParams(top_k=5, seed=7),
        "c": SamplingParams(temperature=0.5, stop_token_ids=[3], logprobs=2),
    }
    tables = {"a": [0, 1], "b": [10], "c": [20, 21]}

    def run(output: SchedulerOutput, rows: list[tuple[str, int, int]]) -> SchedulerOutput:
        """Send ``output`` over the wire; the batch must be ``rows`` (id, start, end) of what the
        executor knows; then the executor samples a token for each row that reaches its end."""
        wire = _wire(output)
        batch = executor.prepare(wire)
        batch.check()
        want = _batch([(r, tokens[r], s, e, tables[r], len(prompt[r]), params[r]) for r, s, e in rows], bs)
        assert same_inputs(batch, want)
        sampled = [rng.randrange(1000) if smp else -1 for smp in batch.sample]
        executor.append_sampled(batch, sampled)
        for r, t in zip(batch.request_ids, sampled):
            if t >= 0:
                tokens[r].append(t)
        return wire

    # 1: two new requests (whole prompts and tables); a computes its prompt, b a first chunk.
    out = SchedulerOutput(step=1, epoch=3)
    out.add_new("a", params["a"], 6, prompt["a"], tables["a"])
    out.add_new("b", params["b"], 6, prompt["b"], tables["b"])
    out.add_scheduled("a", 6, 0, True)
    out.add_scheduled("b", 3, 0, False)
    wire = run(out, [("a", 0, 6), ("b", 0, 3)])
    assert wire.new_token_ids == prompt["a"] + prompt["b"] and wire.new_block_ids == [0, 1, 10]
    assert len(tokens["a"]) == 7 and len(tokens["b"]) == 6  # a sampled; b's chunk did not
    # 2: a decodes (its table of 2 blocks holds position 6), b's rest needs a new block.
    out = SchedulerOutput(step=2, epoch=3)
    tables["b"].append(11)
    out.add_cached("b", False, [11])
    out.add_scheduled("a", 1, 6, True)
    out.add_scheduled("b", 3, 3, True)
    wire = run(out, [("a", 6, 7), ("b", 3, 6)])
    assert wire.new_req_ids == [] and wire.new_token_ids == []  # no token id travels: the executor has them
    assert (wire.cached_req_ids, wire.cached_resumed, wire.cached_block_ids) == (["b"], [False], [11])
    # 3: two decodes, no table grows: nothing but ids and counts; and a new request c.
    out = SchedulerOutput(step=3, epoch=3)
    out.add_new("c", params["c"], 5, prompt["c"], tables["c"])
    out.add_scheduled("a", 1, 7, True)
    out.add_scheduled("b", 1, 6, True)
    out.add_scheduled("c", 5, 0, True)
    wire = run(out, [("a", 7, 8), ("b", 6, 7), ("c", 0, 5)])
    assert wire.new_token_ids == prompt["c"] and wire.cached_req_ids == [] and wire.cached_block_ids == []
    # 4: decodes only; a's position 8 opens its third block, which alone is sent.
    out = SchedulerOutput(step=4, epoch=3)
    tables["a"].append(2)
    out.add_cached("a", False, [2])
    for r, n in (("a", 8), ("b", 7), ("c", 5)):
        out.add_scheduled(r, 1, n, True)
    wire = run(out, [("a", 8, 9), ("b", 7, 8), ("c", 5, 6)])
    assert wire.new_token_ids == [] and wire.cached_block_ids == [2]
    body = msgpack.unpackb(encode(wire), raw=False)
    assert body["new_token_ids"] == b"" and body["num_computed_tokens"] == b"\x08\0\0\0\x07\0\0\0\x05\0\0\0"
    # A decode step's size does not depend on how long the sequences are.
    far = SchedulerOutput(
        step=4,
        epoch=3,
        cached_req_ids=["a"],
        cached_resumed=[False],
        cached_num_blocks=[1],
        cached_block_ids=[200_000],
        scheduled_req_ids=["a", "b", "c"],
        num_scheduled_tokens=[1, 1, 1],
        num_computed_tokens=[800_000, 700_000, 500_000],
        sample=[True, True, True],
    )
    assert len(encode(far)) == len(encode(wire)) < 400
    # 5: b finished (its state is dropped first); a was preempted and resumes in new blocks: its
    # whole new table is sent, none of its tokens, and it recomputes everything it knows.
    assert len(tokens["a"]) == 10
    out = SchedulerOutput(step=5, epoch=3, finished_req_ids=["b"])
    tables["a"] = [30, 31, 32]
    out.add_cached("a", True, tables["a"])
    out.add_scheduled("c", 1, 6, True)
    out.add_scheduled("a", 10, 0, True)
    wire = run(out, [("c", 6, 7), ("a", 0, 10)])
    assert wire.new_token_ids == [] and wire.cached_resumed == [True] and wire.cached_block_ids == [30, 31, 32]
    assert set(executor.requests) == {"a", "c"}
    # 6: a finished; the step only names it.
    out = SchedulerOutput(step=6, epoch=3, finished_req_ids=["a"])
    out.add_scheduled("c", 1, 7, True)
    run(out, [("c", 7, 8)])
    assert set(executor.requests) == {"c"} and executor.requests["c"].token_ids == tokens["c"]
    assert executor.requests["c"].params == params["c"] and executor.table("c").tolist() == [20, 21]


def _known(vocab_size: int | None = 100) -> PersistentBatch:
    """An executor holding "a": 3 tokens (2 of prompt) in one block of 4."""
    executor = PersistentBatch(4, vocab_size)
    out = SchedulerOutput(step=1)
    out.add_new("a", SamplingParams(), 2, [5, 6, 7], [0])
    out.add_scheduled("a", 3, 0, True)
    executor.prepare(_wire(out))
    return executor


@pytest.mark.parametrize(
    "edit, error",
    [
        (lambda o: o.add_scheduled("ghost", 1, 0, True), "unknown request 'ghost'"),
        (lambda o: o.add_cached("ghost", False, [1]), "unknown request 'ghost'"),
        (lambda o: o.add_cached("ghost", True, [1]), "unknown request 'ghost'"),
        (lambda o: o.add_scheduled("a", 2, 2, False), r"positions \[2, 4\) but 3 tokens"),  # past the known tokens
        (lambda o: o.add_scheduled("a", 1, 3, False), r"positions \[3, 4\) but 3 tokens"),
        (lambda o: o.add_scheduled("a", 1, -1, False), r"positions \[-1, 0\)"),
        (lambda o: o.add_scheduled("a", 0, 1, False), r"positions \[1, 1\)"),  # nothing to compute
        (
            lambda o: o.add_new("b", SamplingParams(), 5, [1] * 5, [1]) or o.add_scheduled("b", 5, 0, True),
            r"positions \[0, 5\) but 5 tokens and 1 blocks",
        ),  # past the block table
        (lambda o: o.add_new("b", SamplingParams(), 2, [1, 100], [1]), r"token ids must be in \[0, 100\)"),
        (lambda o: o.add_new("b", SamplingParams(), 2, [-1, 1], [1]), r"token ids must be in \[0, 100\)"),
        (lambda o: o.add_new("b", SamplingParams(), 3, [1, 2], [1]), "3 prompt tokens of 2"),
        (lambda o: o.add_new("b", SamplingParams(), 0, [1, 2], [1]), "0 prompt tokens of 2"),
        (lambda o: o.scheduled_req_ids.append("a"), "scheduled-request columns differ in length"),
        (lambda o: o.new_num_tokens.append(1), "new-request columns differ in length"),
        (
            lambda o: o.add_new("b", SamplingParams(), 1, [1], [1]) or o.new_token_ids.append(2),
            "new-request token or block columns",
        ),
        (lambda o: o.add_cached("a", False, [1]) or o.cached_block_ids.append(2), "cached-request block column"),
    ],
)
def test_inconsistent_step_is_rejected(edit, error: str) -> None:
    """A step the executor's state cannot follow raises `ValueError` (`ProtocolError` is one): the
    executor then drops everything and the scheduler resends every request as new."""
    executor = _known()
    out = SchedulerOutput(step=2)
    edit(out)
    with pytest.raises(ValueError, match=error):
        executor.prepare(_wire(out))


def test_finished_ids_drop_state_and_unknown_ones_are_ignored() -> None:
    executor = _known()
    out = SchedulerOutput(step=2, finished_req_ids=["a", "never-seen"])
    assert executor.prepare(_wire(out)).num_seqs == 0 and executor.requests == {}
    # A request named both finished and new (an id reused) starts afresh.
    executor = _known()
    out = SchedulerOutput(step=2, finished_req_ids=["a"])
    out.add_new("a", SamplingParams(), 1, [9], [3])
    out.add_scheduled("a", 1, 0, True)
    batch = executor.prepare(_wire(out))
    assert batch.input_ids.tolist() == [9] and batch.slot_mapping.tolist() == [12] and executor.requests["a"].token_ids == [9]
