"""`OutputRouter`: per-gateway grouping of a step's outputs, orphaned (journaled) requests of dead
gateways, adoption by another gateway, and the final error / rejection answers."""

from __future__ import annotations

import pytest

from common.codec import unpack_logprobs
from common.protocol import OUTPUTS_MAXLEN, OUTPUTS_TTL_MS, TAKEN_OVER, Names, StepOutputs, decode
from common.sampling_params import SamplingParams
from common.transport import Outgoing
from scheduler.outputs import OutputRouter
from scheduler.request import Request, StepOutput

pytestmark = pytest.mark.unit

NAMES = Names("t-router")
WINDOW_S = 30.0


def make_router() -> OutputRouter:
    return OutputRouter(NAMES, resume_window_s=WINDOW_S, max_message_bytes=1 << 20)


def out(
    request_id: str,
    new: list[int],
    total: int,
    finished: bool = False,
    reason: str | None = None,
    logprobs: list[dict[int, float] | None] | None = None,
) -> StepOutput:
    return StepOutput(request_id, new, logprobs if logprobs is not None else [None] * len(new), finished, reason, total)


def by_stream(sends: list[Outgoing]) -> dict[str, StepOutputs]:
    msgs = {s.stream: decode(s.data, (StepOutputs,)) for s in sends}
    assert len(msgs) == len(sends), "one message per stream"
    return msgs


def entries(msg: StepOutputs) -> list[tuple[str, int, list[int], bool, str | None, str | None]]:
    """Per request: (id, first token index, tokens, finished, finish reason, error)."""
    rows, pos = [], 0
    for i, request_id in enumerate(msg.request_ids):
        n = msg.num_tokens[i]
        rows.append(
            (request_id, msg.token_index[i], msg.token_ids[pos : pos + n], msg.finished[i], msg.finish_reasons[i], msg.errors[i])
        )
        pos += n
    return rows


def held_request(request_id: str, outputs: list[int], logprobs: list[dict[int, float] | None] | None = None) -> Request:
    r = Request(request_id, [1, 2, 3], SamplingParams(temperature=0, max_tokens=50))
    r.output_token_ids = list(outputs)
    r.output_logprobs = list(logprobs) if logprobs is not None else [None] * len(outputs)
    return r


def test_route_groups_one_message_per_gateway() -> None:
    router = make_router()
    router.add("a", "g1", "")
    router.add("b", "g2", "resp-b")  # resumable, but its gateway is alive: outputs go to the gateway
    router.add("c", "g1", "")
    sends = router.route([out("a", [5], 3), out("b", [6], 1), out("c", [7], 10, True, "stop"), out("ghost", [8], 1)])
    assert [s.stream for s in sends] == [NAMES.outputs("g1"), NAMES.outputs("g2")]
    for s in sends:
        assert s.maxlen == OUTPUTS_MAXLEN and s.ttl_ms == OUTPUTS_TTL_MS
    msgs = by_stream(sends)
    assert entries(msgs[NAMES.outputs("g1")]) == [("a", 2, [5], False, None, None), ("c", 9, [7], True, "stop", None)]
    assert entries(msgs[NAMES.outputs("g2")]) == [("b", 0, [6], False, None, None)]
    assert msgs[NAMES.outputs("g1")].lp_counts == []  # sealed: no logprob columns when none asked
    # A finished request is forgotten; the others stay routed.
    assert "c" not in router.routes and "a" in router.routes and "b" in router.routes and len(router.routes) == 2
    assert router.route([out("c", [1], 11)]) == []
    assert router.route([]) == []


def test_route_carries_logprobs() -> None:
    router = make_router()
    router.add("a", "g1", "")
    router.add("b", "g1", "")
    msg = by_stream(router.route([out("a", [5], 1, logprobs=[{5: -0.25, 9: -2.0}]), out("b", [6], 4)]))[NAMES.outputs("g1")]
    assert unpack_logprobs(msg.lp_counts, msg.lp_token_ids, msg.lp_values) == [{5: -0.25, 9: -2.0}, None]


