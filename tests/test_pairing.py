"""Claim-based pairing (`--scheduler-id auto`): the claim's rules on real Redis, then engines
started without ids pairing up, and a dead scheduler's executor claimed again."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from common.protocol import Names
from common.transport import SyncTransport
from executor.pairing import ExecutorOffer
from infra.launcher import free_port, stop_all
from infra.stack import REPO, Stack, find_redis
from scheduler.binding import ExecutorBinding
from scheduler.pairing import ExecutorClaims

pytestmark = pytest.mark.stack


@pytest.fixture()
def pairing(tmp_path: Path) -> Iterator[tuple[ExecutorOffer, ExecutorClaims]]:
    """Both sides of pairing on one Redis: the executor's offer, the scheduler's claims."""
    url, proc = find_redis(tmp_path)
    client = redis.Redis.from_url(url)
    namespace = f"test-pairing-{uuid.uuid4().hex[:8]}"
    yield ExecutorOffer(client, Names(namespace), ttl_ms=300), ExecutorClaims(client, Names(namespace), ttl_ms=300)
    keys = list(client.scan_iter(match=f"{namespace}:*"))
    if keys:
        client.delete(*keys)
    if proc is not None:
        proc.kill()


def test_one_owner_at_a_time(pairing: tuple[ExecutorOffer, ExecutorClaims]) -> None:
    offer, claims = pairing
    assert claims.try_claim("e1", "s1")
    assert not claims.try_claim("e1", "s2")  # taken: NX
    assert offer.owner("e1") == "s1"
    assert not claims.refresh("e1", "s2") and not claims.release("e1", "s2")  # only the owner may
    assert offer.owner("e1") == "s1"
    assert claims.refresh("e1", "s1")
    assert claims.release("e1", "s1")
    assert offer.owner("e1") is None
    assert claims.try_claim("e1", "s2")  # free again once released


def test_claim_expires_without_refresh(pairing: tuple[ExecutorOffer, ExecutorClaims]) -> None:
    offer, claims = pairing
    assert claims.try_claim("e1", "s1")
    time.sleep(0.2)
    assert claims.refresh("e1", "s1")  # a refresh extends it past the first TTL...
    time.sleep(0.2)
    assert offer.owner("e1") == "s1"
    time.sleep(0.4)  # ...and without one it expires: the scheduler is gone
    assert offer.owner("e1") is None
    assert not claims.refresh("e1", "s1")
    assert claims.try_claim("e1", "s2")


def test_offered_executors(pairing: tuple[ExecutorOffer, ExecutorClaims]) -> None:
    offer, claims = pairing
    offer.announce("e1")
    offer.announce("e2")
    assert claims.offered() == ["e1", "e2"]  # longest waiting first
    offer.withdraw("e1")
    assert claims.offered() == ["e2"]
    time.sleep(0.4)  # no longer announcing (claimed, or dead): dropped after a TTL
    offer.announce("e3")
    assert claims.offered() == ["e3"]
    # The set itself goes a TTL after the last announcement, though no scheduler is left to trim it.
    assert 0 < int(offer.redis.pttl(offer.unpaired)) <= 300
    time.sleep(0.4)
    assert not offer.redis.exists(offer.unpaired)


def _executors(stack: Stack) -> dict[str, str]:
    return {sid: status.executor_id for sid, status in stack.engines().items()}


def _wait(predicate: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_engines_pair_without_ids_and_reclaim(tiny_model: Any, tmp_path: Path) -> None:
    stack = Stack(tiny_model(), tmp_path, engines=2, auto_pairing=True, executor_args=("--num-blocks", "256"))
    try:
        stack.start()
        _wait(lambda: len(_executors(stack)) == 2, 60)
        paired = _executors(stack)
        assert len(set(paired.values())) == 2, paired  # each scheduler has an executor of its own
        assert not set(paired) & {"0", "1"}  # ids were made up, not given
        client = openai.OpenAI(base_url=f"{stack.urls[0]}/v1", api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        for i in range(6):
            r = client.completions.create(model=model, prompt=f"hello {i}", max_tokens=4, temperature=0)
            assert r.choices[0].text and r.usage is not None and r.usage.completion_tokens == 4
        # Engines publish their status every 0.5 s: the steps just run show up within a beat or two.
        _wait(lambda: any(status.num_steps > 0 for status in stack.engines().values()), 10)
        served = {sid for sid, status in stack.engines().items() if status.num_steps > 0}
        assert served, "no engine ran a step"
        # `conveyor health` (every compose healthcheck) finds the engine processes by the ids
        # they recorded, and the gateway by its port.
        for args in (["--role", "scheduler"], ["--role", "executor"], ["--role", "gateway", "--port", str(stack.ports[0])]):
            assert _health(stack, *args).returncode == 0, args
        probe = _health(stack, "--role", "executor", "--id", "no-such-executor")
        assert probe.returncode == 1 and "no-such-executor is not beating" in probe.stderr

        # A scheduler killed outright never releases its claim: it expires, and a new scheduler
        # started without an id claims the orphaned executor.
        victim = next(sid for sid in paired)
        victim_name = next(n for n in ("scheduler0", "scheduler1") if _logged_id(tmp_path / f"{n}.log", victim))
        stack.procs[victim_name].send_signal(signal.SIGKILL)
        stack.procs[victim_name].wait()
        stack.spawn_scheduler(2)
        _wait(lambda: paired[victim] in _executors(stack).values() and victim not in _executors(stack), 60)
        survivors = _executors(stack)
        assert len(survivors) == 2 and len(set(survivors.values())) == 2, survivors
        r = client.completions.create(model=model, prompt="after the failover", max_tokens=4, temperature=0)
        assert r.usage is not None and r.usage.completion_tokens == 4
    except BaseException:
        print(stack.logs(), file=sys.stderr)
        raise
    finally:
        stack.stop()


def test_scheduler_frozen_past_its_claim_goes_on_without_waiting_for_a_lost_step(tiny_model: Any, tmp_path: Path) -> None:
    """A scheduler frozen (SIGSTOP, a paused VM) for longer than its claim's TTL lets its claim
    lapse: its executor stops serving it and offers itself again, with steps of it in flight.
    Once the scheduler runs again and takes the claim back, the executor goes on where it stopped,
    so the scheduler gets its results, rather than waiting out ``--result-timeout`` for steps that
    were never run; the stream ends as without the fault."""
    stack = Stack(
        tiny_model(),
        tmp_path,
        auto_pairing=True,
        executor_args=("--num-blocks", "256"),
        scheduler_args=("--result-timeout", "60"),
    )
    body = {"prompt": "def frozen(x):", "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}
    try:
        stack.start()
        _wait(lambda: len(_executors(stack)) == 1, 60)
        url = f"{stack.urls[0]}/v1/completions"
        want = "".join(_stream_texts(url, body))
        texts: list[str] = []
        gaps: list[float] = []
        last = time.monotonic()
        for text in _stream_texts(url, body):
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            texts.append(text)
            if len(texts) == 20:  # mid-stream: freeze the scheduler past its claim's TTL
                proc = stack.procs["scheduler0"]
                proc.send_signal(signal.SIGSTOP)
                time.sleep(3 * stack.heartbeat_ttl_ms / 1000)
                proc.send_signal(signal.SIGCONT)
                last = time.monotonic()
        assert "".join(texts) == want
        # After the freeze: the claim taken back and the executor going on, not the 60 s result timeout.
        assert max(gaps[20:]) < 20, f"the stream paused {max(gaps[20:]):.1f} s after the scheduler ran again"
        assert "claimed again by scheduler" in stack.logs(200)  # it had let the scheduler go, and went on
        bindings = (tmp_path / "scheduler0.log").read_text(errors="replace").count("bound executor")
        assert bindings == 1, f"{bindings} bindings: the scheduler rebound (and recomputed) instead of going on"
    except BaseException:
        print(stack.logs(), file=sys.stderr)
        raise
    finally:
        stack.stop()


def _stream_texts(url: str, body: dict[str, Any]) -> Iterator[str]:
    with httpx.stream("POST", url, json=body, timeout=httpx.Timeout(120, connect=5)) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                payload = json.loads(line[6:])
                assert "error" not in payload, payload
                yield payload["choices"][0]["text"]


def test_a_refresh_during_a_release_does_not_take_the_claim_back(tmp_path: Path) -> None:
    """The engine thread gives its executor up and claims one again (`_claim`) while the claim
    thread refreshes. A refresh between the release and the new claim must not take the released
    claim back for nobody (the binding no longer names it, so nobody would refresh it and the new
    claim would fail, leaving the executor to wait out that claim's TTL): the two take turns."""
    url, proc = find_redis(tmp_path)
    names = Names(f"test-pairing-{uuid.uuid4().hex[:8]}")
    transport = SyncTransport(url, names, owner="test")
    binding = ExecutorBinding(transport, "s-a", auto=True, ttl_ms=60_000, result_timeout_s=30, redis_restarted=threading.Event())
    pairing = binding.pairing
    assert pairing is not None
    offer = ExecutorOffer(transport.redis, names, ttl_ms=60_000)
    try:
        transport.redis.set(names.heartbeat("executor", "e"), "1", px=60_000)  # a live executor
        offer.announce("e")  # it let this scheduler go and offers itself again
        assert pairing.try_claim("e", "s-a")
        binding.claimed = "e"
        binding.claim_lost.set()  # the step loop is to give it up and claim again
        release = pairing.release
        refresh = threading.Thread(target=binding._refresh_claim)

        def release_while_refreshing(executor_id: str, scheduler_id: str) -> bool:
            released = release(executor_id, scheduler_id)
            refresh.start()  # the claim thread's turn comes now
            refresh.join(0.3)
            return released

        pairing.release = release_while_refreshing  # type: ignore[method-assign]
        assert binding._claim()  # given up, and claimed again at once
        refresh.join(5)
        assert binding.claimed == "e" and offer.owner("e") == "s-a" and not binding.claim_lost.is_set()
    finally:
        keys = list(transport.redis.scan_iter(match=f"{names.namespace}:*"))
        if keys:
            transport.redis.delete(*keys)
        transport.close()
        if proc is not None:
            proc.kill()


def _health(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "infra.cli", "health", *args]
    return subprocess.run(cmd, env=stack._env(), cwd=REPO, capture_output=True, text=True, timeout=60)


def test_health_reports_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    from infra.health import main

    monkeypatch.setenv("CONVEYOR_RUN_DIR", str(tmp_path))
    assert main(["--role", "scheduler"]) == 1
    assert "no scheduler has started here yet" in capsys.readouterr().err
    port = free_port()  # nothing listens there
    assert main(["--role", "gateway", "--port", str(port), "--timeout", "2"]) == 1
    assert f"127.0.0.1:{port}/health" in capsys.readouterr().err


def _logged_id(log: Path, scheduler_id: str) -> bool:
    return f"scheduler {scheduler_id} up" in log.read_text(errors="replace")


def test_every_key_a_stack_leaves_behind_expires(tiny_model: Any, tmp_path: Path) -> None:
    """Whatever way its processes end, a deployment leaves no Redis key without a TTL: a scheduler
    killed after binding (with ``auto`` ids, a new id and streams each time), a dead letter, the
    engines set and the unpaired executors once nobody is left to trim them."""
    stack = Stack(tiny_model(), tmp_path, auto_pairing=True, executor_args=("--num-blocks", "128"))
    try:
        stack.start()
        _wait(lambda: len(_executors(stack)) == 1, 60)
        client = openai.OpenAI(base_url=f"{stack.urls[0]}/v1", api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        text = "".join(
            c.choices[0].text
            for c in client.completions.create(model=model, prompt="hi", max_tokens=3, temperature=0, stream=True)
        )
        assert text
        first = next(iter(_executors(stack)))
        stack.redis.xadd(stack.names.requests(first), {b"m": b"not msgpack"})  # dead-lettered by the scheduler
        _wait(lambda: stack.redis.exists(stack.names.dead_letter), 30)
        # A scheduler killed outright; its successor (a new id) binds the executor and is killed too.
        name = next(n for n in stack.procs if n.startswith("scheduler"))
        stack.procs[name].send_signal(signal.SIGKILL)
        stack.procs[name].wait()
        stack.spawn_scheduler(1)
        _wait(lambda: set(_executors(stack)) - {first}, 60)
        stack.procs["scheduler1"].send_signal(signal.SIGKILL)
        stack.procs["scheduler1"].wait()
        # The executor announces itself again; then it and the gateway stop as on a deploy.
        _wait(lambda: stack.redis.exists(stack.names.unpaired_executors), 30)
        stop_all([p for n, p in stack.procs.items() if not n.startswith("scheduler")])
        keys = sorted(k.decode() for k in stack.redis.scan_iter(match=f"{stack.namespace}:*", count=1000))
        assert any(":steps:" in k for k in keys) and stack.names.dead_letter in keys, keys
        without_ttl = [k for k in keys if stack.redis.pttl(k) == -1]
        assert not without_ttl, without_ttl
    except BaseException:
        print(stack.logs(), file=sys.stderr)
        raise
    finally:
        stack.stop()
