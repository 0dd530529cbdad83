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
    ExecutorHello,
    GenerateRequest,
    Names,
    ProtocolError,
    StepDelta,
    StepOutputs,
    StepResult,
    decode,
    encode,
    pack_logprobs,
    unpack_logprobs,
)
from common.sampling_params import SamplingParams
from common.transport import Transport
from executor.service import RequestStates
from scheduler.stream_executor import DeltaEncoder


def test_round_trip_every_type() -> None:
    msgs = [
        GenerateRequest("r1", "g1", [1, 2, 3, 2**31 - 1], {"temperature": 0.0, "max_tokens": 4}, 12.5),
        AbortRequests(["a", "b"], "client"),
        ExecutorHello("e1", "tiny", "/m", 100, 16, 2048, 1024, [1, 2]),
        StepResult(3, 7, [5, -1], [2, -1], [5, 6], [-0.5, -1.25], None, 0.01),
        StepOutputs(["x"], [4], [2], [9, 10], [True], ["length"], [None], [-1, -1], [], []),
    ]
    for msg in msgs:
        assert decode(encode(msg)) == msg


def test_token_ids_travel_packed() -> None:
    data = encode(GenerateRequest("r", "g", list(range(1000)), {}, 0.0))
    body = msgpack.unpackb(data, raw=False)
    assert isinstance(body["prompt_token_ids"], bytes) and len(body["prompt_token_ids"]) == 4000
    assert len(data) < 4100  # columnar + packed: ~4 bytes per token


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
        (msgpack.packb({"v": 1, "t": "req", "request_id": "r", "gateway_id": "g", "prompt_token_ids": b"abc",
                        "sampling": {}, "arrival_time": 0.0}), "not a multiple of 4"),
        (msgpack.packb({"v": 1, "t": "req", "request_id": "r", "gateway_id": "g", "prompt_token_ids": [1, 2],
                        "sampling": {}, "arrival_time": 0.0}), "expected packed bytes"),
    ],
)
def test_decode_rejects_malformed(data: bytes, error: str) -> None:
    with pytest.raises(ProtocolError, match=error.replace("[", r"\[").replace("]", r"\]")):
        decode(data)


def test_size_limits_and_expected_type() -> None:
    big = GenerateRequest("r", "g", [1] * 10_000, {}, 0.0)
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
        t = Transport("redis://unused", names, owner="test")
        t.redis = fakeredis.FakeAsyncRedis()
        await t.ensure_group(names.requests, names.scheduler_group)
        await t.send_raw(names.requests, b"\x00not msgpack")
        await t.redis.xadd(names.requests, {b"other": b"field"})
        good = GenerateRequest("r1", "g", [1, 2], {}, 0.0)
        await t.send(names.requests, good)
        got = await t.read_group(names.requests, names.scheduler_group, "s0", block_ms=None, expected=(GenerateRequest,))
        assert [m for _, m in got] == [good]
        dead = await t.redis.xrange(names.dead_letter)
        reasons = [fields[b"reason"].decode() for _, fields in dead]
        assert len(reasons) == 2 and "not a msgpack message" in reasons[0] and "no 'm' field" in reasons[1]
        pending = await t.redis.xpending(names.requests, names.scheduler_group)
        assert pending["pending"] == 0  # everything acknowledged, bad entries included
        assert t.num_dead_letters == 2

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
