"""The id a client gives a request: the ``X-Request-Id`` header, or vLLM's body field
``request_id`` (the header wins, as in vLLM). It becomes the response id, and is echoed in the
response's ``X-Request-Id`` (errors too, once known: ``request.state.response_id``).
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from gateway.http.errors import bad
from gateway.openai.json_input import typename

# A client's request id becomes the response id and a prefix of the engine request id: it shows in
# logs, Redis key names and URLs (``/v1/streams/{id}``), so it is short and visible ASCII only.
MAX_REQUEST_ID_CHARS = 128


def parse_request_id(value: Any, name: str = "X-Request-Id") -> str | None:
    """The client's ``X-Request-Id`` (or vLLM's body field ``request_id``: ``name``; None when
    absent or blank); a 400 unless it is at most `MAX_REQUEST_ID_CHARS` visible ASCII characters
    (no spaces or control characters)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if not isinstance(value, str):
        raise bad(f"{name} must be a string, got {typename(value)}", name, "invalid_request_id")
    value = value.strip()
    if len(value) > MAX_REQUEST_ID_CHARS:
        raise bad(f"{name} may be at most {MAX_REQUEST_ID_CHARS} characters, got {len(value)}", name, "invalid_request_id")
    if not all("!" <= c <= "~" for c in value):
        raise bad(
            f"{name} must be visible ASCII characters (no spaces or control characters), got {ascii(value)[:80]}",
            name,
            "invalid_request_id",
        )
    return value


def header_request_id(request: Request) -> str | None:
    """The client's valid ``X-Request-Id`` (a 400 if it is not valid), echoed from here on."""
    client_id = parse_request_id(request.headers.get("x-request-id"))
    request.state.response_id = client_id
    return client_id


def request_id_of(request: Request, header_id: str | None, body: Any) -> str | None:
    """The request's id: ``header_id``, else vLLM's body field ``request_id`` under the same rules;
    the field is checked either way. Echoed from here on."""
    body_id = parse_request_id(body.get("request_id"), "request_id") if isinstance(body, dict) else None
    if header_id is None and body_id is not None:
        request.state.response_id = body_id
        return body_id
    return header_id
