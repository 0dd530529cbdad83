"""Tenants over the real stack (two gateways, real Redis, the `openai` client and httpx): each API
key owns its streams. Another key cannot read, cut or adopt them, and may use the same
``X-Request-Id``; the owner resumes on any gateway; a wrong key is a 401; no key reaches Redis or a log."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from infra.stack import Stack

pytestmark = pytest.mark.stack

KEY_A = "sk-tenant-a-0123456789"  # a flag
KEY_B = "sk-tenant-b-9876543210"  # CONVEYOR_API_KEY, with a third
KEY_C = "sk-tenant-c-from-a-file"  # the key file
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def stack(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = Path(tmp_path_factory.mktemp("tenants"))
    key_file = workdir / "api-keys"
    key_file.write_text(f"# mounted secret\n\n{KEY_C}\n")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CONVEYOR_API_KEY", f"{KEY_B},sk-unused")
        env.setenv("CONVEYOR_TENANT_SECRET", "tenant-secret-of-this-deployment")
        s = Stack(
            tiny_model(),
            workdir,
            gateways=2,
            gateway_args=("--api-key", KEY_A, "--api-key-file", str(key_file)),
        )
        s.start()
    yield s
    s.stop()


def _client(stack: Stack, key: str, gateway: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.urls[gateway]}/v1", api_key=key, max_retries=0, timeout=60)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _events(lines: Iterator[str], limit: int | None = None) -> list[tuple[str, str]]:
    """(id, data) of each SSE event, up to ``limit`` events."""
    out: list[tuple[str, str]] = []
    event_id = ""
    for line in lines:
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            out.append((event_id, line[6:]))
            if limit is not None and len(out) == limit:
                break
    return out


def _text(events: list[tuple[str, str]]) -> str:
    return "".join(
        json.loads(data)["choices"][0]["text"] for _, data in events if data != "[DONE]" and json.loads(data)["choices"]
    )


def test_a_wrong_or_missing_key_is_401_and_every_configured_key_is_served(stack: Stack) -> None:
    for key in ("sk-wrong", KEY_A[:-1]):
        with pytest.raises(openai.AuthenticationError) as info:
            _client(stack, key).completions.create(model="", prompt="hi", max_tokens=2)
        assert info.value.code == "invalid_api_key"
    assert httpx.post(f"{stack.urls[1]}/v1/completions", json={"prompt": "hi"}, timeout=30).status_code == 401
    assert httpx.get(f"{stack.urls[1]}/v1/streams/anything", timeout=30).status_code == 401
    for key in (KEY_A, KEY_B, "sk-unused", KEY_C):  # flag, environment (comma-separated), key file
        out = _client(stack, key, 1).completions.create(model="", prompt="hi", max_tokens=3, extra_body=NO_EOS)
        assert out.usage is not None and out.usage.completion_tokens == 3


def test_another_key_can_neither_read_nor_cut_nor_adopt_a_stream(stack: Stack) -> None:
    rid = f"tenant-{uuid.uuid4().hex[:8]}"
    body = {"model": "", "prompt": "def f(x):", "max_tokens": 40, "temperature": 0, "stream": True, **NO_EOS}
    whole = _client(stack, KEY_A).completions.create(
        model="", prompt="def f(x):", max_tokens=40, temperature=0, extra_body=NO_EOS
    )
    a, b = stack.urls
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{a}/v1/completions", json=body, headers={"X-Request-Id": rid, **_auth(KEY_A)}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            part = _events(lines, limit=3)
            # In flight: to another key, on either gateway, the stream does not exist.
            for url in (a, b):
                for key in (KEY_B, KEY_C):
                    resp = http.get(f"{url}/v1/streams/{rid}", headers={"Last-Event-ID": part[-1][0], **_auth(key)})
                    assert resp.status_code == 404 and resp.json()["error"]["code"] == "stream_not_found"
            rest = _events(lines)  # not cut off: the owner's stream runs to its end here
        assert _text(part + rest) == whole.choices[0].text and rest[-1][1] == "[DONE]"
        # Ended, still resumable by its owner on the other gateway (from the middle), and by nobody else.
        with http.stream("GET", f"{b}/v1/streams/{rid}", headers={"Last-Event-ID": part[-1][0], **_auth(KEY_A)}) as r:
            assert r.status_code == 200 and r.headers["x-request-id"] == rid
            resumed = _events(r.iter_lines())
        assert _text(part + resumed) == whole.choices[0].text
        assert http.get(f"{b}/v1/streams/{rid}", headers=_auth(KEY_B)).status_code == 404


def test_the_owner_resumes_a_live_stream_on_another_gateway(stack: Stack) -> None:
    rid = f"tenant-live-{uuid.uuid4().hex[:8]}"
    body = {"model": "", "prompt": "x = [", "max_tokens": 60, "temperature": 0, "stream": True, **NO_EOS}
    whole = _client(stack, KEY_C).completions.create(model="", prompt="x = [", max_tokens=60, temperature=0, extra_body=NO_EOS)
    a, b = stack.urls
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{a}/v1/completions", json=body, headers={"X-Request-Id": rid, **_auth(KEY_C)}) as r:
            part = _events(r.iter_lines(), limit=4)
        # The first gateway's client hung up; the owner continues the stream on the second one.
        with http.stream("GET", f"{b}/v1/streams/{rid}", headers={"Last-Event-ID": part[-1][0], **_auth(KEY_C)}) as r:
            assert r.status_code == 200
            rest = _events(r.iter_lines())
    assert _text(part + rest) == whole.choices[0].text and rest[-1][1] == "[DONE]"


def test_two_keys_may_use_the_same_request_id(stack: Stack) -> None:
    rid = f"shared-{uuid.uuid4().hex[:8]}"
    kwargs: dict[str, Any] = dict(model="", max_tokens=30, temperature=0, extra_body=NO_EOS)
    expected = {
        key: _client(stack, key).completions.create(prompt=p, **kwargs).choices[0].text
        for key, p in ((KEY_A, "a = "), (KEY_B, "b = "))
    }
    headers = {"X-Request-Id": rid}
    stream_a = _client(stack, KEY_A, 0).completions.create(prompt="a = ", stream=True, extra_headers=headers, **kwargs)
    first_a = next(iter(stream_a))  # A's stream holds the id (in flight)...
    # ...for A alone: B's stream of the same id, on either gateway, is no conflict.
    stream_b = _client(stack, KEY_B, 1).completions.create(prompt="b = ", stream=True, extra_headers=headers, **kwargs)
    chunks_b = list(stream_b)
    chunks_a = [first_a, *stream_a]
    assert {c.id for c in chunks_a} == {c.id for c in chunks_b} == {rid}
    assert "".join(c.choices[0].text for c in chunks_a if c.choices) == expected[KEY_A]
    assert "".join(c.choices[0].text for c in chunks_b if c.choices) == expected[KEY_B]
    with pytest.raises(openai.ConflictError):  # within one tenant the id still names one stream
        _client(stack, KEY_B, 0).completions.create(prompt="b = ", stream=True, extra_headers=headers, **kwargs)
    # Each owner resumes its own stream under the shared id.
    with httpx.Client(timeout=60) as http:
        for key, url in ((KEY_A, stack.urls[1]), (KEY_B, stack.urls[0])):
            events = _events(http.get(f"{url}/v1/streams/{rid}", headers=_auth(key)).text.splitlines())
            assert _text(events) == expected[key]


def test_no_key_reaches_redis_or_a_log(stack: Stack) -> None:
    r = redis.Redis.from_url(stack.redis_url)
    names = [name.decode() for name in r.scan_iter(match=f"{stack.namespace}:*")]
    assert any(":journal:" in name for name in names)
    for key in (KEY_A, KEY_B, KEY_C):
        assert not any(key in name for name in names)
        for name in names:
            if r.type(name) == b"stream":
                assert all(key.encode() not in v for _, entry in r.xrange(name) for v in entry.values())
    logs = "".join(path.read_text(errors="replace") for path in stack.workdir.glob("*.log"))
    assert not any(key in logs for key in (KEY_A, KEY_B, KEY_C, "tenant-secret-of-this-deployment"))


def test_a_stored_response_belongs_to_its_key(stack: Stack) -> None:
    """The Responses API's stored responses are the tenant's: another key gets 404 on retrieve,
    delete and as ``previous_response_id``; a background response runs under its key too."""
    mine = _client(stack, KEY_A).responses.create(model="", input="hello", max_output_tokens=3, temperature=0)
    other = _client(stack, KEY_B, gateway=1)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model="", input="more", previous_response_id=mine.id, max_output_tokens=2)
    assert _client(stack, KEY_A, gateway=1).responses.retrieve(mine.id).output_text == mine.output_text
    queued = _client(stack, KEY_C).responses.create(model="", input="later", max_output_tokens=3, background=True)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(queued.id)
    owner = _client(stack, KEY_C, gateway=1)
    for _ in range(600):
        done = owner.responses.retrieve(queued.id)
        if done.status not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    # It ran to its token limit under its own key: "incomplete" is the Responses API's word for that.
    assert done.status == "incomplete" and done.incomplete_details is not None
    assert done.incomplete_details.reason == "max_output_tokens" and done.usage is not None and done.usage.output_tokens == 3


def test_a_streamed_background_response_replays_to_its_key_only(stack: Stack) -> None:
    """``retrieve(id, stream=True)`` of a background stream: the owner gets its events on any
    gateway, another key 404 (before any event)."""
    events = list(
        _client(stack, KEY_A).responses.create(model="", input="later", max_output_tokens=3, background=True, stream=True)
    )
    assert events[-1].type == "response.incomplete"
    with pytest.raises(openai.NotFoundError):
        list(_client(stack, KEY_B, gateway=1).responses.retrieve(events[0].response.id, stream=True, starting_after=0))
    again = list(_client(stack, KEY_A, gateway=1).responses.retrieve(events[0].response.id, stream=True, starting_after=0))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in events[1:]]