def test_gateway_died_orphans_journaled_and_returns_the_others() -> None:
    router = make_router()
    router.add("a", "g1", "")  # cannot be resumed: to abort
    router.add("b", "g1", "resp-b")  # resumable: orphaned, journaled
    router.add("c", "g2", "resp-c")  # another gateway's: untouched
    router.add("d", "g1", "")
    assert router.gateways() == ({"g1", "g2"}, set())
    doomed = router.gateway_died("g1", now=100.0)
    assert doomed == ["a", "d"]
    assert router.gateways() == ({"g1", "g2"}, {"g1"})  # a and d stay until the service forgets them
    for r in doomed:
        router.forget(r)
    assert router.gateways() == ({"g2"}, {"g1"})
    assert router.orphans_of("g1") == ["b"] and router.orphans_of("g2") == []
    # The orphan's outputs now go to its journal, which lives as long as the resume window.
    sends = router.route([out("b", [4, 5], 7), out("c", [6], 2)])
    assert [s.stream for s in sends] == [NAMES.journal("resp-b"), NAMES.outputs("g2")]
    assert sends[0].ttl_ms == int(WINDOW_S * 1000) and sends[0].maxlen is None  # a journal is never trimmed
    assert sends[1].ttl_ms == OUTPUTS_TTL_MS
    assert entries(by_stream(sends)[NAMES.journal("resp-b")]) == [("b", 5, [4, 5], False, None, None)]
    # A second death notice for the same gateway changes nothing.
    assert router.gateway_died("g1", now=150.0) == []
    assert router.expired_orphans(129.0) == []
    # A finished orphan's last output is journaled and the orphan forgotten.
    sends = router.route([out("b", [9], 8, True, "length")])
    assert entries(by_stream(sends)[NAMES.journal("resp-b")]) == [("b", 7, [9], True, "length", None)]
    assert "b" not in router.routes and router.gateways() == ({"g2"}, set())


def test_expired_orphans() -> None:
    router = make_router()
    router.add("a", "g1", "ja")
    router.add("b", "g2", "jb")
    router.add("c", "g3", "jc")
    router.gateway_died("g1", now=10.0)
    router.gateway_died("g2", now=20.0)
    assert router.expired_orphans(10.0 + WINDOW_S) == []  # the window is inclusive
    assert router.expired_orphans(10.0 + WINDOW_S + 0.01) == ["a"]
    assert router.expired_orphans(20.0 + WINDOW_S + 0.01) == ["a", "b"]
    # An adopted orphan never expires.
    router.adopt(held_request("a", [1]), "a", "g9", 0)
    assert router.expired_orphans(1e9) == ["b"]


def test_adopt_reroutes_and_resends_from_index() -> None:
    router = make_router()
    router.add("b", "g1", "resp-b")
    router.gateway_died("g1", now=0.0)
    request = held_request("b", [10, 11, 12, 13], [None, {11: -0.5}, None, None])
    [send] = router.adopt(request, "b", "g2", 2)  # (an orphan: no gateway to tell)
    assert send.stream == NAMES.outputs("g2") and send.ttl_ms == OUTPUTS_TTL_MS
    msg = decode(send.data, (StepOutputs,))
    assert entries(msg) == [("b", 2, [12, 13], False, None, None)]
    assert msg.lp_counts == []  # the resent slice has no logprobs
    # Routed to the adopter from now on: no longer an orphan, no longer journaled.
    assert router.gateways() == ({"g2"}, set()) and router.orphans_of("g1") == []
    assert [s.stream for s in router.route([out("b", [14], 5)])] == [NAMES.outputs("g2")]
    # from_index is clamped to what exists.
    assert entries(decode(router.adopt(request, "b", "g3", 99)[-1].data)) == [("b", 4, [], False, None, None)]
    assert entries(decode(router.adopt(request, "b", "g3", -5)[-1].data)) == [("b", 0, [10, 11, 12, 13], False, None, None)]
    lp = decode(router.adopt(request, "b", "g3", 1)[-1].data)
    assert unpack_logprobs(lp.lp_counts, lp.lp_token_ids, lp.lp_values) == [{11: -0.5}, None, None]


