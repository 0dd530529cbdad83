"""An idle engine through a Redis outage: the executor backs off while Redis is down (a bounded
number of "retrying" lines, not a busy loop), and serves again once it is back."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from infra.launcher import wait_healthy
from infra.stack import Stack

pytestmark = pytest.mark.stack

OUTAGE_S = 3.0
# Backing off from 50 ms, doubling to a cap of 2 s: six waits fill the outage; a busy loop logs thousands.
MAX_RETRY_LINES = 20


@pytest.fixture(scope="module")
def stack(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tiny_model(), Path(tmp_path_factory.mktemp("outage")), private_redis=True)
    s.start()
    yield s
    s.stop()


def test_an_idle_executor_backs_off_while_redis_is_down(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.urls[0]}/v1", api_key="x", max_retries=0, timeout=60)
    assert client.completions.create(model="", prompt="hi", max_tokens=2).usage is not None
    log = stack.workdir / "executor0.log"
    before = len(log.read_text(errors="replace").splitlines())
    stack.restart_redis(OUTAGE_S)
    time.sleep(1.0)  # and a moment for it to notice Redis is back
    lines = log.read_text(errors="replace").splitlines()[before:]
    retries = [line for line in lines if "retrying" in line]
    assert 0 < len(retries) <= MAX_RETRY_LINES, "\n".join(lines[-30:])
    wait_healthy(f"{stack.urls[0]}/health", 60, list(stack.procs.values()))
    deadline = time.time() + 60
    while True:  # the engine re-registers with the new Redis and serves again
        try:
            assert client.completions.create(model="", prompt="hi", max_tokens=2).usage is not None
            break
        except openai.APIStatusError:
            if time.time() > deadline:
                raise
            time.sleep(0.5)
