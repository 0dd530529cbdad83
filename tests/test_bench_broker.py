"""`python -m bench.broker` end to end on a tiny workload against a real stack, and its idle
subtraction on made-up counters. No cost is asserted, only that each is measured and attributed."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from bench import broker

pytestmark = pytest.mark.stack


def test_idle_is_subtracted_at_its_rate() -> None:
    idle = broker.Counters(2.0, {"xread": 20, "set": 4}, 1000, 2000, 0.02, {})
    busy = broker.Counters(1.0, {"xread": 30, "xadd": 40, "set": 1}, 3000, 1500, 0.5, {"journal": 8})
    net = busy.less_idle(idle)
    assert net.calls == {"xread": 20, "xadd": 40}  # set: less than idle's rate, dropped
    assert (net.net_in, net.net_out, net.entries) == (2500, 500, {"journal": 8})
    assert net.cpu_s == pytest.approx(0.49)
    assert broker.stream_kind("test-ab:journal:resp-1", "test-ab") == "journal"


def test_the_bench_measures_a_streamed_workload_with_a_stream_interval(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    out = tmp_path / "broker.json"
    argv = ["--model", str(tiny_model()), "--requests", "2", "--max-tokens", "6", "--idle-s", "0.3"]
    # The gateway's --stream-interval-ms end to end (the variant's flag).
    assert broker.main([*argv, "--workload", "stream n=4", "--stream-interval-ms", "20", "--json", str(out)]) == 0
    [result] = json.loads(out.read_text())["results"]
    assert (result["variant"], result["workload"]) == ("this 20ms", "stream n=4")
    assert (result["requests"], result["tokens"], result["failed"]) == (2, 48, 0)
    assert result["commands_per_token"] > 0 and result["bytes_in_per_token"] > 0
    assert "xadd" in result["by_command_per_token"]
    # Every stream kind the request path writes is seen; the choices of a response share a journal.
    assert {"requests", "steps", "results", "outputs", "journal"} <= set(result["entries_per_token"])
