"""What a streaming response's journal holds, for the gateway that resumes it (``journal:<id>``).

A response (`gateway.http.completions`) has one journal for all its choices: one `JournalHeader`
per prompt, naming its choices' request ids (``choice_ids``), then every choice's routes (one
`Route` per attempt) and outputs, each tagged with its request id (`gateway.engine.client`). One
journal, not one per choice, so that a response id is claimed once (a client's ``X-Request-Id``
names at most one stream), its TTL is refreshed by whichever choice writes, and a scheduler
journals every orphaned choice in it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from common.protocol import ENTRY_FIELD, JournalHeader, Route, StepOutputs, decode
from gateway.engine.client import EngineClient
from gateway.engine.handle import base_request_id
from gateway.http.errors import ApiError
from gateway.openai.json_input import preview
from gateway.openai.schema import ChatParsers, GenerationSpec, parse_chat, parse_completion


def stream_not_found(response_id: str) -> ApiError:
    """The answer to resuming a stream that has no journal (a 404)."""
    return ApiError(
        404,
        f"no resumable stream {preview(response_id)} (unknown, or older than the resume window)",
        "not_found_error",
        code="stream_not_found",
    )


def journal_body(body: dict[str, Any], kind: str) -> str:
    """The request's JSON for a journal, without its prompt: the prompt travels as token ids (and
    echo text) beside it, and the parsers only need a valid stand-in to rebuild the parameters."""
    stand_in = {"prompt": [0]} if kind == "completion" else {"messages": [{"role": "user", "content": ""}]}
    return json.dumps({**body, **stand_in})


def journaled_spec(header: JournalHeader) -> GenerationSpec:
    """The parameters of the request ``header`` journaled, parsed as the gateway that accepted it
    did (with its output parsers, whatever this gateway's are)."""
    body = json.loads(header.body)
    if header.kind != "chat":
        return parse_completion(body)
    spec = parse_chat(body, ChatParsers(header.tool_parser or None, header.reasoning_parser or None))
    spec.reasoning_phase = header.reasoning_phase
    return spec


@dataclass(slots=True)
class Journal:
    """A response's journal, read back: its headers (one per prompt, in order), the current route
    of each choice (by request id, the latest attempt's) and every output, in order."""

    headers: list[JournalHeader] = field(default_factory=list)
    routes: dict[str, Route] = field(default_factory=dict)
    outputs: list[StepOutputs] = field(default_factory=list)

    def single(self) -> tuple[JournalHeader | None, Route | None]:
        """A one-choice response's header and current route (None where missing)."""
        return (self.headers[0] if self.headers else None), next(iter(self.routes.values()), None)


async def read_journal(client: EngineClient, response_id: str) -> Journal:
    """The journal of ``response_id``, of one choice or several (empty when it does not exist)."""
    t = client.transport
    entries = await t.call(t.redis.xrange, client.names.journal(response_id), deadline_s=5)
    out = Journal()
    for _, entry in entries:
        msg = decode(entry[ENTRY_FIELD], (JournalHeader, Route, StepOutputs))
        if isinstance(msg, JournalHeader):
            out.headers.append(msg)
        elif isinstance(msg, Route):
            out.routes[base_request_id(msg.request_id)] = msg
        else:
            out.outputs.append(msg)
    return out
