"""The served ``/openapi.json`` describes the request bodies of the completion endpoints, and
publishing them leaves how bodies are read (and refused) as it was."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from starlette.testclient import TestClient

from gateway.http.config import GatewayConfig
from gateway.http.routes import create_app

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def doc() -> Iterator[dict[str, Any]]:
    # No lifespan (no `with`): the document needs no Redis.
    client = TestClient(create_app(GatewayConfig(redis_url="redis://127.0.0.1:1/0", namespace="test-openapi")))
    response = client.get("/openapi.json")
    assert response.status_code == 200
    yield response.json()


def _body_schema(doc: dict[str, Any], path: str) -> dict[str, Any]:
    body = doc["paths"][path]["post"]["requestBody"]
    assert body["required"] is True
    ref = body["content"]["application/json"]["schema"]["$ref"]
    return {**doc["components"]["schemas"][ref.rsplit("/", 1)[1]], "components": doc["components"]}


@pytest.mark.parametrize(
    ("path", "required", "fields", "valid", "invalid"),
    [
        (
            "/v1/completions",
            ["prompt"],
            {"prompt", "max_tokens", "temperature", "stream", "logprobs", "echo", "n", "seed", "stop"},
            {"model": "m", "prompt": [[1, 2], [3]], "max_tokens": 5, "stop": ["\n"], "some_new_field": 1},
            {"prompt": {"not": "a prompt"}},
        ),
        (
            "/v1/chat/completions",
            ["messages"],
            {"messages", "max_completion_tokens", "tools", "tool_choice", "response_format", "logprobs", "top_logprobs"},
            {"messages": [{"role": "user", "content": "hi"}], "tools": [], "stream": True},
            {"messages": []},
        ),
    ],
)
def test_openapi_describes_the_request_bodies(
    doc: dict[str, Any], path: str, required: list[str], fields: set[str], valid: dict[str, Any], invalid: dict[str, Any]
) -> None:
    schema = _body_schema(doc, path)
    assert schema["type"] == "object" and schema["required"] == required
    assert fields <= set(schema["properties"])
    # The document resolves (its $refs point into components) and says what a body looks like.
    jsonschema.validate(valid, schema, cls=jsonschema.Draft202012Validator)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(invalid, schema, cls=jsonschema.Draft202012Validator)


def test_bodies_are_still_checked_by_the_gateway_not_by_the_documented_models() -> None:
    """A body the documented model would refuse gets the gateway's own 400 (field and reason), not FastAPI's 422."""
    with TestClient(create_app(GatewayConfig(redis_url="redis://127.0.0.1:1/0", namespace="test-openapi"))) as c:
        response = c.post("/v1/chat/completions", json={"messages": []})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "messages"
