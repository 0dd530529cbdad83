"""Wire protocol: round trips, rejection of malformed messages, dead-lettering, step deltas."""

from __future__ import annotations

import asyncio
import random

import fakeredis
import msgpack
import pytest

from common.batch import Batch
from common.protocol import (
    AbortRequests,
    BindExecutor,
    EngineStatus,
    ExecutorHello,
    GenerateRequest,
    JournalHeader,
    Names,
    ProtocolError,
    Route,
    StepDelta,
    StepOutputs,
    StepResult,
    SyncRequest,
    decode,
    encode,
    pack_logprobs,
    unpack_logprobs,
)
from common.sampling_params import SamplingParams
from common.transport import Transport
from executor.service import RequestStates
from scheduler.stream_executor import DeltaEncoder


def _req(request_id: str = "r", prompt: list[int] | None = None, output: list[int] | None = None,
         journal_id: str = "") -> GenerateRequest:
    return GenerateRequest(request_id, "g1", "s0", "inc1", [1, 2] if prompt is None else prompt,
                           [] if output is None else output, {"temperature": 0.0, "max_tokens": 4}, 12.5, journal_id)


def _engine_status(**kw: object) -> EngineStatus:
    base: dict[str, object] = dict(
        scheduler_id="s0", incarnation="inc1", model_name="tiny", model_path="/m", max_model_len=2048,
        vocab_size=1024, block_size=16, num_blocks=100, executor_id="e1", epoch=17, num_free_blocks=90,
        num_running=3, num_waiting=2, num_steps=1234, num_preemptions=1, num_dead_letters=0, updated_at=1.5e9)
    base.update(kw)
    return EngineStatus(**base)  # type: ignore[arg-type]


def test_round_trip_every_type() -> None:
    outputs = StepOutputs()
    outputs.add("x", 4, [9, 10], None, True, "length")
    msgs = [
        _req("r1", [1, 2, 3, 2**31 - 1], [7, 8], journal_id="resp-1"),
        _req("r2"),  # no earlier output, not resumable
        AbortRequests(["a", "b"], "client"),
        SyncRequest("r1~2", "g2", 5),
        ExecutorHello("e1", "tiny", "/m", 100, 16, 2048, 1024, [1, 2]),
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
    assert len(data) < 6200  # columnar + packed: ~4 bytes per token


_MISSING = object()  # a field left out of a raw message


def _raw_req(**overrides: object) -> bytes:
    body: dict[str, object] = {"v": 1, "t": "req", "request_id": "r", "gateway_id": "g", "scheduler_id": "s0",
                               "incarnation": "i", "prompt_token_ids": b"\x01\x00\x00\x00",
                               "output_token_ids": b"", "sampling": {}, "arrival_time": 0.0, "journal_id": ""}
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
        (msgpack.packb({"v": 1, "t": "nope"}), "unknown message type 'nope'"),
        (msgpack.packb({"v": 1, "t": "abort", "reason": "x"}), "missing field 'request_ids'"),
        (msgpack.packb({"v": 1, "t": "abort", "request_ids": "abc", "reason": "x"}), "AbortRequests.request_ids: expected"),
        (msgpack.packb({"v": 1, "t": "abort", "request_ids": [1], "reason": "x"}), "expected"),
        (msgpack.packb({"v": 1, "t": "abort", "request_ids": [], "reason": "x", "evil": 1}), "unknown fields ['evil']"),
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
        (msgpack.packb({"v": 1, "t": "sync", "request_id": "r", "gateway_id": "g", "from_index": 1.5}),
         "SyncRequest.from_index: expected int"),
        (msgpack.packb({"v": 1, "t": "sync", "request_id": "r", "gateway_id": "g", "from_index": True}),
         "SyncRequest.from_index: expected int"),
        (msgpack.packb({"v": 1, "t": "route", "request_id": "r"}), "Route: missing field 'scheduler_id'"),
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


# -- step deltas: the executor rebuilds exactly the scheduler's batch ------------------------------
def _batch(reqs: list[tuple[str, list[int], int, int, list[int], bool]], bs: int) -> Batch:
    """reqs: (id, all tokens, start, end, block table, sample)."""
    b = Batch()
    for rid, tokens, start, end, table, sample in reqs:
        b.request_ids.append(rid)
        b.input_ids.extend(tokens[start:end])
        b.positions.extend(range(start, end))
        b.slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        b.query_lens.append(end - start)
        b.seq_lens.append(end)
        b.block_tables.append(list(table))
        b.sample.append(sample)
        b.output_lens.append(max(0, end - 5))
        b.sampling_params.append(SamplingParams(temperature=0.0, max_tokens=8))
    return b


def test_delta_rebuilds_batches_and_stays_small() -> None:
    bs = 4
    enc, dec = DeltaEncoder(bs), RequestStates(bs)
    rng = random.Random(0)
    tokens = {r: [rng.randrange(1000) for _ in range(40)] for r in "abc"}
    tables = {"a": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], "b": [10, 11, 12, 13, 14, 15, 16, 17, 18, 19], "c": [20, 21, 22]}
    steps = [
        [("a", 0, 6, True), ("b", 0, 3, False)],      # prefill + prefill chunk
        [("a", 6, 7, True), ("b", 3, 6, True)],       # decode + rest of b's prompt
        [("a", 7, 8, True), ("b", 6, 7, True), ("c", 0, 5, True)],
        [("a", 8, 9, True), ("c", 5, 6, True)],
    ]
    sizes = []
    for step_no, step in enumerate(steps, 1):
        batch = _batch([(r, tokens[r], s, e, tables[r][: -(-e // bs)], smp) for r, s, e, smp in step], bs)
        delta = enc.encode(batch, epoch=1, step=step_no)
        wire = decode(encode(delta))
        assert dec.apply(wire) == batch
        sizes.append(len(wire.new_tokens))
    assert sizes == [9, 4, 7, 2]  # each token is sent once, when first scheduled
    # Preemption: "a" recomputes into different blocks; only the table changes, no tokens resent.
    enc.release(["b"])
    tables["a"] = [30, 31, 32]
    batch = _batch([("a", tokens["a"], 0, 9, tables["a"], True)], bs)
    delta = enc.encode(batch, epoch=1, step=5)
    assert delta.release == ["b"] and delta.new_tokens == [] and delta.new_blocks == [30, 31, 32]
    assert dec.apply(decode(encode(delta))) == batch and "b" not in dec.states
    # An explicit slot mapping that does not follow the table is sent as such.
    batch = _batch([("a", tokens["a"], 9, 10, tables["a"], True)], bs)
    batch.slot_mapping = [-1]
    delta = enc.encode(batch, epoch=1, step=6)
    assert delta.slot_seqs == [0] and dec.apply(decode(encode(delta))) == batch


def test_delta_for_unknown_request_is_rejected() -> None:
    dec = RequestStates(4)
    delta = StepDelta(epoch=1, step=1, request_ids=["ghost"], query_lens=[1], seq_lens=[1], output_lens=[0],
                      sample=[True], token_starts=[0], num_new_tokens=[1], new_tokens=[5], block_starts=[0],
                      num_new_blocks=[1], new_blocks=[0])
    with pytest.raises(ValueError, match="unknown request 'ghost'"):
        dec.apply(delta)