def test_adopt_of_a_live_owners_request_moves_it_and_tells_the_owner() -> None:
    router = make_router()
    router.add("a", "g1", "")
    notice, answer = router.adopt(held_request("a", [1, 2]), "a", "g2", 0)
    assert notice.stream == NAMES.outputs("g1") and answer.stream == NAMES.outputs("g2")
    [(rid, index, tokens, finished, reason, error)] = entries(decode(notice.data, (StepOutputs,)))
    assert (rid, index, tokens, finished, reason) == ("a", 0, [], True, TAKEN_OVER) and "g2" in (error or "")
    assert [s.stream for s in router.adopt(held_request("a", [1, 2]), "a", "g2", 0)] == [NAMES.outputs("g2")]  # its own
    assert router.gateways() == ({"g2"}, set())
    assert [s.stream for s in router.route([out("a", [3], 3)])] == [NAMES.outputs("g2")]


def test_an_abort_from_the_gateway_a_stream_left_does_not_stop_it() -> None:
    """The client hung up on g1 and resumed on g2 (adopted), and then g1's abort arrived: too late."""
    router = make_router()
    router.add("a", "g1", "resp-a")
    assert router.may_abort("a", "g1") and router.may_abort("a", "") and not router.may_abort("a", "g2")
    router.adopt(held_request("a", [1, 2]), "a", "g2", 0)
    assert not router.may_abort("a", "g1") and router.may_abort("a", "g2") and router.may_abort("a", "")
    router.gateway_died("g2", now=0.0)  # an orphan: whoever sends the abort
    assert router.may_abort("a", "g1") and router.may_abort("b", "g1")  # "b": not routed here


@pytest.mark.parametrize("held", [False, True])
def test_adopt_unknown(held: bool) -> None:
    """Not held by the engine, or held but not routed (e.g. already forgotten): answered "unknown"."""
    router = make_router()
    request = held_request("x", [1, 2]) if held else None
    [send] = router.adopt(request, "x", "g2", 1)
    assert send.stream == NAMES.outputs("g2")
    [(rid, index, tokens, finished, reason, error)] = entries(decode(send.data, (StepOutputs,)))
    assert (rid, index, tokens, finished, reason) == ("x", 0, [], True, "unknown")
    assert error
    assert "x" not in router.routes and router.gateways() == (set(), set())


def test_errors_and_reject() -> None:
    router = make_router()
    router.add("a", "g1", "")
    router.add("b", "g1", "")
    router.add("c", "g2", "resp-c")
    router.add("keep", "g1", "")
    router.gateway_died("g2", now=0.0)  # c is an orphan: its error goes to its journal
    sends = router.errors(["a", "b", "c", "nope"], "engine error: boom")
    assert [s.stream for s in sends] == [NAMES.outputs("g1"), NAMES.journal("resp-c")]
    assert sends[1].ttl_ms == int(WINDOW_S * 1000)
    msgs = by_stream(sends)
    assert entries(msgs[NAMES.outputs("g1")]) == [
        ("a", 0, [], True, "error", "engine error: boom"),
        ("b", 0, [], True, "error", "engine error: boom"),
    ]
    assert entries(msgs[NAMES.journal("resp-c")]) == [("c", 0, [], True, "error", "engine error: boom")]
    assert set(router.routes) == {"keep"}
    assert router.errors(["a"], "again") == []  # forgotten: nothing more to say
    # Another reason may be given.
    [send] = router.errors(["keep"], "no executor", reason="abort")
    assert entries(decode(send.data)) == [("keep", 0, [], True, "abort", "no executor")]
    # A request never admitted is answered on its gateway's stream, and was never routed.
    send = router.reject("r9", "g3", "max_tokens must be at least 1")
    assert send.stream == NAMES.outputs("g3") and send.ttl_ms == OUTPUTS_TTL_MS and send.maxlen == OUTPUTS_MAXLEN
    assert entries(decode(send.data)) == [("r9", 0, [], True, "rejected", "max_tokens must be at least 1")]
    assert "r9" not in router.routes
