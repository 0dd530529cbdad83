"""Redis Sentinel failover under load: a real stack on a ``redis+sentinel://`` URL (one master, one
replica, three sentinels on localhost; the password from the environment), clients streaming and
not, and the master SIGKILLed mid-load. Every request must complete with its full token count and
the same text as before the fault; the only error a client may see is a 503 *before* its request
was taken (the gateway refuses new work while it cannot reach Redis), which it retries.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest

from common.redis_url import PASSWORD_ENV
from infra.stack import Stack
from tests.redis_servers import SentinelCluster

pytestmark = [pytest.mark.stack, pytest.mark.slow]

PASSWORD = "sentinel-test-secret"
NUM_CLIENTS = 6
MAX_TOKENS = 24
AFTER_FAILOVER = 2  # requests each client completes once the replica is the master


@dataclass
class Outcome:
    texts: list[tuple[int, str, int]] = field(default_factory=list)  # (prompt, text, completion tokens)
    refused: int = 0  # 503s before the request was taken, retried
    started_before_kill: int = 0  # requests in flight when the master died that completed
    longest_s: float = 0.0  # the longest request of those


def _refused_before_taken(exc: openai.APIStatusError) -> bool:
    body: Any = exc.body if isinstance(exc.body, dict) else {}
    body = body.get("error", body)
    return exc.status_code == 503 and (body.get("code") == "engine_unavailable" or "cannot reach" in str(body.get("message")))


async def _one(client: openai.AsyncOpenAI, prompt: int, stream: bool) -> tuple[str, int]:
    args: dict[str, Any] = dict(model="", prompt=f"def task_{prompt}(x):", max_tokens=MAX_TOKENS, temperature=0)
    args["extra_body"] = {"ignore_eos": True}
    if not stream:
        r = await client.completions.create(**args)
        assert r.usage is not None
        return r.choices[0].text, r.usage.completion_tokens
    text, tokens = "", 0
    async for chunk in await client.completions.create(**args, stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return text, tokens


async def _client_loop(url: str, i: int, state: dict[str, Any], out: Outcome) -> None:
    """Requests one after another (streaming on odd clients) until AFTER_FAILOVER completed past the promotion."""
    done_after = 0
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        n = 0
        while done_after < AFTER_FAILOVER:
            prompt = i * 100 + n % 3  # a few prompts, each asked before and after the fault
            killed_before, t0 = state["killed"], time.monotonic()
            try:
                text, tokens = await _one(client, prompt, stream=i % 2 == 1)
            except openai.APIStatusError as exc:
                if not _refused_before_taken(exc):
                    raise
                out.refused += 1
                await asyncio.sleep(0.2)
                continue
            out.texts.append((prompt, text, tokens))
            n += 1
            if state["killed"] and not killed_before:
                out.started_before_kill += 1
                out.longest_s = max(out.longest_s, time.monotonic() - t0)
            if state["promoted"]:
                done_after += 1


@pytest.fixture()
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SentinelCluster]:
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)  # every service reads it; the URL carries none
    c = SentinelCluster(tmp_path / "redis", PASSWORD)
    c.workdir.mkdir()
    try:
        yield c.start()
    finally:
        c.stop()


def run_clients_through_failover(
    url: str, kill: Callable[[], None], promoted: Callable[[], bool], logs: Callable[[], str]
) -> tuple[Outcome, dict[str, Any], float]:
    """``NUM_CLIENTS`` clients (`_client_loop`) on the gateway at ``url``: once every one has
    completed requests, ``kill`` the master, wait (30 s at most) until ``promoted()``, then until
    every client has finished. The outcome, the shared state and the seconds it all took."""
    state: dict[str, Any] = {"killed": False, "promoted": False}
    outcome = Outcome()

    async def main() -> None:
        tasks = [asyncio.create_task(_client_loop(url, i, state, outcome)) for i in range(NUM_CLIENTS)]
        while len(outcome.texts) < 2 * NUM_CLIENTS:  # warm: every client has completed requests
            await asyncio.sleep(0.01)
            assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
        kill()
        state["killed"], killed_at = True, time.monotonic()
        while not promoted():
            assert time.monotonic() < killed_at + 30, f"no promotion within 30 s\n{logs()}"
            await asyncio.sleep(0.1)
        state["promoted"], state["promoted_after_s"] = True, time.monotonic() - killed_at
        await asyncio.wait_for(asyncio.gather(*tasks), 60)

    t0 = time.monotonic()
    asyncio.run(main())
    return outcome, state, time.monotonic() - t0


def test_master_killed_under_load_requests_complete(cluster: SentinelCluster, tiny_model: Any, tmp_path: Path) -> None:
    old_master = cluster.ports["master"]
    old_run_id = cluster.client("master").info("server")["run_id"]
    stack = Stack(tiny_model(), tmp_path, redis_url=cluster.url, scheduler_args=("--recovery-timeout", "60"))
    stack.start()
    try:
        outcome, state, elapsed = run_clients_through_failover(
            stack.urls[0], cluster.kill_master, lambda: cluster.master_port() != old_master, cluster.logs
        )
    except BaseException:
        print(stack.logs(30), cluster.logs(), sep="\n")
        raise
    finally:
        stack.stop()
    new_run_id = cluster.client("replica").info("server")["run_id"]
    assert cluster.master_port() == cluster.ports["replica"]
    assert new_run_id != old_run_id, "the services notice a failover by the run_id changing"
    assert all(tokens == MAX_TOKENS for _, _, tokens in outcome.texts), outcome.texts
    by_prompt: dict[int, set[str]] = {}
    for prompt, text, _ in outcome.texts:
        by_prompt.setdefault(prompt, set()).add(text)
    assert all(len(texts) == 1 for texts in by_prompt.values()), "a greedy request's text changed across the failover"
    assert outcome.started_before_kill > 0, "no request was in flight when the master died"
    logs = "".join(path.read_text(errors="replace") for path in tmp_path.glob("*.log"))
    assert "Redis restarted" in logs, "the services did not notice the failover"
    assert PASSWORD not in logs
    print(
        f"failover: {len(outcome.texts)} requests completed in {elapsed:.1f} s, "
        f"{outcome.started_before_kill} in flight at the kill (longest {outcome.longest_s:.1f} s), replica promoted "
        f"{state['promoted_after_s']:.1f} s after the kill, {outcome.refused} refused (503) and retried"
    )
