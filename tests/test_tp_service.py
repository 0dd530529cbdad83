"""The services with a tensor-parallel executor (2 gloo ranks on CPU): a request completes over
HTTP with the offline engine's greedy text, and a killed rank is one executor's death, recovered
as such (the stream pauses and completes once an executor is back)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from common.sampling_params import SamplingParams
from infra.stack import Stack

pytestmark = pytest.mark.stack

NUM_BLOCKS = 128
# Each rank one thread: two ranks share this machine's two cores.
EXECUTOR_ARGS = ("--tensor-parallel-size", "2", "--num-threads", "1", "--num-blocks", str(NUM_BLOCKS), "--device", "cpu")


def _pids(stack: Stack, timeout_s: float = 60) -> list[int]:
    """The ranks' pids, from the newest announcement in the executor's log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.findall(r"tensor parallel: 2 ranks, pids (\d+) (\d+)", (stack.workdir / "executor0.log").read_text())
        if found:
            return [int(p) for p in found[-1]]
        time.sleep(0.1)
    raise AssertionError("the executor never logged its ranks:\n" + stack.logs())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "State:\tZ" in status.read_text())


def _wait_gone(pid: int, timeout_s: float = 15) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


@pytest.fixture(scope="module")
def stack(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tiny_model(), Path(tmp_path_factory.mktemp("tp-stack")), executor_args=EXECUTOR_ARGS).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def expected(tiny_model: Any) -> str:
    from gateway.llm import LLM

    llm = LLM(str(tiny_model()), num_blocks=NUM_BLOCKS, num_threads=1)
    return llm.generate(["def f("], SamplingParams(temperature=0.0, max_tokens=40))[0].text


def test_request_completes_on_a_tp2_executor(stack: Stack, expected: str) -> None:
    client = openai.OpenAI(base_url=f"{stack.urls[0]}/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.completions.create(model="", prompt="def f(", max_tokens=40, temperature=0)
    assert r.choices[0].text == expected and r.usage is not None and r.usage.completion_tokens == 40
    pids = _pids(stack)
    assert pids[0] == stack.procs["executor0"].pid and _alive(pids[1])


def test_killed_rank_is_an_executor_death(stack: Stack, expected: str) -> None:
    """kill -9 rank 1 mid-stream: rank 0 exits by itself, a new executor is started, the stream completes."""
    old = _pids(stack)
    body = {"prompt": "def f(", "max_tokens": 40, "stream": True, "temperature": 0}
    events: list[str] = []
    with httpx.stream("POST", f"{stack.urls[0]}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line)
                if len(events) == 3:
                    os.kill(old[1], signal.SIGKILL)
                    rc = stack.procs["executor0"].wait(30)  # rank 0 follows its peer: one executor died
                    assert rc != 0
                    stack.spawn_executor(0)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks[-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    new = _pids(stack)
    assert new != old and all(_alive(p) for p in new)
    # The other way round: rank 0 killed, its rank 1 does not outlive it.
    os.kill(new[0], signal.SIGKILL)
    stack.procs["executor0"].wait(10)
    assert _wait_gone(new[1]), "rank 1 outlived rank 0"
